"""BlockManager: refcounts, chained prefix hashes with a token check, LRU eviction."""

from __future__ import annotations

from qpipe.serve.block_manager import BlockManager, chain_hash
from qpipe.serve.sampling_params import SamplingParams
from qpipe.serve.sequence import Sequence

BS = 4


def seq(tokens: list[int], name: str = "s") -> Sequence:
    return Sequence(name, tokens, SamplingParams())


def computed(bm: BlockManager, s: Sequence) -> Sequence:
    """Pretend the model ran over all of `s`'s tokens, as a scheduled step does."""
    bm.register_blocks(s, s.num_tokens)
    s.num_computed_tokens = s.num_tokens
    return s


def test_allocate_and_free_return_every_block() -> None:
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    a = seq(list(range(10)))
    assert bm.can_allocate(a)
    bm.allocate(a)
    assert len(a.block_table) == 3 and bm.num_free_blocks == 5
    bm.free_blocks(a)
    assert bm.num_free_blocks == 8 and a.block_table == [] and bm.usage == 0.0


def test_prefix_hit_shares_blocks_and_counts_tokens() -> None:
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    a = computed(bm, _allocated(bm, seq(list(range(10)), "a")))
    b = _allocated(bm, seq([*range(8), 99, 98, 97], "b"))
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert b.num_computed_tokens == 8
    assert all(bm.blocks[i].ref_count == 2 for i in a.block_table[:2])
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (10 + 11, 8)
    bm.free_blocks(a)
    assert all(bm.blocks[i].ref_count == 1 for i in b.block_table[:2])
    bm.free_blocks(b)
    assert bm.num_free_blocks == 8


def test_the_last_prompt_token_is_never_a_hit() -> None:
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    a = computed(bm, _allocated(bm, seq(list(range(8)), "a")))
    bm.free_blocks(a)
    b = _allocated(bm, seq(list(range(8)), "b"))
    assert b.num_computed_tokens == 4  # the second block holds the last token: recomputed


def test_hash_hit_with_different_tokens_is_a_miss() -> None:
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    a = computed(bm, _allocated(bm, seq(list(range(9)), "a")))
    bm.blocks[a.block_table[0]].token_ids = (7, 7, 7, 7)  # what a hash collision looks like
    b = _allocated(bm, seq(list(range(9)), "b"))
    assert b.num_computed_tokens == 0 and b.block_table[0] != a.block_table[0]


def test_prefix_chain_depends_on_earlier_blocks() -> None:
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    computed(bm, _allocated(bm, seq([1, 2, 3, 4, 5, 6, 7, 8, 9], "a")))
    b = _allocated(bm, seq([0, 0, 0, 0, 5, 6, 7, 8, 9], "b"))  # same 2nd block, other parent
    assert b.num_computed_tokens == 0


def test_the_chain_is_a_digest_no_client_can_steer_into_a_collision() -> None:
    """Python's hash of ints is public arithmetic modulo 2**61 - 1: two parents that differ by
    that modulus chained to the same tokens collided, which a crafted prompt could use to be
    served another prompt's K/V (only a block's own tokens are compared on a hit)."""
    tokens = (5, 6, 7, 8)
    assert hash((3, tokens)) == hash((3 + 2**61 - 1, tokens))  # what the old chain did
    parents = [chain_hash(None, (i, 0, 0, 0)) for i in range(64)]
    chained = {chain_hash(parent, tokens) for parent in parents}
    assert len(chained) == len(parents) and all(len(c) == 32 for c in chained)
    assert chain_hash(None, (1, 2)) != chain_hash(None, (1 << 32 | 1, 2))  # ids are 64-bit


def test_lru_eviction_takes_the_oldest_free_block_and_drops_its_hash() -> None:
    bm = BlockManager(4, BS, enable_prefix_caching=True)
    old = computed(bm, _allocated(bm, seq([1, 1, 1, 1, 0], "old")))
    bm.free_blocks(old)
    new = computed(bm, _allocated(bm, seq([2, 2, 2, 2, 0], "new")))
    new_prefix = new.block_table[0]
    bm.free_blocks(new)
    # Three fresh blocks: old's two (freed first, tail first) and new's tail; new's cached prefix
    # block is the most recently freed, so it survives.
    filler = _allocated(bm, seq([3] * 12, "filler"))
    assert len(filler.block_table) == 3
    assert list(bm.hash_to_block.values()) == [new_prefix]
    bm.free_blocks(filler)
    hit = _allocated(bm, seq([2, 2, 2, 2, 0], "new2"))
    assert hit.num_computed_tokens == 4 and hit.block_table[0] == new_prefix
    assert _allocated(bm, seq([1, 1, 1, 1, 0], "old2")).num_computed_tokens == 0


def test_can_allocate_counts_revived_cached_blocks_as_used() -> None:
    bm = BlockManager(2, BS, enable_prefix_caching=True)
    a = computed(bm, _allocated(bm, seq([1, 2, 3, 4, 5], "a")))
    bm.free_blocks(a)
    assert bm.can_allocate(seq([1, 2, 3, 4, 5, 6], "b"))  # 1 hit + 1 fresh = 2 blocks
    assert not bm.can_allocate(seq([1, 2, 3, 4, 5, 6, 7, 8, 9], "c"))  # 1 hit + 2 fresh


def test_without_prefix_caching_nothing_is_shared() -> None:
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a = computed(bm, _allocated(bm, seq(list(range(9)), "a")))
    bm.free_blocks(a)
    assert _allocated(bm, seq(list(range(9)), "b")).num_computed_tokens == 0
    assert bm.prefix_cache_hits == 0


def test_append_slot_takes_a_block_only_at_a_boundary() -> None:
    bm = BlockManager(3, BS, enable_prefix_caching=True)
    s = _allocated(bm, seq([1, 2, 3, 4]))
    s.token_ids.append(5)
    assert bm.append_slot(s)
    assert len(s.block_table) == 2
    s.token_ids.append(6)
    assert bm.append_slot(s)
    assert len(s.block_table) == 2
    other = _allocated(bm, seq([9]))
    s.token_ids.extend([7, 8, 9])
    free = bm.num_free_blocks
    assert not bm.append_slot(s)  # the cache is full: nothing taken
    assert len(s.block_table) == 2 and bm.num_free_blocks == free == 0
    bm.free_blocks(other)
    bm.free_blocks(s)


def _allocated(bm: BlockManager, s: Sequence) -> Sequence:
    bm.allocate(s)
    return s
