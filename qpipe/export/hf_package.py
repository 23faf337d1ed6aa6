"""The `compressed-tensors` target: the quantized checkpoint as vLLM, SGLang, TGI and transformers
load it directly (config.json with quantization_config, safetensors, tokenizer, generation config).

Files are hard-linked when the store shares a filesystem with the input, so packaging a 70B model
costs no copy.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from qpipe.store.entry import MARKER

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


class PackageError(ValueError):
    """The quantized checkpoint lacks what a serving engine needs."""


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def package_checkpoint(src: Path, out: Path) -> list[str]:
    """Place `src`'s checkpoint files in `out`; return the file names.

    `src` is the quantize stage's store entry: its commit marker describes that entry, not the
    model, so it stays behind."""
    if not (src / "config.json").is_file() or not list(src.glob("*.safetensors")):
        raise PackageError(f"{src}: not a safetensors checkpoint (config.json, *.safetensors)")
    if not any((src / name).is_file() for name in TOKENIZER_FILES):
        raise PackageError(
            f"{src}: no tokenizer ({' or '.join(TOKENIZER_FILES)}); the quantize stage must "
            "save the tokenizer with the weights"
        )
    out.mkdir(parents=True, exist_ok=True)
    for file in sorted(p for p in src.iterdir() if p.is_file() and p.name != MARKER):
        _link_or_copy(file, out / file.name)
    if not (out / "generation_config.json").is_file():
        from transformers import AutoConfig, GenerationConfig

        GenerationConfig.from_model_config(AutoConfig.from_pretrained(out)).save_pretrained(out)
    return sorted(p.name for p in out.iterdir())
