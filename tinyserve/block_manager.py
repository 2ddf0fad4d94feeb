"""Lesson 4: all KV-block bookkeeping for sequences, in one place.

The scheduler decides *how many* tokens each sequence runs; the block manager makes sure its block table covers
them, and gives every block back when the sequence finishes or is preempted. Nothing else in the engine touches
the allocator, so lesson 5 (prefix caching) is a contained change here: `admit` may hand a new sequence blocks
that already hold its prompt prefix, `commit` may publish newly filled blocks, and `free` lets the cache keep them.
With caching off, the cache is a NoPrefixCache (it never hits and keeps nothing): one code path either way.

Lesson 11: a model with sliding-window layers (Gemma 3: five local layers for every global one) keeps two kinds of
K/V, each in a pool and with an allocator of its own. The global layers' blocks are what this manager always
managed (`block_table`, `allocator`, the prefix cache, the scheduler's numbers). The local layers' blocks
(`local_table`, `local`) follow the same logical blocks, but a block wholly behind the window is given back as soon
as no future row can read it, so a sequence holds about window / bs of them however long it grows. The local pool
is sized so that it can never run dry (kv_sizing.local_blocks_bound): the scheduler plans the global pool alone.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .block_hash_cache import block_hashes, chain_hashes
from .cache_base import BlockCache, NoPrefixCache
from .kv_sizing import blocks_for, first_live_block
from .paged import BlockAllocator
from .prefix_cache import PrefixCache
from .speculative import rewind_blocks
from .scheduler import SeqState
from .sequence import Sequence, Status


def release_behind_window(local_table: list[int], num_computed: int, window: int, block_size: int,
                          allocator: BlockAllocator) -> int:
    """Lesson 11: give back a sequence's local-layer blocks that no future row can read, and return how many.

    Once `num_computed` positions are in the cache, the next row (at position num_computed) sees keys
    num_computed - window + 1 .. num_computed: every block wholly before that first key is dead for a layer with
    this window (kv_sizing.first_live_block). Each such block is decref'd once and its entry in `local_table`
    (edited in place) becomes -1, so index i still means logical block i. Entries already -1 stay so: calling
    it again frees nothing twice.
    """
    freed = 0
    for i in range(min(first_live_block(num_computed, window, block_size), len(local_table))):
        if local_table[i] >= 0:
            allocator.decref(local_table[i])
            local_table[i] = -1
            freed += 1
    return freed


@dataclass(slots=True)
class LocalTwins:
    """Lesson 11's prefix cache for the local layers: the local block (the "twin") of a cached full block, kept
    alive by one reference of the cache's own, so that a later request whose hit ends at or after it can reuse the
    local layers' K/V of the window before its first new row. A twin is published with its global block; it is
    keyed by the block's chain hash (the whole prefix up to it: block_hash_cache.block_hashes) and checked against
    its tokens and its parent's hash, so it names the same K/V whatever becomes of the global block. Local blocks
    that only the cache holds give way, least recently used first, whenever a sequence needs a local block."""
    allocator: BlockAllocator
    held: dict[int, tuple[int, int | None, tuple[int, ...]]] = field(default_factory=dict)  # hash -> (block,
    #                                                             parent's hash, tokens); oldest use first

    def keep(self, tokens, local_table: list[int], n_blocks: int, block_size: int) -> None:
        """Publish the twins of a sequence's first n_blocks full blocks that it still holds (freed ones: -1)."""
        parent = None
        for i, (h, blk) in enumerate(chain_hashes(tokens[:n_blocks * block_size], block_size)):
            if local_table[i] >= 0 and h not in self.held:
                self.allocator.incref(local_table[i])
                self.held[h] = (local_table[i], parent, blk)
            parent = h

    def lookup(self, tokens, lo: int, hi: int, block_size: int) -> list[int] | None:
        """The twins of logical blocks lo .. hi - 1 of `tokens`, or None if any is missing (refreshed as used)."""
        hashes = list(chain_hashes(tokens[:hi * block_size], block_size))
        out = []
        for i in range(lo, hi):
            h, blk = hashes[i]
            twin = self.held.get(h)
            if twin is None or twin[2] != blk or twin[1] != (hashes[i - 1][0] if i else None):
                return None
            out.append(twin[0])
        for i in range(lo, hi):                            # most recently used last: evicted last
            self.held[hashes[i][0]] = self.held.pop(hashes[i][0])
        return out

    def evict(self, n: int) -> int:
        """Free up to n local blocks that only the cache holds, least recently used first; how many were freed."""
        freed = 0
        for h in [h for h, (b, _, _) in self.held.items() if self.allocator.refcount[b] == 1]:
            if freed == n:
                break
            self.allocator.decref(self.held.pop(h)[0])
            freed += 1
        return freed

    def clear(self) -> int:
        return self.evict(len(self.held))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False, window: int | None = None,
                 num_local_blocks: int = 0):
        """window, num_local_blocks (lesson 11): the sliding window of the model's local layers and the size of
        their own pool (window None: no local layers, no local pool)."""
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.block_size = block_size
        self.window = window
        self.local = BlockAllocator(num_local_blocks, block_size) if window is not None else None
        self.free_behind_window = True   # False keeps every local block (what the tests compare against)
        self.local_peak = 0              # the most local blocks in use at once (after a step's allocation)
        # lesson 5: computed full blocks stay in a prefix trie, so later requests with the same prefix reuse them.
        # Lesson 11: with a window, a hit also needs the local layers' K/V of the window before the match point:
        # the cache keeps the local twins of its blocks while the local pool has room (LocalTwins), and a hit is
        # cut back to where they are all still held (usable_hit; docs/sliding-window.md, "The prefix cache")
        self.prefix_caching = prefix_caching
        self.cache: BlockCache = PrefixCache(self.allocator) if self.prefix_caching else NoPrefixCache(self.allocator)
        self.twins = LocalTwins(self.local) if self.prefix_caching and self.local is not None else None
        # request id -> (prompt tokens served from the cache, prompt tokens), at its first admission only (a
        # preempted request re-matching its own blocks is not a hit): the engine's prefix-cache metrics
        self.hits: dict[int, tuple[int, int]] = {}
        self._published: dict[int, int] = {}          # request id -> its full blocks already inserted in the trie

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free(self) -> int:
        """Blocks the scheduler may hand out this step (with a prefix cache, cached blocks that no sequence uses
        count too: `allocate` evicts them on demand, so caching never runs the pool dry)."""
        return self.cache.num_free

    def seq_state(self, seq: Sequence) -> SeqState:
        """What the scheduler sees of a running or waiting sequence. With a prefix cache, a waiting sequence
        reports the prefix it will be handed, so that the plan only counts the blocks it really has to allocate."""
        if seq.status is Status.WAITING:
            # the prefix `admit` will hand it. Of those blocks, the ones only the cache holds are counted in
            # num_free, so taking them costs the pool a block: report as "held" only those a sequence already uses
            hit = self.usable_hit(seq.token_slice(0, seq.num_tokens), self.cache.peek(seq.token_slice(0, seq.num_tokens)))
            return SeqState(seq.num_tokens, len(hit) * self.block_size, sum(self.cache.users(b) >= 1 for b in hit))
        # preempting it gives back only the blocks no other sequence shares
        freeable = self.cache.num_freeable(seq.block_table)
        return SeqState(seq.num_tokens, seq.num_computed_tokens, len(seq.block_table), freeable)

    def admissible(self, waiting: list[Sequence], running: list[Sequence], token_budget: int) -> list[Sequence]:
        """The head of the queue the scheduler may admit from this step (all of it without a prefix cache).

        It stops at a request whose next uncached block another request is computing right now (running, or
        ahead of it in the queue): two identical prompts arriving together would otherwise both compute it, in
        two copies. The later one waits until the block is published and then shares it. FCFS: nobody behind
        it overtakes. The scan also ends where the step's token budget would (no need to look further).
        """
        if not self.prefix_caching:   # nothing is ever shared, so nothing is worth waiting for (and no hashing)
            return waiting
        bs = self.block_size
        pending: set[int] = set()     # chain hashes of full blocks being computed, not yet in the trie
        for seq in running:
            if seq.num_remaining > 1:  # a prefill in progress
                pending.update(block_hashes(seq.token_slice(0, seq.num_tokens), bs)[seq.num_computed_tokens // bs:])
        for i, seq in enumerate(waiting):
            tokens = seq.token_slice(0, seq.num_tokens)
            cached = len(self.usable_hit(tokens, self.cache.peek(tokens)))
            hashes = block_hashes(tokens[:-1], bs)     # the blocks a match could ever use
            if cached < len(hashes) and hashes[cached] in pending:
                return waiting[:i]
            pending.update(hashes[cached:])
            token_budget -= seq.num_tokens - cached * bs
            if token_budget <= 0:
                return waiting[:i + 1]
        return waiting

    def usable_hit(self, tokens, blocks: list[int]) -> list[int]:
        """Lesson 11: the part of a prefix hit (`blocks`, the trie's match of `tokens`) that a model with local
        layers can use. A hit of n blocks starts the sequence at position n * bs, whose row reads the local layers'
        keys from n * bs - window + 1 on: the hit is cut back to the longest n whose local blocks from that key's
        block to n - 1 still have their twins. Without local layers, the whole hit."""
        if self.twins is None:
            return blocks
        n, bs = len(blocks), self.block_size
        while n and self.twins.lookup(tokens, first_live_block(n * bs, self.window, bs), n, bs) is None:
            n -= 1
        return blocks[:n]

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Extra blocks `seq` needs so that its table covers num_computed_tokens + num_new_tokens positions."""
        return max(0, blocks_for(seq.num_computed_tokens + num_new_tokens, self.block_size) - len(seq.block_table))

    def admit(self, seq: Sequence) -> None:
        """A waiting sequence becomes running, after the longest cached prefix (lesson 5; at most num_tokens - 1).
        Without a hit it starts from nothing: all its tokens (prompt + any output kept from before a preemption)
        are recomputed."""
        assert not seq.block_table, f"request {seq.request_id} is admitted while still holding blocks"
        tokens = seq.token_slice(0, seq.num_tokens)
        matched = self.cache.match(tokens)
        seq.block_table = self.usable_hit(tokens, matched)
        for block in matched[len(seq.block_table):]:     # matched, but the local layers' window is gone: let go
            self.allocator.decref(block)
        if self.twins is not None and seq.block_table:   # the local layers get the window's twins, shared
            n, bs = len(seq.block_table), self.block_size
            first = first_live_block(n * bs, self.window, bs)
            seq.local_table = [-1] * first + self.twins.lookup(tokens, first, n, bs)
            for block in seq.local_table[first:]:
                self.local.incref(block)
        seq.num_computed_tokens = len(seq.block_table) * self.block_size
        self.hits.setdefault(seq.request_id, (seq.num_computed_tokens, len(seq.prompt_ids)))  # first admission
        self._published[seq.request_id] = len(seq.block_table)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow seq's block table so the next `num_new_tokens` tokens have a slot. The scheduler has already
        checked the free count, so OutOfBlocks here is a bug, not a policy."""
        need = self.blocks_needed(seq, num_new_tokens)
        if need > self.allocator.num_free:
            self.cache.evict(need - self.allocator.num_free)   # LRU unreferenced blocks make room, in one pass
        for _ in range(need):
            seq.block_table.append(self.allocator.allocate())
        if self.local is not None:       # the local layers' table covers the same logical blocks
            self.release_behind_window(seq)
            need = len(seq.block_table) - len(seq.local_table)
            if self.twins is not None and need > self.local.num_free:
                self.twins.evict(need - self.local.num_free)   # twins only the cache holds make room
            # an entry behind the window gets no block (-1): only a prefill handed over has any (Engine.add_prefilled:
            # its positions count as computed before its blocks are allocated)
            dead = first_live_block(seq.num_computed_tokens, self.window, self.block_size) \
                if self.free_behind_window else 0
            while len(seq.local_table) < len(seq.block_table):   # OutOfBlocks here: local_blocks_bound is wrong
                seq.local_table.append(-1 if len(seq.local_table) < dead else self.local.allocate())
            self.local_peak = max(self.local_peak, self.local.num_used)

    def release_behind_window(self, seq: Sequence) -> int:
        """Lesson 11: free the local blocks no future row of `seq` can read (module function of the same name)."""
        if self.local is None or not self.free_behind_window:
            return 0
        return release_behind_window(seq.local_table, seq.num_computed_tokens, self.window, self.block_size,
                                     self.local)

    def commit(self, seq: Sequence) -> None:
        """Called after a forward has written seq's K/V up to num_computed_tokens: publish the newly filled blocks
        (a NoPrefixCache takes none)."""
        self.release_behind_window(seq)  # at once: between steps a sequence holds only what its next row reads
        full = seq.num_computed_tokens // self.block_size
        if full > self._published.get(seq.request_id, 0):
            # publish now, not at the end: a request arriving while this one runs can share its prefix
            self.cache.insert(seq.token_slice(0, full * self.block_size), seq.block_table[:full],
                              holder_keeps_blocks=True)
            self._keep_twins(seq, full)
            self._published[seq.request_id] = full

    def _keep_twins(self, seq: Sequence, full: int) -> None:
        """Lesson 11: publish the local twins of seq's first `full` blocks that it still holds."""
        if self.twins is not None:
            self.twins.keep(seq.token_slice(0, full * self.block_size), seq.local_table, full, self.block_size)

    def rewind(self, seq: Sequence, n: int) -> None:
        """Lesson 6: forget the K/V of seq's last n computed positions (draft tokens the target rejected). Blocks
        left without a kept position go back to the pool. Call `commit` only after this: a block that still held
        unverified tokens must never be published to the prefix trie."""
        rewind_blocks(seq.block_table, seq.num_computed_tokens, n, self.block_size, self.allocator)
        if self.local is not None:       # the drafts' blocks are the newest, never behind the window
            while len(seq.local_table) > len(seq.block_table):
                self.local.decref(seq.local_table.pop())
        seq.num_computed_tokens -= n

    def free(self, seq: Sequence) -> None:
        """Give back every block of a finished or preempted sequence (decref: a shared block lives on)."""
        # its computed full blocks stay in the cache (as evictable) for whoever is next
        full = seq.num_computed_tokens // self.block_size
        self.cache.insert(seq.token_slice(0, full * self.block_size), seq.block_table[:full])
        self._keep_twins(seq, full)
        self._published.pop(seq.request_id, None)
        for block in reversed(seq.block_table):   # reversed: the tail block, least likely to be shared, first
            self.allocator.decref(block)
        for block in seq.local_table:
            if block >= 0:
                self.local.decref(block)
        seq.block_table, seq.local_table = [], []
        seq.num_computed_tokens = 0

    def describe_tables(self, seqs) -> str:
        """Lesson 11: every sequence's block table per layer kind, side by side (`.` marks a local block freed
        behind the window), and both pools' use."""
        lines = [f"global layers: {self.allocator.num_used}/{self.allocator.num_blocks} blocks in use"]
        if self.local is not None:
            lines[0] += (f"; local layers (window {self.window}): {self.local.num_used}/{self.local.num_blocks} "
                         f"in use, peak {self.local_peak}")
        for seq in seqs:
            lines.append(f"  r{seq.request_id} ({seq.num_computed_tokens} positions) global {seq.block_table}")
            if self.local is not None:
                cells = ", ".join("." if b < 0 else str(b) for b in seq.local_table)
                lines.append(f"  {'':{len(str(seq.request_id)) + 1}} {'':{len(str(seq.num_computed_tokens)) + 12}}"
                             f" local  [{cells}]")
        return "\n".join(lines)

    def clear_cache(self) -> int:
        """Drop every cached block only the cache holds, in both pools (e.g. to measure a cold start, or to check
        for leaks); returns how many global blocks were freed."""
        if self.twins is not None:
            self.twins.clear()
        return self.cache.clear()

    def forget(self, request_id: int) -> None:
        """Drop what is kept about a finished request (its hit count), once the caller has read it."""
        self.hits.pop(request_id, None)
