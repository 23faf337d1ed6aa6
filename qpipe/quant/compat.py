"""Compatibility shims for llm-compressor on machines without an accelerator.

llm-compressor 0.14's AWQ pins its cached activations (`IntermediatesCache.pin_memory`) to speed up
host-to-device copies; on a CPU-only machine `Tensor.pin_memory()` raises "Cannot access accelerator
device when none is available", so AWQ cannot run at all. Pinning is only an optimisation for
copies that never happen on CPU, so skipping it changes no result.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def cpu_safe_pinning() -> Iterator[bool]:
    """While active, IntermediatesCache.pin_memory is a no-op if no accelerator is present.

    Yields whether the patch is in effect; the original method is restored on exit.
    """
    import torch
    from llmcompressor.pipelines.cache import IntermediatesCache

    if torch.accelerator.is_available():
        yield False
        return
    original = IntermediatesCache.__dict__["pin_memory"]

    def pin_memory(
        self: IntermediatesCache, batch_index: int, input_names: list[str] | None = None
    ) -> None:
        """Nothing to pin for: without an accelerator, values are never copied to a device."""

    IntermediatesCache.pin_memory = pin_memory
    try:
        yield True
    finally:
        IntermediatesCache.pin_memory = original
