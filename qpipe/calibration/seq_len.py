"""calibration.seq_len against the model's context, checked before any window is allocated.

The calibrate stage pads every sample to seq_len (two int64 arrays of num_samples x seq_len), so a
seq_len no model reads is a MemoryError after convert, and one past the model's positions
calibrates on windows the model was never trained for. No torch import: recipe validation calls it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Longer than any model's context: checked even where the model's config cannot be read (an hf:
# model not downloaded yet, a GGUF header without the field).
MAX_SEQ_LEN = 1 << 20
USUAL = "calibration windows are usually 512 to 2048 tokens"


class SeqLenError(ValueError):
    """A calibration window longer than the model (or any model) reads."""


def check_seq_len(seq_len: int, model_config: Mapping[str, Any] | None = None) -> None:
    """Raise SeqLenError when `seq_len` exceeds the model's `max_position_embeddings` (from its
    config.json fields, when given and known) or MAX_SEQ_LEN."""
    limit = (model_config or {}).get("max_position_embeddings")
    if isinstance(limit, int) and seq_len > limit:
        raise SeqLenError(
            f"{seq_len} is longer than the model's context (max_position_embeddings {limit}); "
            f"use at most {limit} ({USUAL})"
        )
    if seq_len > MAX_SEQ_LEN:
        raise SeqLenError(
            f"{seq_len} is longer than any model's context; use at most the model's "
            f"max_position_embeddings ({USUAL})"
        )
