"""The tokenized calibration set: fixed [N, seq_len] windows, their content hash, and the file.

The hash covers the tokens themselves (not the source file), so two datasets that tokenize to the
same windows are the same calibration set, and quantize can record exactly what it calibrated on.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from qpipe.calibration.selection import KeptSample, packed_ids

FILE_NAME = "calibration.safetensors"


@dataclass(frozen=True)
class TokenSet:
    input_ids: np.ndarray  # int64 [N, seq_len]
    attention_mask: np.ndarray  # int64 [N, seq_len]; 0 = padding

    @property
    def content_hash(self) -> str:
        digest = hashlib.sha256()
        for name, array in (("input_ids", self.input_ids), ("attention_mask", self.attention_mask)):
            digest.update(f"{name}:{array.dtype.str}:{list(array.shape)}\n".encode())
            digest.update(np.ascontiguousarray(array, dtype="<i8").tobytes())
        return f"sha256:{digest.hexdigest()}"

    def save(self, out_dir: Path) -> Path:
        from safetensors.numpy import save_file

        path = out_dir / FILE_NAME
        tensors = {"input_ids": self.input_ids, "attention_mask": self.attention_mask}
        save_file(tensors, str(path), metadata={"content_hash": self.content_hash})
        return path

    @classmethod
    def load(cls, directory: Path) -> TokenSet:
        from safetensors.numpy import load_file

        tensors = load_file(str(directory / FILE_NAME))
        return cls(input_ids=tensors["input_ids"], attention_mask=tensors["attention_mask"])


def one_per_row(kept: tuple[KeptSample, ...], seq_len: int, pad_id: int) -> TokenSet:
    """Each sample its own row: longer ones truncated, shorter ones right-padded and masked."""
    input_ids = np.full((len(kept), seq_len), pad_id, dtype=np.int64)
    attention_mask = np.zeros((len(kept), seq_len), dtype=np.int64)
    for row, sample in enumerate(kept):
        ids = sample.token_ids[:seq_len]
        input_ids[row, : len(ids)] = ids
        attention_mask[row, : len(ids)] = 1
    return TokenSet(input_ids, attention_mask)


def packed(
    kept: tuple[KeptSample, ...], seq_len: int, rows: int, eos_id: int | None
) -> tuple[TokenSet, int]:
    """Samples joined (EOS between) and cut into `rows` full windows; also the tokens left over."""
    stream = [t for sample in kept for t in packed_ids(sample.token_ids, eos_id)]
    used = rows * seq_len
    input_ids = np.asarray(stream[:used], dtype=np.int64).reshape(rows, seq_len)
    return TokenSet(input_ids, np.ones_like(input_ids)), len(stream) - used
