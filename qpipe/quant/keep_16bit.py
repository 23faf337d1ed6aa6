"""keep_16bit entries checked against the model's linears from config.json.

llm-compressor's `ignore` skips an entry that names no module without a word, so a typo
(`self_attn.qproj`) quantizes the layer the user meant to protect, and the accuracy gate is the
first to notice. No torch import: recipe validation calls it.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

from qpipe.quant.group_size import REQUIRED_FIELDS, linear_in_features, matches_any


class Keep16BitError(ValueError):
    """A keep_16bit entry that matches none of the model's linear layers."""


def check_keep_16bit(config: Mapping[str, Any], patterns: list[str]) -> None:
    """Raise Keep16BitError for the first entry of `patterns` that matches no linear of a
    Llama-family `config` (other architectures are left to llm-compressor)."""
    if not all(k in config for k in REQUIRED_FIELDS):
        return
    names = [*linear_in_features(config), "lm_head"]
    for pattern in patterns:
        if any(matches_any(name, [pattern]) for name in names):
            continue
        close = difflib.get_close_matches(pattern.removeprefix("re:"), names, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise Keep16BitError(
            f"{pattern!r} matches none of the model's linear layers; {hint}names look like "
            f"{names[0]!r} or 're:model\\.layers\\.0\\..*' for a whole block"
        )
