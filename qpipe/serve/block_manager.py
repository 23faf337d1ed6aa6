"""The paged KV cache's bookkeeping: which block holds which tokens, who shares it, what to evict.

Blocks hold `block_size` token slots. A full block is registered under the chained hash of its
tokens (the hash of the previous block folded in) as soon as a step is scheduled to compute it, so
a later prompt with the same prefix reuses it instead of recomputing, even one admitted to that
same step: every layer writes the step's new K/V before any sequence attends, so the n choices of
one prompt compute it once. Freed blocks keep their hash and sit in an LRU queue: they are revived
on a hit and only overwritten when a fresh block is needed.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from qpipe.serve.sequence import Sequence


class Block:
    __slots__ = ("block_id", "hash", "ref_count", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: bytes | None = None
        self.token_ids: tuple[int, ...] = ()


def chain_hash(parent: bytes | None, token_ids: list[int] | tuple[int, ...]) -> bytes:
    """sha256 over the previous block's digest and this block's token ids. Python's `hash` of
    ints is public arithmetic modulo 2**61 - 1, so one client could craft a prefix whose chain
    collides with another's and be served that prompt's K/V (vLLM's CVE-2025-25183). The block's
    own tokens are compared on a hit as well, but a parent's are not."""
    digest = hashlib.sha256(parent or b"")
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in eviction order: oldest-freed first. dict keys give O(1) removal on a hit.
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block: dict[bytes, int] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _match_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding `seq`'s leading full blocks. The last prompt token is never served
        from cache: the model must run on at least one token to produce the next one."""
        if not self.enable_prefix_caching or seq.needs_prompt_logprobs:
            return []
        hits: list[int] = []
        parent: bytes | None = None
        for index in range((seq.num_tokens - 1) // self.block_size):
            tokens = seq.block_tokens(index, self.block_size)
            parent = chain_hash(parent, tokens)
            block_id = self.hash_to_block.get(parent)
            # NOTE: a hash collision must not serve another prompt's KV: compare the tokens too.
            if block_id is None or self.blocks[block_id].token_ids != tuple(tokens):
                break
            hits.append(block_id)
        return hits

    def can_allocate(self, seq: Sequence) -> bool:
        hits = self._match_prefix(seq)
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        return self.blocks_needed(seq.num_tokens) - len(hits) <= len(self.free) - revived

    def allocate(self, seq: Sequence) -> None:
        """Give `seq` blocks for all its current tokens, reusing cached prefix blocks."""
        assert not seq.block_table, f"{seq.request_id} already holds blocks"
        hits = self._match_prefix(seq)
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        seq.block_hashes = [self.blocks[b].hash for b in hits]  # type: ignore[misc]
        for _ in range(self.blocks_needed(seq.num_tokens) - len(hits)):
            seq.block_table.append(self._take_fresh_block())
        seq.num_computed_tokens = len(hits) * self.block_size
        self.prefix_cache_queries += seq.num_tokens
        self.prefix_cache_hits += seq.num_computed_tokens

    def _take_fresh_block(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None and self.hash_to_block.get(block.hash) == block_id:
            del self.hash_to_block[block.hash]
        block.hash = None
        block.token_ids = ()
        block.ref_count = 1
        return block_id

    def append_slot(self, seq: Sequence) -> bool:
        """A slot for `seq`'s newest token: True if its blocks have one or a free block now
        does, False (nothing taken) if the cache is full. One call per decode per step."""
        if len(seq.block_table) * self.block_size >= len(seq.token_ids):
            return True
        if not self.free:
            return False
        seq.block_table.append(self._take_fresh_block())
        return True

    def register_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Publish the full blocks among `seq`'s first `num_tokens` tokens in the prefix cache:
        their KV is computed, or will be by the step being scheduled."""
        if not self.enable_prefix_caching:
            return
        num_full = num_tokens // self.block_size
        for index in range(len(seq.block_hashes), num_full):
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            tokens = seq.block_tokens(index, self.block_size)
            block_hash = chain_hash(parent, tokens)
            seq.block_hashes.append(block_hash)
            block = self.blocks[seq.block_table[index]]
            if block.hash is None:
                block.hash = block_hash
                block.token_ids = tuple(tokens)
                self.hash_to_block.setdefault(block_hash, block.block_id)

    def free_blocks(self, seq: Sequence) -> None:
        # Tail blocks are freed first so they are evicted first: a shared prefix outlives them.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0
