"""Lesson 5 self-checks: walking the prefix trie, inserting into it, LRU eviction, chain hashes.

`make check-5` runs these against lessons/05_prefix_trie/exercises.py; `make test` runs them against tinyserve.
The tries here are built by hand (Node(...)) so that each exercise is checked on its own.
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from tests.lessons.impl import CHECKS, load_impl
from tinyserve.prefix_cache import Node, cached_prefixes

REFERENCE = {
    "match_prefix": "tinyserve.prefix_cache:match_prefix",
    "insert": "tinyserve.prefix_cache:insert",
    "evict_lru": "tinyserve.prefix_cache:evict_lru",
    "block_hashes": "tinyserve.block_hash_cache:block_hashes",
}
impl = load_impl(5, REFERENCE)


def add(parent: Node, tokens, blocks, t=0) -> Node:
    node = Node(tuple(tokens), list(blocks), parent, {}, t)
    parent.children[node.tokens[:len(node.tokens) // len(node.blocks)]] = node
    return node


def sample_trie():
    """bs = 2:   root ─[1 2 3 4]{10,11}─ a ─┬─[5 6]{12}─ b
                                          └─[7 8 9 9]{13,14}─ c"""
    root = Node()
    a = add(root, [1, 2, 3, 4], [10, 11], t=3)
    b = add(a, [5, 6], [12], t=1)
    c = add(a, [7, 8, 9, 9], [13, 14], t=2)
    return root, a, b, c


def shape(node: Node):
    """The trie as nested (tokens, blocks, children) tuples, for comparisons."""
    return sorted((ch.tokens, tuple(ch.blocks), shape(ch)) for ch in node.children.values())


def check_structure(root: Node, bs: int) -> None:
    for key, ch in root.children.items():
        assert ch.parent is root, "a child's parent pointer must point at the node that holds it"
        assert ch.blocks and len(ch.tokens) == len(ch.blocks) * bs, f"edge {ch.tokens} is not whole blocks"
        assert key == ch.tokens[:bs], f"child {ch.tokens} stored under key {key}: the key is its first block"
        check_structure(ch, bs)


# --- match_prefix -------------------------------------------------------------------------------------------

@pytest.mark.exercise("match_prefix")
def test_match_walks_edges_block_by_block():
    root, a, b, c = sample_trie()
    m = impl.match_prefix(root, [1, 2, 3, 4, 7, 8, 9, 9, 0], 2)
    assert list(m.blocks) == [10, 11, 13, 14], f"[1 2][3 4] (edge a) then [7 8][9 9] (edge c): want blocks [10, 11, 13, 14], got {list(m.blocks)}"
    assert m.node is c and m.depth == 2, f"the walk ends at c with both its blocks matched: depth 2, got {m.depth}"
    m = impl.match_prefix(root, [1, 2, 3, 4, 5, 6], 2)
    assert list(m.blocks) == [10, 11, 12], f"edge a then edge b: want [10, 11, 12], got {list(m.blocks)}"
    assert m.node is b and m.depth == 1, f"the walk ends at b (1 block matched), got depth {m.depth}"


@pytest.mark.exercise("match_prefix")
def test_match_can_end_inside_an_edge():
    root, a, b, c = sample_trie()
    m = impl.match_prefix(root, [1, 2, 3, 5], 2)                 # parts from a's edge after its first block
    assert list(m.blocks) == [10], f"[1 2] matches a's first block, [3 5] differs from its second: want [10], got {list(m.blocks)}"
    assert m.node is a and m.depth == 1, f"the match ends inside a's edge after 1 of its 2 blocks: depth 1, got {m.depth}"
    m = impl.match_prefix(root, [1, 2, 3, 4, 7, 8, 9, 1], 2)     # and inside c's edge
    assert list(m.blocks) == [10, 11, 13] and m.node is c and m.depth == 1, \
        f"[9 1] differs from c's second block [9 9]: want [10, 11, 13] ending in c at depth 1, got {list(m.blocks)}"
    m = impl.match_prefix(root, [1, 2, 3, 4, 7, 8], 2)           # the query ends inside c's edge
    assert list(m.blocks) == [10, 11, 13] and m.node is c and m.depth == 1, \
        f"the query ends after c's first block: want [10, 11, 13] ending in c at depth 1, got {list(m.blocks)}"


@pytest.mark.exercise("match_prefix")
def test_a_mismatch_inside_an_edge_ends_the_walk():
    root, a, b, c = sample_trie()
    # [1 2] matches a's first block, [5 6] differs from a's second block [3 4]: the match ends there. [5 6] is also
    # the key of a's child b, but b's block 12 holds the K/V of [1 2 3 4 5 6], not of [1 2 5 6]: walking on would
    # hand the request another prefix's keys and values
    m = impl.match_prefix(root, [1, 2, 5, 6, 0, 0], 2)
    assert list(m.blocks) == [10], (
        f"got blocks {list(m.blocks)}: after a mismatch inside an edge the walk must stop, not go on into the "
        f"children of that node (their blocks belong to the whole edge)")
    assert m.node is a and m.depth == 1, "the walk ended inside a's edge, after 1 of its 2 blocks"


@pytest.mark.exercise("match_prefix")
def test_match_uses_whole_blocks_only():
    root, a, b, c = sample_trie()
    assert list(impl.match_prefix(root, [1], 2).blocks) == [], "a partial block [1] never matches"
    assert list(impl.match_prefix(root, [1, 2, 3], 2).blocks) == [10], "[1 2 3]: only the whole block [1 2] matches"
    m = impl.match_prefix(root, [3, 4, 1, 2], 2)                         # a run in the middle is not a prefix
    assert list(m.blocks) == [] and m.node is root and m.depth == 0, \
        "[3 4 1 2] starts with no child's key: nothing matches, the walk stays at the root (depth 0)"
    assert list(impl.match_prefix(Node(), [1, 2, 3, 4], 2).blocks) == [], "an empty trie matches nothing"


@pytest.mark.exercise("match_prefix")
def test_match_does_not_modify_the_trie():
    root, a, b, c = sample_trie()
    before = shape(root)
    impl.match_prefix(root, [1, 2, 3, 5, 6], 2)
    impl.match_prefix(root, [1, 2, 3, 4, 7, 8, 9, 9, 1, 1], 2)
    assert shape(root) == before, "match_prefix changed the trie's structure: a lookup must not split or add nodes"
    assert (a.last_access, b.last_access, c.last_access) == (3, 1, 2), \
        "match_prefix changed last_access: the lookup itself modifies nothing (the cache updates the clock)"


@pytest.mark.exercise("match_prefix")
@settings(CHECKS, max_examples=60)
@given(seqs=st.lists(st.lists(st.integers(0, 2), max_size=10), max_size=8),
       query=st.lists(st.integers(0, 2), max_size=12), bs=st.integers(1, 3))
def test_match_is_the_longest_cached_prefix(seqs, query, bs):
    """On a trie with one block per node, the match is exactly the longest whole-block prefix in the trie."""
    root, known, next_block = Node(), {}, 0
    for s in seqs:
        node = root
        for i in range(len(s) // bs):
            blk = tuple(s[i * bs:(i + 1) * bs])
            if blk not in node.children:
                add(node, blk, [next_block])
                known[tuple(s[:(i + 1) * bs])] = next_block
                next_block += 1
            node = node.children[blk]
    expect = []
    for i in range(len(query) // bs):
        p = tuple(query[:(i + 1) * bs])
        if p not in known:
            break
        expect.append(known[p])
    got = list(impl.match_prefix(root, query, bs).blocks)
    assert got == expect, f"query {query} (bs {bs}): the longest cached whole-block prefix has blocks {expect}, got {got}"


# --- insert ---------------------------------------------------------------------------------------------------

@pytest.mark.exercise("insert")
def test_insert_into_an_empty_trie_makes_one_leaf():
    root = Node()
    got = list(impl.insert(root, [1, 2, 3, 4, 5], [7, 8, 9], 2, 5))
    assert got == [7, 8], f"[1 2][3 4] are whole blocks, [5] is partial: the trie takes blocks [7, 8], got {got}"
    assert shape(root) == [((1, 2, 3, 4), (7, 8), [])], "one leaf holding both blocks (a chain is one node)"
    (leaf,) = root.children.values()
    assert leaf.last_access == 5 and leaf.parent is root
    check_structure(root, 2)


@pytest.mark.exercise("insert")
def test_insert_splits_an_edge_where_sequences_part():
    root, a, b, c = sample_trie()
    new = impl.insert(root, [1, 2, 3, 4, 7, 8, 6, 6, 6], [20, 21, 22, 23], 2, 9)
    assert list(new) == [23], (f"returned {list(new)}: [1 2][3 4][7 8] are cached already (the trie keeps its own "
                               f"blocks 10, 11, 13); only [6 6]'s block 23 is new")
    check_structure(root, 2)
    assert shape(root) == [((1, 2, 3, 4), (10, 11), [
        ((5, 6), (12,), []),
        ((7, 8), (13,), [((6, 6), (23,), []), ((9, 9), (14,), [])]),
    ])], "edge c [7 8 9 9] must be split after [7 8] (split(child, 1, bs)), with [9 9] and the new [6 6] below it"
    a2 = root.children[(1, 2)]
    c_top = a2.children[(7, 8)]
    assert a2.last_access == 9 and c_top.last_access == 9 and c_top.children[(6, 6)].last_access == 9, \
        "every node on the inserted path gets last_access = now (9)"
    assert b.last_access == 1, "a branch the insert did not walk keeps its last_access"


@pytest.mark.exercise("insert")
def test_insert_of_a_known_sequence_adds_nothing():
    root, a, b, c = sample_trie()
    before = cached_prefixes(root, 2)
    got = list(impl.insert(root, [1, 2, 3, 4, 5, 6], [30, 31, 32], 2, 4))
    assert got == [], f"every block of [1 2 3 4 5 6] is cached already: the trie takes none, got {got}"
    assert cached_prefixes(root, 2) == before, "inserting a known sequence must not change what the trie caches"
    assert a.last_access == 4 and b.last_access == 4 and c.last_access == 2, "the walked path (a, b) gets now = 4"


@pytest.mark.exercise("insert")
@settings(CHECKS, max_examples=60)
@given(seqs=st.lists(st.lists(st.integers(0, 2), max_size=12), max_size=10), bs=st.integers(1, 3))
def test_insert_caches_each_block_once_first_come(seqs, bs):
    root, expect = Node(), {}
    for j, s in enumerate(seqs):
        blocks = [100 * j + i for i in range(len(s) // bs + 1)]   # one extra: only full blocks may be used
        new = []
        for i in range(len(s) // bs):
            p = tuple(s[:(i + 1) * bs])
            if p not in expect:
                expect[p] = blocks[i]
                new.append(blocks[i])
        got = list(impl.insert(root, s, blocks, bs, j))
        assert got == new, f"inserting {s} (bs {bs}) after {seqs[:j]}: the trie should take {new}, took {got}"
        check_structure(root, bs)
        assert cached_prefixes(root, bs) == expect, "each whole-block prefix is cached once, in the first block given"


# --- evict_lru ------------------------------------------------------------------------------------------------

@pytest.mark.exercise("evict_lru")
def test_evict_takes_the_least_recent_leaf_tail_first():
    root, a, b, c = sample_trie()                 # leaves: b (t=1), c (t=2)
    rc = [1] * 20
    got = list(impl.evict_lru(root, 1, rc, 2))
    assert got == [12], f"b (last_access 1) is the least recently used leaf: evict its block 12 first, got {got}"
    assert (5, 6) not in a.children, "b's edge is empty: remove it from its parent's children"
    got = list(impl.evict_lru(root, 1, rc, 2))
    assert got == [14], f"then c's TAIL block 14 (not its head 13: a prefix is worth more), got {got}"
    assert c.blocks == [13] and c.tokens == (7, 8), "c keeps its first block and the tokens [7 8] it holds"
    check_structure(root, 2)


@pytest.mark.exercise("evict_lru")
def test_evict_climbs_to_parents_and_stops_when_empty():
    root, a, b, c = sample_trie()
    got = list(impl.evict_lru(root, 10, [1] * 20, 2))
    assert got == [12, 14, 13, 11, 10], (f"got {got}: b (t=1), then c tail first (t=2), then a, which became a leaf "
                                         f"when its children went (t=3), tail first")
    assert root.children == {}, "everything was evicted: the root has no children left"
    assert list(impl.evict_lru(root, 3, [1] * 20, 2)) == [], "an empty trie evicts nothing"


@pytest.mark.exercise("evict_lru")
def test_evict_is_least_recent_first_across_the_whole_trie():
    """A parent that becomes a leaf joins the other leaves in LRU order: it is not emptied at once."""
    root = Node()
    x = add(root, [1, 1], [20], t=5)           # recently used prefix ...
    add(x, [2, 2], [21], t=1)                   # ... whose old child goes first
    add(root, [3, 3], [22], t=3)                # an independent leaf, older than x
    got = list(impl.evict_lru(root, 3, [1] * 30, 2))
    assert got == [21, 22, 20], (
        f"evicted {got}: least recently used first: 21 (t=1), then 22 (t=3), and only then x's 20 (t=5), which "
        f"became a leaf when 21 went but was used more recently than 22")


@pytest.mark.exercise("evict_lru")
def test_evict_never_takes_a_referenced_block():
    root, a, b, c = sample_trie()
    rc = [1] * 20
    rc[12] = 2                                     # a sequence holds b's block (and, so, a's blocks)
    rc[10] = rc[11] = 2
    got = list(impl.evict_lru(root, 10, rc, 2))
    assert got == [14, 13], f"a sequence holds b and a (refcount 2): only c's blocks may go, tail first; got {got}"
    assert shape(root) == [((1, 2, 3, 4), (10, 11), [((5, 6), (12,), [])])], "a and b stay in the trie"
    rc = [1] * 20
    rc[10] = 2                                      # a sequence holds a's first block only
    root, a, b, c = sample_trie()
    got = sorted(impl.evict_lru(root, 10, rc, 2))
    assert got == [11, 12, 13, 14], f"only block 10 is held: everything else may go, got {got}"
    assert shape(root) == [((1, 2), (10,), [])], "a keeps its held first block and the tokens [1 2]"


@pytest.mark.exercise("evict_lru")
def test_evict_a_long_edge_keeps_the_tokens_of_its_remaining_blocks():
    # a 3-block leaf loses its tail block: it keeps 2 blocks and the 4 tokens they hold (bs 2), not just the first 2
    root = Node()
    leaf = add(root, [1, 2, 3, 4, 5, 6], [7, 8, 9], t=1)
    got = list(impl.evict_lru(root, 1, [1] * 10, 2))
    assert got == [9], f"one block asked for: the tail block 9 of the only leaf, got {got}"
    assert leaf.blocks == [7, 8] and leaf.tokens == (1, 2, 3, 4), (
        f"after losing its tail block the edge holds blocks {leaf.blocks} and tokens {leaf.tokens}: want [7, 8] and "
        f"(1, 2, 3, 4): drop the last block's bs tokens from the end of the edge (tokens[:-bs])")


@pytest.mark.exercise("evict_lru")
def test_evict_with_ties_in_last_access_never_compares_nodes():
    """A path is touched at one clock tick, so equal last_access values are the rule. A heap entry (last_access, tie,
    node) whose tie equals another entry's makes heapq compare two Nodes (TypeError): every entry needs its own."""
    cases = []
    root = Node()                                            # a parent that becomes a leaf ties with a leaf
    add(root, [1], [10], t=2)
    add(add(root, [2], [11], t=2), [3], [12], t=0)
    cases.append((root, [12], [10, 11, 12]))
    root = Node()                                            # two parents become leaves, all three tie at t=5
    add(root, [1], [10], t=5)
    add(add(root, [2], [11], t=5), [3], [12], t=0)
    add(add(root, [4], [13], t=5), [5], [14], t=1)
    cases.append((root, [12, 14], [10, 11, 12, 13, 14]))
    for root, first, every in cases:
        try:
            got = list(impl.evict_lru(root, 10, [1] * 20, 1))
        except TypeError as e:
            pytest.fail(f"evict_lru raised TypeError ({e}): two heap entries had the same last_access and the same "
                        f"tie-breaker, so heapq compared their Nodes; give every entry, also a parent pushed when it "
                        f"becomes a leaf, a tie-breaker no other entry has")
        assert got[:len(first)] == first and sorted(got) == every, (
            f"evicted {got}: the least recently used leaves {first} first, then the rest (ties in any order)")


@st.composite
def tries_with_holders(draw):
    """A random trie (edges of 1-3 blocks, last_access with many ties) whose referenced blocks form root paths, as the
    cache guarantees: a sequence that holds a block holds every block before it."""
    bs = draw(st.integers(1, 3))
    root, nodes, next_block = Node(), [], 0
    for j in range(draw(st.integers(1, 9))):
        parent = draw(st.sampled_from([root] + nodes))
        nb = draw(st.integers(1, 3))
        tokens = [1000 * (j + 1) + t for t in range(nb * bs)]           # a first block of its own: a key of its own
        nodes.append(add(parent, tokens, range(next_block, next_block + nb), t=draw(st.integers(0, 3))))
        next_block += nb
    refcount = [1] * next_block
    for node in draw(st.lists(st.sampled_from(nodes), max_size=3)):   # each: a sequence holding a root path
        held = draw(st.integers(1, len(node.blocks)))
        path, up = list(node.blocks[:held]), node.parent
        while up is not root:
            path, up = up.blocks + path, up.parent
        for b in path:
            refcount[b] += 1
    return root, nodes, refcount, bs, draw(st.integers(0, next_block + 1))


@pytest.mark.exercise("evict_lru")
@settings(CHECKS, max_examples=80)
@given(tries_with_holders())
def test_evict_gives_back_every_unreferenced_block_asked_for_and_keeps_the_trie_whole(case):
    root, nodes, refcount, bs, num_blocks = case
    before = {id(n): (list(n.blocks), n.tokens) for n in nodes}
    free = sum(1 for rc in refcount if rc == 1)
    try:
        got = list(impl.evict_lru(root, num_blocks, refcount, bs))
    except TypeError as e:
        pytest.fail(f"evict_lru raised TypeError ({e}) on a trie whose leaves share a last_access: heap entries "
                    f"(last_access, tie, node) with equal last_access and equal tie compare the Nodes; every entry "
                    f"needs a tie-breaker of its own")
    assert all(refcount[b] == 1 for b in got), (
        f"evicted {[b for b in got if refcount[b] != 1]}, which a sequence still holds (refcount > 1)")
    assert len(set(got)) == len(got), f"a block was evicted twice: {got}"
    assert len(got) == min(num_blocks, free), (
        f"asked for {num_blocks} blocks, {free} are held by the cache alone: evict min(asked, {free}) = "
        f"{min(num_blocks, free)}, got {len(got)} (tail-first LRU reaches every unreferenced block: go on to parents "
        f"that become leaves, and stop as soon as enough are evicted)")
    check_structure(root, bs)
    for n in nodes:
        blocks, tokens = before[id(n)]
        assert n.blocks == blocks[:len(n.blocks)] and n.tokens == tokens[:len(n.blocks) * bs], (
            f"edge {tokens} with blocks {blocks} became blocks {n.blocks} with tokens {n.tokens}: an edge loses "
            f"blocks from its tail only, and keeps exactly the tokens of the blocks it keeps")
    assert sorted(got + _trie_blocks(root)) == sorted(b for blocks, _ in before.values() for b in blocks), \
        "every block is either evicted (and returned) or still in the trie"


def _trie_blocks(node: Node) -> list[int]:
    return [b for ch in node.children.values() for b in ch.blocks + _trie_blocks(ch)]


# --- block_hashes ---------------------------------------------------------------------------------------------

@pytest.mark.exercise("block_hashes")
def test_block_hashes_chain_over_the_parent():
    h = impl.block_hashes([1, 2, 3, 4, 5], 2)
    assert len(h) == 2, f"[1 2][3 4][5]: two whole blocks, two hashes ([5] is partial: none), got {len(h)}"
    assert h[0] == hash((None, (1, 2))), "the first block's parent hash is None: h[0] = hash((None, (1, 2)))"
    assert h[1] == hash((h[0], (3, 4))), "each hash chains over the previous one: h[1] = hash((h[0], (3, 4)))"
    assert impl.block_hashes([9, 9, 3, 4], 2)[1] != h[1], "the same block after another past must hash differently"
    assert list(impl.block_hashes([1], 2)) == [], "no whole block, no hash"
