"""Lesson 5: a prefix trie (radix tree) over KV blocks — compute a shared prefix once, reuse it.

Many requests begin alike: the same system prompt, the same few-shot examples, the whole history of a chat.
The K/V at position p depend only on tokens 0..p, so two requests that start with the same tokens have the same
K/V for them. Instead of freeing a finished request's blocks, the engine keeps them in a trie keyed by their
tokens; a new request walks the trie for its longest cached prefix, takes references on those blocks and only
prefills the rest.

The trie: every edge holds a run of tokens, every node owns the physical KV blocks holding its edge's tokens
(a radix tree: a chain without branches is one node, split only where two sequences part).

    root ─ [system prompt: 4 blocks] ─┬─ [question A: 2 blocks]
                                      └─ [question B: 1 block]

Design choices (each one is explained in lessons/05_prefix_trie):
- Block-aligned. An edge holds whole blocks (len(tokens) == len(blocks) * bs) and a match ends on a block
  boundary. A cached block is therefore full and immutable: nobody ever appends to it, so sharing never needs
  copy-on-write, and a sequence's new tokens always go to blocks of its own. The price: the partial last block
  of a hit (up to bs - 1 tokens) is recomputed.
- Reference counts. The cache holds one reference on every block it caches; every sequence using the block holds
  one more. A block is evictable when only the cache holds it (refcount == 1).
- A sequence holds a *root path*: it gets the blocks of a prefix from `match`, and its own blocks are published
  below them. So an unreferenced block never has a referenced descendant, and evicting leaves tail-first (LRU)
  reaches every unreferenced block: the cache can always give back all the memory nobody is using.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Iterator, NamedTuple, Sequence

from .cache_base import BlockCache, block_tokens
from .paged import BlockAllocator


@dataclass(slots=True, eq=False)
class Node:
    tokens: tuple[int, ...] = ()          # the edge into this node: len(blocks) * bs tokens
    blocks: list[int] = field(default_factory=list)       # blocks[i] holds tokens[i*bs : (i+1)*bs]
    parent: "Node | None" = None
    children: dict[tuple[int, ...], "Node"] = field(default_factory=dict)  # keyed by a child's first block of tokens
    last_access: int = 0                  # logical clock of the last match/insert through this node (for LRU)


class Match(NamedTuple):
    blocks: list[int]   # physical blocks of the longest cached prefix, in order (len(blocks) * bs tokens)
    node: Node          # the deepest node the walk reached (the root when nothing matched)
    depth: int          # how many of node.blocks matched: < len(node.blocks) when the match ends inside an edge


def edge_agreement(child: Node, tokens: Sequence[int], i: int, n: int, bs: int) -> int:
    """How many blocks of child's edge equal tokens' blocks i, i+1, ... (tokens has n full blocks). At least 1:
    the child was found under its first block."""
    k = 1
    while k < len(child.blocks) and i + k < n and child.tokens[k * bs:(k + 1) * bs] == block_tokens(tokens, i + k, bs):
        k += 1
    return k


def match_prefix(root: Node, tokens: Sequence[int], block_size: int) -> Match:
    """Walk the trie along `tokens`, whole blocks at a time; return the longest cached prefix.

    Only full blocks of `tokens` take part (a trailing partial block never matches). The walk picks the child
    whose first block equals the next block of tokens, then compares the rest of that child's edge block by
    block; a mismatch inside an edge ends the match there. Nothing is modified.
    """
    bs = block_size
    n = len(tokens) // bs                    # full blocks in the query
    node, depth, blocks, i = root, 0, [], 0  # i: blocks of tokens matched so far
    while i < n:
        child = node.children.get(block_tokens(tokens, i, bs))
        if child is None:
            break
        k = edge_agreement(child, tokens, i, n, bs)
        blocks += child.blocks[:k]
        i += k
        node, depth = child, k
        if k < len(child.blocks):            # parted ways inside the edge
            break
    return Match(blocks, node, depth)


def split(node: Node, k: int, block_size: int) -> Node:
    """Cut node's edge after its first k blocks (0 < k < len(node.blocks)); returns the new upper node.

    parent ─[a b c d]─ node   becomes   parent ─[a b]─ upper ─[c d]─ node
    Block ids do not move: only the ownership of the edge is divided.
    """
    assert 0 < k < len(node.blocks), f"split at {k} of a {len(node.blocks)}-block edge"
    bs, parent = block_size, node.parent
    upper = Node(node.tokens[:k * bs], node.blocks[:k], parent, {}, node.last_access)
    node.tokens, node.blocks, node.parent = node.tokens[k * bs:], node.blocks[k:], upper
    upper.children[node.tokens[:bs]] = node
    parent.children[upper.tokens[:bs]] = upper     # replaces node under the same key (same first block)
    return upper


def insert(root: Node, tokens: Sequence[int], blocks: Sequence[int], block_size: int, now: int) -> list[int]:
    """Add the full blocks of a sequence to the trie; return the blocks the trie newly took (in order).

    blocks[i] holds tokens[i*bs : (i+1)*bs]; only the first min(len(blocks), len(tokens) // bs) blocks are used.
    Where the trie already holds those tokens it keeps *its* block (the caller's copy is not taken: a token run is
    cached once); where the trie ends, the rest becomes one new leaf. An edge that only partly agrees is split.
    Every node on the path gets last_access = now.
    """
    bs = block_size
    n = min(len(blocks), len(tokens) // bs)
    node, i = root, 0
    node.last_access = now
    while i < n:
        key = block_tokens(tokens, i, bs)
        child = node.children.get(key)
        if child is None:                    # the rest is new: one leaf owns all of it
            leaf = Node(tuple(tokens[i * bs:n * bs]), list(blocks[i:n]), node, {}, now)
            node.children[key] = leaf
            return list(blocks[i:n])
        k = edge_agreement(child, tokens, i, n, bs)
        if k < len(child.blocks):            # diverges (or ends) inside the edge: keep the common part as a node
            child = split(child, k, bs)
        child.last_access = now
        node, i = child, i + k
    return []


def iter_nodes(root: Node) -> Iterator[Node]:
    """Every node below the root (depth first)."""
    stack = list(root.children.values())
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children.values())


def cached_prefixes(root: Node, block_size: int) -> dict[tuple[int, ...], int]:
    """{token prefix ending on a block boundary: the block holding that prefix's last block} for the whole trie
    (what a lookup could ever return; tests use it to compare a trie before and after an operation)."""
    out: dict[tuple[int, ...], int] = {}
    stack = [(root, ())]
    while stack:
        node, past = stack.pop()
        for child in node.children.values():
            prefix = past
            for i, block in enumerate(child.blocks):
                prefix = prefix + tuple(child.tokens[i * block_size:(i + 1) * block_size])
                out[prefix] = block
            stack.append((child, prefix))
    return out


def evict_lru(root: Node, num_blocks: int, refcount: Sequence[int], block_size: int) -> list[int]:
    """Remove up to `num_blocks` unreferenced blocks from the trie, least recently used leaves first.

    A block may go only when the cache alone holds it (refcount == 1). Blocks leave from the *tail* of a leaf's
    edge (a prefix is worth more than its continuation: dropping a middle block would strand everything below
    it); a leaf whose edge empties is removed, and its parent may become a leaf in turn. Returns the evicted
    block ids; the caller gives back the cache's reference on each.
    """
    bs = block_size
    leaves = [node for node in iter_nodes(root) if not node.children]
    # (last_access, tie-breaker, node): the oldest leaf on top. The tie-breakers must all differ, or two entries of
    # equal last_access compare their Nodes (TypeError): the leaves take 0..L-1, a parent that becomes a leaf L, L+1, ...
    heap = [(leaf.last_access, i, leaf) for i, leaf in enumerate(leaves)]
    heapq.heapify(heap)
    tie = len(heap)
    evicted: list[int] = []
    while heap and len(evicted) < num_blocks:
        _, _, leaf = heapq.heappop(heap)
        key = leaf.tokens[:bs]
        while leaf.blocks and len(evicted) < num_blocks and refcount[leaf.blocks[-1]] == 1:
            evicted.append(leaf.blocks.pop())
            leaf.tokens = leaf.tokens[:-bs]
        if leaf.blocks:                      # its tail is still in use (or we have enough): the leaf stays
            continue
        parent = leaf.parent
        del parent.children[key]
        if parent is not root and not parent.children:
            heapq.heappush(heap, (parent.last_access, tie, parent))
            tie += 1
    return evicted


class PrefixCache(BlockCache):
    """The trie plus its reference counting, on top of lesson 4's BlockAllocator (contract: cache_base.BlockCache)."""

    def __init__(self, allocator: BlockAllocator):
        super().__init__(allocator)
        self.root = Node()

    # --- lookup ----------------------------------------------------------------------------------------------
    def match(self, tokens: Sequence[int]) -> list[int]:
        """Blocks of the longest cached prefix of a prompt, with a reference taken for the caller on each.

        At most len(tokens) - 1 tokens can hit: the last token must still run through the model, because its
        logits are what the next token is sampled from (a 100 % cached prompt would otherwise produce nothing).
        Rounded down to whole blocks, so a hit covers len(blocks) * bs tokens.
        """
        self.clock += 1
        m = match_prefix(self.root, tokens[:len(tokens) - 1], self.block_size)
        node = m.node
        if 0 < m.depth < len(node.blocks):   # the match ends inside an edge: split so LRU sees the used part
            node = split(node, m.depth, self.block_size)
        while node is not None:              # the whole path was just used
            node.last_access = self.clock
            node = node.parent
        for block in m.blocks:
            self.allocator.incref(block)
        self.stats.lookups += 1
        self.stats.query_tokens += len(tokens)
        self.stats.hit_tokens += len(m.blocks) * self.block_size
        return m.blocks

    def peek(self, tokens: Sequence[int]) -> list[int]:
        """The blocks `match` would return, without taking references or touching the LRU clock."""
        return match_prefix(self.root, tokens[:len(tokens) - 1], self.block_size).blocks

    # --- publish ---------------------------------------------------------------------------------------------
    def insert(self, tokens: Sequence[int], blocks: Sequence[int], holder_keeps_blocks: bool = False) -> int:
        """Publish a sequence's computed full blocks (blocks[i] holds tokens[i*bs:(i+1)*bs]); returns how many
        blocks the cache newly took (it increfs each: the sequence keeps its own reference until it decrefs).

        holder_keeps_blocks: the sequence keeps running. If the trie already caches some of its tokens in a
        *different* block (both computed the same prefix at the same time), its blocks past that point are not
        published now: a running sequence must hold a root path (see the module docstring). They are published
        when it finishes, at which point it lets go of everything.
        """
        bs = self.block_size
        n = min(len(blocks), len(tokens) // bs)
        if holder_keeps_blocks:
            cached = match_prefix(self.root, tokens[:n * bs], bs).blocks
            same = next((i for i, (a, b) in enumerate(zip(cached, blocks)) if a != b), len(cached))
            if same < len(cached):
                n = same
        self.clock += 1
        adopted = insert(self.root, tokens[:n * bs], blocks[:n], bs, self.clock)
        for block in adopted:
            self.allocator.incref(block)     # the cache's own reference
        self.cached.update(adopted)
        self.stats.inserted_blocks += len(adopted)
        return len(adopted)

    # --- memory ----------------------------------------------------------------------------------------------
    def evict(self, num_blocks: int) -> int:
        """Free up to num_blocks unreferenced cached blocks (LRU, leaf first); returns how many were freed."""
        evicted = evict_lru(self.root, num_blocks, self.allocator.refcount, self.block_size)
        for block in evicted:
            freed = self.allocator.decref(block)
            assert freed, f"evicted block {block} was still referenced"
        self.cached.difference_update(evicted)
        self.stats.evicted_blocks += len(evicted)
        return len(evicted)

    # --- checks and views ------------------------------------------------------------------------------------
    def check(self) -> None:
        """Structural invariants (used by the property tests)."""
        bs, rc, seen = self.block_size, self.allocator.refcount, set()
        assert not self.root.blocks and self.root.parent is None

        def visit(node: Node) -> None:
            for key, child in node.children.items():
                assert child.parent is node, "broken parent pointer"
                assert child.blocks and len(child.tokens) == len(child.blocks) * bs, "edge is not whole blocks"
                assert key == child.tokens[:bs], "child stored under the wrong key"
                for b in child.blocks:
                    assert b not in seen, f"block {b} is cached twice"
                    seen.add(b)
                    assert rc[b] >= 1, f"cached block {b} is free (refcount 0): a stale entry"
                visit(child)

        visit(self.root)
        assert seen == self.cached, "the set of cached blocks disagrees with the trie"
        # root paths: a block in use by a sequence (refcount >= 2) has every block above it in use too
        for node in iter_nodes(self.root):
            above = [b for p in _ancestors(node) for b in p.blocks]
            for i, b in enumerate(node.blocks):
                if rc[b] >= 2:
                    assert all(rc[x] >= 2 for x in above + node.blocks[:i]), \
                        f"block {b} is in use but a block above it is not: a sequence must hold a root path"

    def describe(self, tokenizer=None, max_chars: int = 40) -> str:
        """A printable view: one line per node with its token count, blocks and their refcounts."""
        rc = self.allocator.refcount
        lines = [f"prefix trie: {self.num_cached} cached blocks ({self.num_evictable} evictable), "
                 f"block size {self.block_size}, pool {self.allocator.num_used}/{self.allocator.num_blocks} used"]

        def show(node: Node, indent: str) -> None:
            kids = sorted(node.children.values(), key=lambda c: c.tokens)
            for j, child in enumerate(kids):
                last = j == len(kids) - 1
                label = tokenizer.decode(list(child.tokens)) if tokenizer else " ".join(map(str, child.tokens))
                label = label.replace("\n", "\\n")
                label = label if len(label) <= max_chars else label[:max_chars - 3] + "..."
                refs = " ".join(f"{b}(rc{rc[b]})" for b in child.blocks)
                lines.append(f"{indent}{'└─' if last else '├─'} {len(child.tokens)} tok {label!r}  "
                             f"blocks {refs}  t={child.last_access}")
                show(child, indent + ("   " if last else "│  "))

        show(self.root, "")
        return "\n".join(lines)

    __str__ = describe


def _ancestors(node: Node) -> Iterator[Node]:
    node = node.parent
    while node is not None:
        yield node
        node = node.parent


@dataclass(frozen=True, slots=True)
class PrefixMetrics:
    """What prefix caching did for an engine's requests (per request: at its first admission)."""
    per_request: dict[int, tuple[int, int]]   # request id -> (prompt tokens served from the cache, prompt tokens)
    hit_tokens: int
    prompt_tokens: int
    blocks_cached: int      # now, in the trie
    blocks_shared: int      # now: cached blocks that two or more running requests read (stored once)
    blocks_evicted: int     # so far

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @classmethod
    def of(cls, engine) -> "PrefixMetrics":
        """From an Engine built with prefix_caching=True."""
        cache = engine.blocks.cache
        if not engine.blocks.prefix_caching:
            raise ValueError("this engine has prefix caching off: build it with Engine(..., prefix_caching=True)")
        hits = dict(engine.blocks.hits)
        return cls(hits, sum(h for h, _ in hits.values()), sum(p for _, p in hits.values()),
                   cache.num_cached, cache.num_shared(), cache.stats.evicted_blocks)

    def __str__(self) -> str:
        return (f"prefix cache: {self.hit_tokens}/{self.prompt_tokens} prompt tokens from cache "
                f"({100 * self.hit_rate:.1f}%), {self.blocks_cached} blocks cached, {self.blocks_shared} shared now, "
                f"{self.blocks_evicted} evicted")
