"""The hash-chain block cache (tinyserve/block_hash_cache.py). Its refcount/eviction/no-leak properties run in
tests/test_prefix_cache.py (the same property test drives both caches); here: what is specific to hashing."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from tinyserve.block_hash_cache import BlockHashCache, Entry, block_hashes
from tinyserve.paged import BlockAllocator
from tinyserve.prefix_cache import PrefixCache


def finish(cache, tokens):
    """A request that computed all of `tokens` and left: allocate, insert, decref (what the engine does)."""
    bs = cache.block_size
    blocks = cache.match(tokens)
    while len(blocks) * bs < len(tokens):
        blocks.append(cache.allocate())
    cache.insert(tokens, blocks)
    for b in blocks:
        cache.allocator.decref(b)


def test_chain_hash_names_the_whole_prefix():
    h1 = block_hashes([1, 2, 3, 4, 5, 6, 7], 2)
    assert len(h1) == 3                                    # the partial block [7] gets no hash
    h2 = block_hashes([9, 9, 3, 4, 5, 6], 2)
    assert h1[1] != h2[1]                                  # same tokens [3 4], different past: different K/V
    assert block_hashes([1, 2, 3, 4], 2) == h1[:2]         # a prefix's hashes are a prefix of the hashes
    assert block_hashes([1, 2, 3], 4) == []


def test_collision_is_verified_not_trusted():
    cache = BlockHashCache(BlockAllocator(8, 2))
    finish(cache, [1, 2, 3, 4, 5])
    # forge a collision: the hash of [7 8] now names an entry that holds other tokens (as a real collision would)
    (h_first,) = block_hashes([7, 8], 2)
    victim = next(iter(cache.table.values()))
    cache.table[h_first] = Entry(victim.block, None, (1, 2), 0, 0)
    assert cache.match([7, 8, 0]) == []                     # the tokens do not match: a miss, not a wrong hit
    del cache.table[h_first]
    cache.check()


def test_eviction_goes_tail_first_and_forgets_the_hash():
    cache = BlockHashCache(BlockAllocator(4, 2))
    finish(cache, [1, 1, 2, 2, 3, 3, 4])                   # 3 full blocks cached, the partial one freed
    hashes = block_hashes([1, 1, 2, 2, 3, 3], 2)
    assert cache.evict(1) == 1
    assert hashes[2] not in cache.table and hashes[0] in cache.table   # the deepest block went first
    assert cache.cached_prefix([1, 1, 2, 2, 3, 3, 9]) == 4


@settings(max_examples=100, deadline=None)
@given(prompts=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=12), max_size=12), bs=st.integers(1, 3))
def test_same_hits_as_the_trie_without_eviction(prompts, bs):
    """Both designs cache whole blocks keyed by their full prefix: with room for everything they agree exactly."""
    trie, table = PrefixCache(BlockAllocator(200, bs)), BlockHashCache(BlockAllocator(200, bs))
    for p in prompts:
        assert trie.cached_prefix(p) == table.cached_prefix(p)
        finish(trie, p)
        finish(table, p)
    assert trie.stats.hit_tokens == table.stats.hit_tokens
    assert trie.num_cached == table.num_cached
