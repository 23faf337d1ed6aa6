"""Decode-only steps on the GPU, replayed from CUDA graphs captured once at start.

Why: a decode step of a small model on a GPU is a few hundred kernel launches of a few
microseconds each; launched one by one from Python the step is bound by launch overhead, not by
the GPU (vLLM and nano-vllm capture decode for the same reason). A graph fixes every tensor
address and shape, so each step's inputs are copied into static buffers sized for the largest
batch, and one graph is captured per batch-size bucket; a step pads its batch up to the next
bucket. Padding rows are harmless by construction: they write their K/V into a scratch block
that the block manager never hands out, attend to one slot of it, and their logits are dropped.

The same static-buffer forward runs without a graph on CPU, which is how tests check that padding
and fixed-width block tables give exactly the eager step's results.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Sequence

import torch
from torch import nn

from qpipe.serve.layers.attention import AttentionMetadata, LayerCache

log = logging.getLogger(__name__)


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, then multiples of 8 up to `max_batch` (which is always included): small batches
    pad little, large ones pad by at most 7 rows."""
    sizes = [s for s in (1, 2, 4) if s < max_batch]
    sizes += range(8, max_batch, 8)
    return [*sizes, max_batch]


class DecodeGraphs:
    def __init__(
        self,
        model: nn.Module,
        caches: Sequence[LayerCache],
        max_batch: int,
        max_blocks_per_seq: int,
        scratch_block: int,
    ) -> None:
        self.model = model
        self.caches = caches
        self.buckets = batch_buckets(max_batch)
        self.max_blocks_per_seq = max_blocks_per_seq
        self._scratch_block = scratch_block
        block_size = caches[0].v.shape[1]
        self._scratch_slot = scratch_block * block_size  # its first slot
        device = caches[0].v.device
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.slot_mapping = torch.full(
            (max_batch,), self._scratch_slot, dtype=torch.long, device=device
        )
        self.block_tables = torch.full(
            (max_batch, max_blocks_per_seq), scratch_block, dtype=torch.int32, device=device
        )
        self.context_lens = torch.ones(max_batch, dtype=torch.int32, device=device)
        self.logits_indices = torch.arange(max_batch, device=device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}

    def fits(self, batch: int, table_width: int) -> bool:
        return batch <= self.buckets[-1] and table_width <= self.max_blocks_per_seq

    @torch.inference_mode()
    def capture(self) -> None:
        """One graph per bucket, largest first so the smaller ones reuse its memory pool. Each
        bucket runs once eagerly first: Triton compiles and cuBLAS picks its kernels outside
        the capture."""
        pool = None
        for bucket in reversed(self.buckets):
            self.forward(bucket)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._logits[bucket] = self.forward(bucket)
            pool = graph.pool()
            self._graphs[bucket] = graph
        torch.cuda.synchronize()
        log.info("decode CUDA graphs captured for batch sizes %s", self.buckets)

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
    ) -> torch.Tensor:
        """Logits [batch, vocab] of one decode step; inputs are host tensors of `batch` rows,
        `block_tables` [batch, width] with width <= max_blocks_per_seq."""
        batch, width = block_tables.shape
        bucket = self.buckets[bisect.bisect_left(self.buckets, batch)]
        self.input_ids[:batch].copy_(input_ids, non_blocking=True)
        self.positions[:batch].copy_(positions, non_blocking=True)
        self.slot_mapping[:batch].copy_(slot_mapping, non_blocking=True)
        self.context_lens[:batch].copy_(context_lens, non_blocking=True)
        self.block_tables[:batch, :width].copy_(block_tables, non_blocking=True)
        # rows past this batch may hold an earlier, larger batch: reset them to padding
        self.slot_mapping[batch:bucket].fill_(self._scratch_slot)
        self.context_lens[batch:bucket].fill_(1)
        self.block_tables[batch:bucket].fill_(self._scratch_block)
        graph = self._graphs.get(bucket)
        if graph is None:
            return self.forward(bucket)[:batch]
        graph.replay()
        return self._logits[bucket][:batch]

    def forward(self, bucket: int) -> torch.Tensor:
        """The model on the first `bucket` rows of the static buffers: what a graph records."""
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket],
            num_decode_tokens=bucket,
            block_tables=self.block_tables[:bucket],
            seq_lens=self.context_lens[:bucket],
            query_starts=None,
            decode_mask=None,
            prefills=(),
        )
        return self.model(
            self.input_ids[:bucket],
            self.positions[:bucket],
            self.caches,
            meta,
            self.logits_indices[:bucket],
        )
