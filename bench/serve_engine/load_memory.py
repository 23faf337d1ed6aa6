"""Memory of loading a model for CPU serving: the peak of the process's anonymous memory while
`load_model` reads and packs the weights, and what the packed model holds. Not a test: the peak
depends on the allocator and on what the process had allocated before.

    .venv/bin/python bench/serve_engine/load_memory.py CHECKPOINT_OR_ARTIFACT [--dtype float32]

The checkpoint's mmapped file pages are left out (the kernel reclaims them under pressure); the
allocator keeps freed memory as the engine does (`keep_freed_memory`), so the peak is what a
served process goes on holding.
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

import torch
from transformers import AutoConfig

import qpipe.serve.artifact  # noqa: F401 - imported before the baseline, as load_model does
import qpipe.serve.models.llama  # noqa: F401
from qpipe.serve.host_memory import keep_freed_memory
from qpipe.serve.layers import cpu_kernels
from qpipe.serve.loader import load_model

MIB = 2**20


def anonymous_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("/proc/self/status has no RssAnon line (Linux only)")


def held(model: torch.nn.Module) -> tuple[float, int]:
    """MiB of the distinct tensors the model keeps (buffers and packed weights), and how many
    oneDNN-packed weights it holds besides, whose opaque tensors tell no size."""
    tensors, opaque = {}, 0
    for module in model.modules():
        for value in [*vars(module).values(), *module.buffers(recurse=False)]:
            if isinstance(value, torch.Tensor) and value.is_mkldnn:
                opaque += 1
            elif isinstance(value, torch.Tensor):
                tensors[value.data_ptr()] = value.nbytes
    return sum(tensors.values()) / MIB, opaque


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", type=Path)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch-hint", type=int, default=64)
    args = parser.parse_args()
    keep_freed_memory()
    cpu_kernels.load()
    AutoConfig.from_pretrained(args.model)
    base = anonymous_mib()
    peak = base
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, anonymous_mib())
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    model = load_model(args.model, getattr(torch, args.dtype), "cpu", 2048, args.batch_hint)
    took = time.perf_counter() - start
    done.set()
    sampler.join()
    mib, opaque = held(model)
    print(
        f"{args.model.name} in {args.dtype}: peak +{max(peak, anonymous_mib()) - base:.0f} MiB "
        f"of anonymous memory while loading ({took:.1f} s); the model holds {mib:.0f} MiB"
        + (f" and {opaque} oneDNN-packed weights" if opaque else "")
    )


if __name__ == "__main__":
    main()
