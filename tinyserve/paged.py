"""Lesson 4: paged KV memory — a pool of fixed-size blocks, a block allocator, and per-sequence block tables.

Contiguous caches reserve max_seq_len positions per request up front; most of that memory is never used.
Paging (as in an OS) hands out small fixed-size blocks on demand, and a block table maps a sequence's logical
block i to a physical block anywhere in the pool. Blocks carry reference counts so that lesson 5 can share one
physical block between many sequences (a shared prompt prefix) and free it only when the last user is gone.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from . import attention_backends
from .attention_backends import check_paged_inputs
from .config import ModelConfig, check_positive_int, is_int
from .gqa import grouped_attention
from .kv_sizing import blocks_for, first_live_block, local_blocks_bound
from .layers import rectangular_mask, softmax


class OutOfBlocks(RuntimeError):
    """The pool has no free block left; the scheduler answers this by preempting a request."""


class BlockAllocator:
    """Free list + reference counts over `num_blocks` physical blocks (ids 0 .. num_blocks-1).

    Invariants (checked by `check()` and by property tests): a block is on the free list iff its refcount is 0;
    refcounts are never negative; every block is either free or referenced.
    """

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = check_positive_int("num_blocks", num_blocks, "BlockAllocator")
        self.block_size = check_positive_int("block_size", block_size, "BlockAllocator")
        self.refcount = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))  # FIFO: a freed block is reused as late as possible

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self) -> int:
        """A fresh block with refcount 1. Raises OutOfBlocks when none is free."""
        if not self._free:
            raise OutOfBlocks(f"all {self.num_blocks} KV blocks are in use")
        block = self._free.popleft()
        assert self.refcount[block] == 0, f"block {block} was on the free list with refcount {self.refcount[block]}"
        self.refcount[block] = 1
        return block

    def incref(self, block: int) -> None:
        """Another owner (a sequence or the prefix cache) now holds `block`."""
        assert self.refcount[block] > 0, f"incref on free block {block}"
        self.refcount[block] += 1

    def decref(self, block: int) -> bool:
        """One owner lets go of `block`; returns True when that freed it."""
        assert self.refcount[block] > 0, f"decref on free block {block}: refcounts must never go negative"
        self.refcount[block] -= 1
        if self.refcount[block] == 0:
            self._free.append(block)
            return True
        return False

    def check(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        for b, rc in enumerate(self.refcount):
            assert rc >= 0, f"block {b} has negative refcount {rc}"
            assert (rc == 0) == (b in free), f"block {b}: refcount {rc} but {'on' if b in free else 'off'} free list"


# --- the physical KV memory and paged attention over it ----------------------------------------------------
# Everything below reads and writes K/V through block tables. A sequence's position p lives in logical block
# p // bs at offset p % bs; its block table says which physical block that is. "Slot" = block * bs + offset
# is the position's address in the pool viewed as one flat array of rows [num_blocks * bs, K, H].


@dataclass(slots=True)
class KVPool:
    """The KV memory of all layers, carved into fixed-size blocks shared by every sequence."""

    k: np.ndarray     # [L, num_blocks, bs, K, H] float32
    v: np.ndarray     # [L, num_blocks, bs, K, H] float32
    block_size: int   # bs: positions per block

    @classmethod
    def create(cls, config: ModelConfig, num_blocks: int, block_size: int = 16, n_layers: int | None = None
               ) -> "KVPool":
        """A pool for `n_layers` layers (default all L; lesson 11 gives the global and the local layers one each)."""
        num_blocks = check_positive_int("num_blocks", num_blocks, "KVPool")
        block_size = check_positive_int("block_size", block_size, "KVPool")
        n_layers = config.n_layers if n_layers is None else n_layers
        shape = (n_layers, num_blocks, block_size, config.n_kv_heads, config.head_dim)
        # zeros, not empty: an unwritten slot should read as harmless zeros, never as leftover garbage/NaN
        return cls(np.zeros(shape, np.float32), np.zeros(shape, np.float32), block_size)

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def write_prompt(self, block_table, k: np.ndarray, v: np.ndarray) -> None:
        """K/V computed elsewhere (k, v: [L, P, K, H]) into positions 0 .. P-1 of one sequence's blocks (lesson 8)."""
        slots = slot_mapping(block_table, 0, k.shape[1], self.block_size)                  # [P]
        for layer in range(k.shape[0]):
            write_kv(self.k[layer], self.v[layer], slots, k[layer], v[layer])


def slot_mapping(block_table: Sequence[int], start: int, count: int, block_size: int) -> np.ndarray:
    """Flat pool slots of positions start .. start+count-1 of one sequence: [count] int64.

    slot = block_table[p // bs] * bs + p % bs — the row where position p's K/V lives in a pool layer
    viewed as [num_blocks * bs, K, H].
    """
    if start < 0 or count < 0:
        raise ValueError(f"slot_mapping: need start >= 0 and count >= 0, got start={start}, count={count}")
    table = np.asarray(block_table, dtype=np.int64)                        # [max_blocks]
    pos = np.arange(start, start + count, dtype=np.int64)                  # [count]
    needed = blocks_for(start + count, block_size)                         # blocks that the positions reach
    if needed > len(table) or (count and np.any(table[pos[0] // block_size:needed] < 0)):
        raise ValueError(f"slot_mapping: positions up to {start + count - 1} need {needed} blocks of "
                         f"{block_size}, but the block table {table.tolist()} has not allocated them")
    return table[pos // block_size] * block_size + pos % block_size


def write_kv(k_cache: np.ndarray, v_cache: np.ndarray, slots: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
    """Store the new tokens' K/V of one layer at their slots (in place).

    k_cache, v_cache: [num_blocks, bs, K, H]; slots: [T] int (from slot_mapping); k, v: [T, K, H].
    """
    nb, bs, K, H = k_cache.shape
    if k.shape != v.shape or k.shape != (len(slots), K, H):
        raise ValueError(f"write_kv: k {k.shape} and v {v.shape} must both be [T={len(slots)}, K={K}, H={H}]")
    if len(slots) and (np.min(slots) < 0 or np.max(slots) >= nb * bs):
        raise ValueError(f"write_kv: slots must lie in [0, {nb * bs}), got {np.min(slots)}..{np.max(slots)}")
    write_kv_unchecked(k_cache, v_cache, slots // bs, slots % bs, k, v)


def write_kv_unchecked(k_cache: np.ndarray, v_cache: np.ndarray, blocks: np.ndarray, offsets: np.ndarray,
                       k: np.ndarray, v: np.ndarray) -> None:
    """write_kv's store, without its checks and with the slots already split: blocks = slots // bs, offsets =
    slots % bs, both [T]. The engine checks and splits once per step and calls this once per layer."""
    # index (block, offset) rather than reshaping to [nb * bs, K, H]: a reshape of a non-contiguous array
    # would be a copy, and the write would silently miss the pool
    k_cache[blocks, offsets] = k
    v_cache[blocks, offsets] = v


def paged_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_tables: np.ndarray,
                    context_lens: np.ndarray, query_starts: np.ndarray, window: int | None = None) -> np.ndarray:
    """Attention of a batch of sequences, each reading its own K/V through its block table (NumPy reference).

    q: [T, N, H], the new rows of B sequences back to back; sequence b owns rows query_starts[b]:query_starts[b+1]
    (m_b rows). k_cache, v_cache: [num_blocks, bs, K, H], one layer, already holding the new tokens' K/V.
    block_tables: [B, max_blocks] int, padded with -1. context_lens: [B], positions of sequence b including
    its m_b new ones, which are its last m_b positions. -> [T, N, H].
    Readable, not fast: gather each sequence's blocks into a contiguous copy and reuse lesson 3's
    grouped_attention (rectangular causal mask, GQA without repeating K/V).
    `window` (lesson 11, a sliding-window layer): each row sees only its last `window` keys; the blocks before the
    first row's window are not read at all (their table entries may be -1: the block manager freed them).
    """
    block_tables = np.asarray(block_tables)
    check_paged_inputs(q, k_cache, v_cache, block_tables, context_lens, query_starts, window)
    return paged_attention_unchecked(q, k_cache, v_cache, block_tables, context_lens, query_starts, window)


def paged_attention_unchecked(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_tables: np.ndarray,
                              context_lens: np.ndarray, query_starts: np.ndarray, window: int | None = None
                              ) -> np.ndarray:
    """paged_attention without check_paged_inputs, for a batch already checked (the engine checks once per step,
    then calls this once per layer). Same arrays in and out."""
    _, bs, K, H = k_cache.shape
    out = np.empty_like(q)                                                       # [T, N, H]
    for b in range(len(context_lens)):
        lo, hi, ctx = int(query_starts[b]), int(query_starts[b + 1]), int(context_lens[b])
        if window is None:
            table = block_tables[b, :blocks_for(ctx, bs)]                        # the blocks this sequence uses
            k = k_cache[table].reshape(-1, K, H)[:ctx]                           # [S=ctx, K, H] (a copy)
            v = v_cache[table].reshape(-1, K, H)[:ctx]
            out[lo:hi] = grouped_attention(q[lo:hi], k, v)
            continue
        # the first new row (position ctx - m) looks back to key ctx - m - window + 1: start at that key's block
        first = first_live_block(ctx - (hi - lo), window, bs)
        table = block_tables[b, first:blocks_for(ctx, bs)]                       # the blocks still alive
        start = first * bs                                                        # position of the first key gathered
        k = k_cache[table].reshape(-1, K, H)[:ctx - start]                       # [S=ctx-start, K, H]
        v = v_cache[table].reshape(-1, K, H)[:ctx - start]
        out[lo:hi] = window_attention(q[lo:hi], k, v, window)
    return out


def window_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, window: int) -> np.ndarray:
    """Lesson 11: causal attention with a sliding window, the new rows being the last m of the S keys.

    q: [m, N, H]; k, v: [S, K, H] -> [m, N, H]. Row i (at position S - m + i of the keys given) sees the keys
    j with S - m + i - window < j <= S - m + i: rectangular_mask with a window. Written plainly (K/V repeated to
    the N query heads, as lesson 2 does): the reference a kernel would be checked against.
    """
    m, N, H = q.shape
    S, K, _ = k.shape
    k, v = np.repeat(k, N // K, axis=1), np.repeat(v, N // K, axis=1)          # [S, N, H] each
    scores = q.transpose(1, 0, 2) @ k.transpose(1, 2, 0)                      # [N, m, S]
    scores *= np.float32(1.0 / np.sqrt(H))
    scores[:, rectangular_mask(m, S, window)] = -np.inf
    return (softmax(scores) @ v.transpose(1, 0, 2)).transpose(1, 0, 2)        # [N, m, H] -> [m, N, H]


def local_step_tables(local_tables: Sequence[Sequence[int]], counts: Sequence[int], positions: np.ndarray,
                      block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Lesson 11: one step's block tables for the local (sliding-window) layers, and where each row's new K/V go.

    local_tables: [B] sequences' local tables (-1 where freed); counts: [B] rows each runs; positions: [T].
    -> (block_tables [B, max_blocks] int64, -1 padded; write_blocks [T] int64). The offsets inside the blocks are
    the global layers' (position % bs): both kinds number their logical blocks alike.
    """
    width = max(map(len, local_tables))
    tables = np.full((len(local_tables), width), -1, dtype=np.int64)             # [B, max_blocks]
    for b, table in enumerate(local_tables):
        tables[b, :len(table)] = table
    row_seq = np.repeat(np.arange(len(local_tables)), counts)                    # [T] each row's sequence
    write_blocks = tables[row_seq, positions // block_size]                      # [T]
    assert (write_blocks >= 0).all(), "a new row's local block was freed: release ran ahead of the window"
    return tables, write_blocks


@dataclass(slots=True)
class LayerPools:
    """Where every layer's K/V live: the global layers' pool and, with a sliding window (lesson 11), the local
    layers' pool of their own. Layer i is row slot[i] of its kind's pool. Without a window, `pool` holds all L
    layers and slot[i] = i: lesson 4's engine exactly."""
    pool: KVPool                  # [L_global, num_blocks, bs, K, H] x2
    local_pool: KVPool | None     # [L_local, num_local_blocks, bs, K, H] x2; None without a window
    windows: list[int | None]     # [L] each layer's window (None: a global layer)
    slot: list[int]               # [L]
    window: int | None            # the local layers' window (None: no local layer)

    @classmethod
    def create(cls, config: ModelConfig, num_blocks: int, block_size: int, max_running: int, max_batch_tokens: int,
               num_local_blocks: int | None = None) -> "LayerPools":
        """The local pool gets num_local_blocks, by default (and at least) kv_sizing.local_blocks_bound capped at
        num_blocks: the most its layers can ever hold, so it never runs dry and the scheduler plans the global pool
        alone. Both attention backends mask by window (kernels/attention.py: key_chunks' rule with a window)."""
        windows = [config.layer_window(i) for i in range(config.n_layers)]
        n_local = sum(w is not None for w in windows)
        window = config.sliding_window if n_local else None
        slot = [sum((windows[j] is None) == (w is None) for j in range(i)) for i, w in enumerate(windows)]
        pool = KVPool.create(config, num_blocks, block_size, n_layers=config.n_layers - n_local)
        local_pool = None
        if window is not None:
            enough = min(num_blocks, local_blocks_bound(window, block_size, max_running, max_batch_tokens))
            num_local_blocks = enough if num_local_blocks is None else num_local_blocks
            if not is_int(num_local_blocks) or num_local_blocks < enough:   # the scheduler never plans this pool
                raise ValueError(f"Engine: num_local_blocks must be at least {enough} (window {window}, "
                                 f"{max_running} running, {max_batch_tokens} tokens a step), got {num_local_blocks!r}")
            local_pool = KVPool.create(config, num_local_blocks, block_size, n_layers=n_local)
        return cls(pool, local_pool, windows, slot, window)

    @property
    def num_local_blocks(self) -> int:
        return self.local_pool.num_blocks if self.local_pool is not None else 0

    def write_prompt(self, block_table, k: np.ndarray, v: np.ndarray, local_table=None) -> None:
        """KVPool.write_prompt for all layers (lesson 8's hand-over; k, v: [L, P, K, H]). With a window, each layer
        kind into its own pool: a local layer only the positions whose block local_table holds (the blocks behind
        the window are -1: no row reads them again)."""
        if self.local_pool is None:
            self.pool.write_prompt(block_table, k, v)
            return
        P, bs = k.shape[1], self.pool.block_size
        glob = [i for i, w in enumerate(self.windows) if w is None]
        loc = [i for i, w in enumerate(self.windows) if w is not None]
        if glob:                                        # the global pool holds the global layers in order
            self.pool.write_prompt(block_table, k[glob], v[glob])
        live = np.flatnonzero(np.asarray(local_table[:blocks_for(P, bs)]) >= 0)        # [n] logical blocks held
        start = int(live[0]) * bs if live.size else P                                   # the first held position
        slots = slot_mapping(local_table, start, P - start, bs)                          # [P - start]
        for layer in loc:
            i = self.slot[layer]
            write_kv(self.local_pool.k[i], self.local_pool.v[i], slots, k[layer, start:], v[layer, start:])

    def read_prompt(self, block_table, local_table, P: int) -> tuple[np.ndarray, np.ndarray]:
        """The K/V of positions 0 .. P-1 of one sequence, both [L, P, K, H] (lesson 8's export). A local layer's
        positions in blocks it freed behind the window are zeros: no later row reads them."""
        bs = self.pool.block_size
        L = len(self.windows)
        _, _, _, K, H = self.pool.k.shape
        k, v = np.zeros((L, P, K, H), np.float32), np.zeros((L, P, K, H), np.float32)
        n = blocks_for(P, bs)
        for layer, window in enumerate(self.windows):
            pool, table = (self.pool, block_table) if window is None else (self.local_pool, local_table)
            i = self.slot[layer]
            for b, block in enumerate(table[:n]):
                if block >= 0:
                    m = min(bs, P - b * bs)
                    k[layer, b * bs:b * bs + m] = pool.k[i, block, :m]
                    v[layer, b * bs:b * bs + m] = pool.v[i, block, :m]
        return k, v

    def attention_fn(self, attend, batch):
        """The attention model.forward calls in one engine step (batch: a step_batch.StepBatch, checked once): each
        layer writes the new rows' K/V into its kind's pool first (they attend to themselves), then attends through
        the step's block tables; a local layer through its own tables (freed blocks -1), masked by its window."""
        if self.local_pool is not None:
            local_tables, local_writes = local_step_tables([seq.local_table for seq in batch.seqs], batch.counts,
                                                           batch.positions, self.pool.block_size)
            attention_backends.check_block_tables(local_tables, batch.context_lens, batch.query_starts,
                                                  len(batch.tokens), self.local_pool.num_blocks,
                                                  self.pool.block_size, self.window)

        def attention(layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
            window, i = self.windows[layer], self.slot[layer]
            if window is None:
                kc, vc = self.pool.k[i], self.pool.v[i]
                write_kv_unchecked(kc, vc, batch.write_blocks, batch.write_offsets, k, v)
                return attend(q, kc, vc, batch.block_tables, batch.context_lens, batch.query_starts)
            kc, vc = self.local_pool.k[i], self.local_pool.v[i]
            write_kv_unchecked(kc, vc, local_writes, batch.write_offsets, k, v)
            return attend(q, kc, vc, local_tables, batch.context_lens, batch.query_starts, window)
        return attention
