"""BlockManager rules: ref counts, chained-hash prefix cache, hashes kept until reuse, last token computed."""
import pytest

from jaxinfer.engine.block_manager import BlockManager
from jaxinfer.engine.sequence import Sequence
from jaxinfer.sampling_params import SamplingParams

BS = 4


def seq(tokens):
    return Sequence(list(tokens), SamplingParams(), seed=0, block_size=BS)


def computed(bm, s):
    """Pretend the step computed all of s's tokens."""
    s.num_computed_tokens = len(s)
    bm.cache_full_blocks(s)


def test_allocate_and_free_return_every_block():
    bm = BlockManager(8, BS)
    a = seq(range(10))
    assert bm.can_allocate(a)
    bm.allocate(a)
    assert len(a.block_table) == 3 and bm.num_free_blocks == 5
    bm.free_seq(a)
    assert bm.num_free_blocks == 8 and a.block_table == []


def test_prefix_hit_shares_blocks_and_counts_refs():
    bm = BlockManager(16, BS)
    a = seq(range(12))
    bm.allocate(a)
    computed(bm, a)
    b = seq(list(range(8)) + [99, 98, 97])           # shares the first two blocks
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert b.num_computed_tokens == b.num_cached_tokens == 8
    assert bm.blocks[a.block_table[0]].ref_count == 2
    bm.free_seq(a)
    assert bm.blocks[b.block_table[0]].ref_count == 1
    bm.free_seq(b)
    assert bm.num_free_blocks == 16


def test_chain_hash_depends_on_previous_blocks():
    bm = BlockManager(16, BS)
    a = seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    bm.allocate(a)
    computed(bm, a)
    b = seq([0, 0, 0, 0, 5, 6, 7, 8, 9])             # same second block, different first: no hit
    bm.allocate(b)
    assert b.num_cached_tokens == 0


def test_fully_cached_prompt_still_computes_last_token():
    bm = BlockManager(16, BS)
    a = seq(range(8))                                # exactly two full blocks
    bm.allocate(a)
    computed(bm, a)
    b = seq(range(8))
    bm.allocate(b)
    assert b.num_computed_tokens == 4                # the block holding the last token is recomputed
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]
    c = seq(range(9))
    bm.allocate(c)
    assert c.num_computed_tokens == 8                # 8 cached, token 9 computed


def test_freed_blocks_keep_hash_until_reallocated():
    bm = BlockManager(4, BS)
    a = seq(range(9))
    bm.allocate(a)
    computed(bm, a)
    bm.free_seq(a)
    assert bm.num_free_blocks == 4
    b = seq(range(9))
    assert bm.can_allocate(b)
    bm.allocate(b)                                   # revives a's first two blocks from the free list
    assert b.num_cached_tokens == 8 and bm.num_free_blocks == 1
    bm.free_seq(b)
    big = seq(range(100, 116))                       # takes all 4 blocks: old hashes are dropped
    bm.allocate(big)
    bm.free_seq(big)
    c = seq(range(9))
    bm.allocate(c)
    assert c.num_cached_tokens == 0


def test_chain_hash_is_sha256_of_the_chain():
    """Python's hash() of (previous hash, tokens) collides whenever two previous hashes are congruent mod 2**61 - 1
    (and xxHash-style tuple hashing can be inverted for chosen ints): the prefix cache must not key on it."""
    import hashlib
    from array import array

    from jaxinfer.engine.block_manager import chain_hash, salt_seed
    toks = (1, 2, 3, 4)
    assert hash((5, toks)) == hash((5 + 2**61 - 1, toks))              # the weakness of the old key
    first = chain_hash(None, toks)
    assert first == hashlib.sha256(array("q", toks).tobytes()).digest()
    assert chain_hash(first, toks) == hashlib.sha256(first + array("q", toks).tobytes()).digest()
    assert chain_hash(salt_seed("a"), toks) != chain_hash(salt_seed("b"), toks) != first and salt_seed(None) is None


def test_hash_collision_cannot_return_wrong_kv(monkeypatch):
    import jaxinfer.engine.block_manager as m
    monkeypatch.setattr(m, "chain_hash", lambda prev, toks: 42)    # every block collides
    bm = BlockManager(8, BS)
    a = seq(range(9))
    bm.allocate(a)
    computed(bm, a)
    b = seq([7] * 9)
    bm.allocate(b)
    assert b.num_cached_tokens == 0


def test_identical_prompts_allocated_together_do_not_share_uncomputed_blocks():
    bm = BlockManager(16, BS)
    a, b = seq(range(9)), seq(range(9))
    bm.allocate(a)
    bm.allocate(b)                                   # a not computed yet: b must not read its blocks
    assert set(a.block_table).isdisjoint(b.block_table) and b.num_cached_tokens == 0
    computed(bm, a)
    computed(bm, b)                                  # both register; the first mapping is kept
    c = seq(range(9))
    bm.allocate(c)
    assert c.num_cached_tokens == 8 and c.block_table[:2] == a.block_table[:2]


def test_append_grows_table_at_block_boundary():
    bm = BlockManager(4, BS)
    a = seq(range(4))
    bm.allocate(a)
    assert len(a.block_table) == 1
    a.token_ids.append(5)
    assert bm.can_append(a)
    bm.append(a)
    assert len(a.block_table) == 2
    other = seq(range(200, 208))
    bm.allocate(other)
    a.token_ids += [1, 2, 3, 4]
    assert not bm.can_append(a)


@pytest.mark.parametrize("caching", [True, False])
def test_prefix_caching_switch(caching):
    bm = BlockManager(16, BS, enable_prefix_caching=caching)
    a = seq(range(9))
    bm.allocate(a)
    computed(bm, a)
    b = seq(range(9))
    bm.allocate(b)
    assert (b.num_cached_tokens == 8) == caching


def test_reset_prefix_cache_forgets_free_blocks_only():
    bm = BlockManager(16, BS)
    a, held = seq(range(12)), seq(range(100, 112))
    for s in (a, held):
        bm.allocate(s)
        computed(bm, s)
    bm.free_seq(a)
    assert bm.reset_prefix_cache() == 3                   # a's 3 full blocks, now free
    again = seq(range(12))
    bm.allocate(again)
    assert again.num_cached_tokens == 0                   # a's prompt is computed again
    b = seq(list(range(100, 112)) + [1])
    bm.allocate(b)
    assert b.num_cached_tokens == 12                      # blocks in use keep their hashes
