"""The prefix trie (tinyserve/prefix_cache.py) and, through the same contract, the hash-chain block cache.

The property test plays an engine against the cache: sequences arrive (match, then allocate their other blocks
through the cache), publish their computed blocks while running, and finish or get preempted (insert, then decref
everything); evictions happen on demand and at random. A model of the pool records what every physical block
holds (the token prefix whose K/V it stores), so a hit on a stale or wrong block is caught, not just a wrong id.
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from tinyserve.block_hash_cache import BlockHashCache
from tinyserve.paged import BlockAllocator, OutOfBlocks
from tinyserve.prefix_cache import Node, PrefixCache, evict_lru, insert, match_prefix

CACHES = [PrefixCache, BlockHashCache]


def cache_of(cls, num_blocks=16, bs=2):
    return cls(BlockAllocator(num_blocks, bs))


class Engine:
    """The smallest engine that drives a cache the way tinyserve's does, with a model of the pool's contents."""

    def __init__(self, cache):
        self.cache, self.alloc, self.bs = cache, cache.allocator, cache.block_size
        self.content: dict[int, tuple[int, ...]] = {}   # block -> the token prefix its K/V belong to
        self.running: dict[int, tuple[list[int], list[int]]] = {}   # id -> (tokens, blocks)
        self.next_id = 0

    def start(self, tokens: list[int]) -> int | None:
        """Admit a sequence whose K/V for all tokens are then computed. None if the pool cannot hold it."""
        bs = self.bs
        hit = self.cache.match(tokens)
        assert len(hit) * bs <= len(tokens) - 1, "a hit must leave the last token to run"
        for i, b in enumerate(hit):   # the trie never returns a prefix that differs from the query
            assert self.content[b] == tuple(tokens[:(i + 1) * bs]), f"block {b} holds another prefix"
        blocks = list(hit)
        try:
            while len(blocks) * bs < len(tokens):
                b = self.cache.allocate()
                self.content[b] = tuple(tokens[:(len(blocks) + 1) * bs])   # "compute" its K/V
                blocks.append(b)
        except OutOfBlocks:
            # only when sequences hold every block: the cache never causes an out-of-memory on its own
            held = {x for _, bl in self.running.values() for x in bl} | set(blocks)
            assert len(held) == self.alloc.num_blocks, "ran out while the cache still had evictable blocks"
            for b in blocks:
                self.alloc.decref(b)
            return None
        sid = self.next_id
        self.next_id += 1
        self.running[sid] = (list(tokens), blocks)
        return sid

    def publish(self, sid: int) -> None:
        tokens, blocks = self.running[sid]
        self.cache.insert(tokens, blocks, holder_keeps_blocks=True)

    def finish(self, sid: int) -> None:
        tokens, blocks = self.running.pop(sid)
        self.cache.insert(tokens, blocks)
        for b in reversed(blocks):
            self.alloc.decref(b)

    def check(self) -> None:
        self.cache.check()
        self.alloc.check()
        holders = [0] * self.alloc.num_blocks
        for _, blocks in self.running.values():
            for b in blocks:
                holders[b] += 1
        cached = cached_blocks(self.cache)
        for b in range(self.alloc.num_blocks):   # refcounts balance: sequences + the cache's own, nothing else
            assert self.alloc.refcount[b] == holders[b] + (b in cached), f"block {b}: refcount leak"


def cached_blocks(cache) -> set[int]:
    if isinstance(cache, PrefixCache):
        from tinyserve.prefix_cache import iter_nodes
        return {b for n in iter_nodes(cache.root) for b in n.blocks}
    return {e.block for e in cache.table.values()}


op = st.one_of(
    st.tuples(st.just("start"), st.lists(st.integers(0, 1), min_size=1, max_size=11)),
    st.tuples(st.just("finish"), st.integers(0, 50)),
    st.tuples(st.just("publish"), st.integers(0, 50)),
    st.tuples(st.just("evict"), st.integers(0, 4)),
)


@pytest.mark.parametrize("cls", CACHES)
@settings(max_examples=300, deadline=None)
@given(ops=st.lists(op, max_size=40), bs=st.integers(1, 3), num_blocks=st.integers(4, 12))
def test_random_engine_traffic_keeps_every_invariant(cls, ops, bs, num_blocks):
    eng = Engine(cls(BlockAllocator(num_blocks, bs)))
    for kind, arg in ops:
        if kind == "start":
            eng.start(arg)
        elif kind in ("finish", "publish") and eng.running:
            sid = sorted(eng.running)[arg % len(eng.running)]
            eng.finish(sid) if kind == "finish" else eng.publish(sid)
        elif kind == "evict":
            before = {b: rc for b, rc in enumerate(eng.alloc.refcount)}
            eng.cache.evict(arg)
            for _, blocks in eng.running.values():   # no block is evicted while a sequence holds it
                assert all(eng.alloc.refcount[b] >= 1 and eng.alloc.refcount[b] >= before[b] - 1 for b in blocks)
        eng.check()
    for sid in list(eng.running):
        eng.finish(sid)
    eng.check()
    assert eng.cache.num_evictable == eng.cache.num_cached   # nobody holds anything: all of it can go
    eng.cache.clear()
    assert eng.alloc.num_free == num_blocks, "blocks leaked"   # no leaks


@pytest.mark.parametrize("cls", CACHES)
def test_hit_after_finish_and_memory_counted_once(cls):
    eng = Engine(cache_of(cls, num_blocks=16, bs=2))
    system = [7, 7, 8, 8, 9, 9]                       # 3 full blocks shared by every request
    a = eng.start(system + [1, 2, 3])
    eng.finish(a)
    b = eng.start(system + [4, 5])
    c = eng.start(system + [6])
    (tb, bb), (tc, bc) = eng.running[b], eng.running[c]
    assert bb[:3] == bc[:3]                           # the same physical blocks, stored once
    assert eng.cache.num_shared() == 3
    # 4 cached blocks (a's full blocks) + one own block each for b and c; without sharing b and c need 4 each
    assert eng.alloc.num_used == 6
    assert eng.cache.stats.hit_tokens == 12          # b hit 3 blocks (6 tokens) of its 8, c 3 blocks of its 7
    eng.check()


@pytest.mark.parametrize("cls", CACHES)
def test_fully_cached_prompt_still_runs_its_last_token(cls):
    cache = cache_of(cls, bs=2)
    eng = Engine(cache)
    prompt = [1, 2, 3, 4, 5, 6]                       # exactly 3 blocks
    eng.finish(eng.start(prompt))
    hit = cache.match(prompt)                         # everything is cached ...
    assert len(hit) == 2                              # ... but the last block holds the last token: it must run
    assert cache.cached_prefix(prompt) == 4
    assert cache.cached_prefix(prompt + [7]) == 6     # one more token: now all 3 blocks may hit
    for b in hit:
        cache.allocator.decref(b)


@pytest.mark.parametrize("cls", CACHES)
def test_evicted_and_reused_block_never_hits_stale(cls):
    cache = cache_of(cls, num_blocks=4, bs=2)
    eng = Engine(cache)
    old = [1, 1, 2, 2, 3]
    eng.finish(eng.start(old))                        # caches 2 blocks
    assert cache.cached_prefix(old) == 4
    new = [5, 5, 6, 6, 7, 7, 8]                       # needs all 4 blocks: both cached blocks are evicted, reused
    eng.finish(eng.start(new))
    assert cache.stats.evicted_blocks == 2
    assert cache.cached_prefix(old) == 0              # no stale entry points at the reused blocks
    hit = cache.match(old)
    assert hit == []
    eng.check()


def test_trie_shares_only_the_common_prefix():
    """abcdef and abcxef share abc, not ef: K/V at a position depend on every token before it."""
    cache = cache_of(PrefixCache, num_blocks=16, bs=1)
    a, b, c, d, e, f, x = range(7)
    eng = Engine(cache)
    eng.finish(eng.start([a, b, c, d, e, f]))
    eng.finish(eng.start([a, b, c, x, e, f]))
    kids = list(cache.root.children.values())
    assert len(kids) == 1 and kids[0].tokens == (a, b, c)       # the split node
    assert sorted(ch.tokens for ch in kids[0].children.values()) == [(d, e, f), (x, e, f)]
    assert cache.cached_prefix([a, b, c, x, e, f, 0]) == 6
    assert cache.cached_prefix([a, b, c, d, e, f, 0]) == 6
    assert cache.cached_prefix([a, b, c, 9, e, f, 0]) == 3      # e f after 9 are other K/V
    assert cache.num_cached == 9


def test_running_duplicate_is_not_hung_under_another_copy():
    """Two sequences computed the same prefix in different blocks; the later one, still running, must not publish
    its continuation under the other's copy (it would hold a block whose parent it does not hold)."""
    cache = cache_of(PrefixCache, num_blocks=16, bs=2)
    eng = Engine(cache)
    s1 = eng.start([1, 1, 2, 2, 3])
    s2 = eng.start([1, 1, 2, 2, 4, 4, 5])            # no hit yet: computed its own copy of [1 1][2 2]
    eng.publish(s1)
    eng.publish(s2)
    eng.check()                                       # root-path invariant holds
    assert cache.num_cached == 2                      # s2's [4 4] waits until s2 finishes
    eng.finish(s2)
    assert cache.num_cached == 3                      # now it hangs under s1's copy: s2 let go of everything
    eng.finish(s1)
    eng.check()


def test_eviction_is_lru_and_leaf_first():
    cache = cache_of(PrefixCache, num_blocks=8, bs=1)
    eng = Engine(cache)
    eng.finish(eng.start([1, 2, 3, 9]))               # caches the path 1 2 3 9 (bs = 1: one block per token)
    eng.finish(eng.start([1, 2, 4, 9]))               # hits 1 2, adds the branch 4 9
    top = cache.root.children[(1,)]
    old_branch, new_branch = top.children[(3,)], top.children[(4,)]
    order = new_branch.blocks[::-1] + old_branch.blocks[::-1] + top.blocks[::-1]
    for b in cache.match([1, 2, 3, 9, 0]):            # use the 1 2 3 9 branch again: 4 9 is now least recent
        cache.allocator.decref(b)
    freed = []
    for _ in range(6):
        before = set(range(8)) - set(cache.allocator._free)
        assert cache.evict(1) == 1
        freed += sorted(before - (set(range(8)) - set(cache.allocator._free)))
        eng.check()
    assert freed == order                             # LRU leaf first, tail first; a parent only once it is a leaf
    assert cache.evict(1) == 0 and cache.num_cached == 0


def test_insert_splits_and_adopts_only_new_blocks():
    root = Node()
    assert insert(root, [1, 2, 3, 4, 5, 6], [10, 11, 12], 2, now=1) == [10, 11, 12]
    assert insert(root, [1, 2, 3, 4, 7, 8], [20, 21, 22], 2, now=2) == [22]   # 20, 21 are duplicates: not taken
    top = root.children[(1, 2)]
    assert top.tokens == (1, 2, 3, 4) and top.blocks == [10, 11]
    assert set(top.children) == {(5, 6), (7, 8)}
    assert match_prefix(root, [1, 2, 3, 4, 7, 8, 9], 2).blocks == [10, 11, 22]
    assert evict_lru(root, 10, [1] * 30, 2) == [12, 22, 11, 10]     # LRU leaf (t=1) first, then its parent
    assert root.children == {}


def test_describe_shows_tokens_blocks_and_refcounts():
    cache = cache_of(PrefixCache, num_blocks=8, bs=2)
    eng = Engine(cache)
    eng.finish(eng.start([1, 2, 3, 4, 5]))
    text = cache.describe()
    assert "2 cached blocks" in text and "(rc1)" in text and "'1 2 3 4'" in text


def test_every_cache_implements_the_documented_contract():
    # the base names what each design must provide; a design missing one cannot even be built
    from tinyserve.cache_base import BlockCache, NoPrefixCache
    assert BlockCache.__abstractmethods__ == {"peek", "match", "insert", "evict", "check"}
    with pytest.raises(TypeError, match="abstract"):
        BlockCache(BlockAllocator(4, 2))
    alloc = BlockAllocator(4, 2)
    null = NoPrefixCache(alloc)
    blocks = [null.allocate(), null.allocate()]
    assert null.insert([1, 2, 3, 4], blocks) == 0 and null.match([1, 2, 3, 4, 5]) == [] and null.peek([1, 2, 3]) == []
    assert null.num_free == alloc.num_free == 2 and null.evict(4) == 0
    null.check()
    for b in blocks:
        alloc.decref(b)
    assert alloc.num_free == 4
