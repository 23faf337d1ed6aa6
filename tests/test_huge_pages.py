"""Packed CPU weights copied onto mappings advised for transparent huge pages."""

from __future__ import annotations

import gc
import re
from pathlib import Path

import pytest
import torch

from qpipe.serve import huge_pages
from qpipe.serve.huge_pages import HugePageArena
from qpipe.serve.layers import cpu_kernels
from qpipe.serve.layers.linear import DenseLinear, pack_linear_weights

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
needs_huge_pages = pytest.mark.skipif(
    not HugePageArena.available() or not THP_MODE.is_file() or "[never]" in THP_MODE.read_text(),
    reason="no transparent huge pages on this system",
)


def on_huge_page_mapping(t: torch.Tensor) -> bool:
    """Whether the mapping that holds `t`'s first byte is eligible for huge pages (smaps)."""
    address = t.data_ptr()
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        match = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if match and int(match[1], 16) <= address < int(match[2], 16):
            fields = dict(entry.split(":", 1) for entry in lines[i + 1 : i + 30] if ":" in entry)
            return fields["THPeligible"].strip() == "1"
    raise AssertionError(f"no mapping holds {address:#x}")


@needs_huge_pages
def test_arena_copies_are_equal_aligned_and_on_huge_page_mappings() -> None:
    arena = HugePageArena()
    gen = torch.Generator().manual_seed(0)
    small = [torch.randn(n, 33, generator=gen) for n in (7, 100, 3)]  # odd byte counts
    large = torch.randint(0, 255, (huge_pages.OWN_MAPPING_BYTES + 1,), dtype=torch.uint8)
    copies = [arena.copy_of(t) for t in (*small, large)]
    for source, copy in zip((*small, large), copies, strict=True):
        assert torch.equal(copy, source) and copy.is_contiguous()
        assert copy.data_ptr() != source.data_ptr() and copy.data_ptr() % huge_pages.ALIGN == 0
        assert on_huge_page_mapping(copy)
    # the small ones share one mapping, one after another; the large one has its own (smaps may
    # show adjacent mappings as one, so the chunk's extent is the arena's)
    first = copies[0].data_ptr()
    assert copies[1].data_ptr() - first == -(-7 * 33 * 4 // 64) * 64
    assert not first <= copies[3].data_ptr() < first + huge_pages.CHUNK_BYTES
    del arena
    gc.collect()
    for source, copy in zip((*small, large), copies, strict=True):  # the tensors hold the mapping
        assert torch.equal(copy, source)


@needs_huge_pages
def test_packed_weights_move_onto_huge_pages_and_give_the_same_product() -> None:
    if not cpu_kernels.load():
        pytest.skip("the CPU kernels could not be built here")
    gen = torch.Generator().manual_seed(1)
    layer = DenseLinear(torch.randn(40, 64, generator=gen), torch.randn(40, generator=gen))
    x = torch.randn(5, 64, generator=gen)
    expected = layer(x)  # unpacked: torch's product
    assert pack_linear_weights(torch.nn.Sequential(layer), batch_hint=8) == 1
    if layer.packed.is_mkldnn:
        pytest.skip("this CPU packs fp32 weights for oneDNN, which stay where oneDNN put them")
    assert on_huge_page_mapping(layer.packed)
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
