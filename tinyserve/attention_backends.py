"""Lesson 4/7: which function runs paged attention, and the input checks every backend shares.

Two backends compute the same paged attention: "numpy" (tinyserve.paged, the readable reference) and "numba"
(tinyserve.kernels.attention, the fast kernel). Both check their inputs with the functions below, and the engine
picks one by name through `get_paged_attention`. This module imports neither backend at load time, so each of them
can import it without an import cycle (a kernel that took the checks from paged.py while paged.py imported the
kernel would close one).
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .kv_sizing import blocks_for

# backend -> (module, checked function, unchecked function). Imported on first use: numba compiles then.
BACKENDS: dict[str, tuple[str, str, str]] = {
    "numpy": ("tinyserve.paged", "paged_attention", "paged_attention_unchecked"),
    "numba": ("tinyserve.kernels.attention", "paged_attention_numba", "paged_attention_numba_unchecked"),
}


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Where a step's K/V live, for a kernel that runs the whole step itself (lesson 7, kernels/decode_step.py).
    One entry per row of the step: row b's context is context_lens[b] positions, its own the last, position j at
    slot block_tables[b, j // block_size] * block_size + j % block_size. A decode row is its sequence; the k + 1
    rows of a speculative verify share their sequence's block table, with contexts ending one position apart. A
    contiguous KVCache is one block of max_len positions. A strategy passes one to backend.forward (`kv_layout=`)
    when every row needs logits and it uses its default attention; the kernel writes the K/V into those slots."""
    k: np.ndarray             # [L, num_slots, K, H]: the cache's keys of every layer, by slot (a view)
    v: np.ndarray             # [L, num_slots, K, H]
    block_tables: np.ndarray  # [B, max_blocks] int64: row b's sequence's block table
    block_size: int
    context_lens: np.ndarray  # [B] int64: the positions row b attends to after this step (its own is the last)
    # Lesson 11: a model with sliding-window layers whose K/V live in a pool of their own (paged.LayerPools). None:
    # every layer is row i of k and v (a contiguous cache keeps every position for every layer). Else k, v hold the
    # global layers and these the local ones, each kind in layer order; a local row reads through its own tables
    # (-1 where a block behind the window was freed) and sees its last `sliding_window` positions.
    local_k: np.ndarray | None = None             # [L_local, num_local_slots, K, H]
    local_v: np.ndarray | None = None             # [L_local, num_local_slots, K, H]
    local_block_tables: np.ndarray | None = None  # [B, max_blocks] int64


def get_paged_attention(backend: str = "numpy", checked: bool = True) -> Callable[..., np.ndarray]:
    """The paged attention function of a backend: "numpy" (the readable reference) or "numba" (the kernel).

    Both take and return the same arrays. With "numba", run the step inside kernels.single_thread_blas():
    OpenBLAS's and Numba's thread pools fighting over the same cores makes a step several times slower.
    checked=False gives the variant without input checks (and, for numba, without dtype conversions): only for
    a caller that has run check_block_tables on the step's batch and passes int64 arrays, like the engine.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}: choose one of {', '.join(map(repr, BACKENDS))}")
    module, fn, unchecked = BACKENDS[backend]
    return getattr(importlib.import_module(module), fn if checked else unchecked)


def check_paged_inputs(q, k_cache, v_cache, block_tables, context_lens, query_starts, window=None) -> None:
    """Clear ValueErrors for inputs paged attention cannot make sense of (shared by both backends)."""
    T, N, H = q.shape
    nb, bs, K, Hk = k_cache.shape
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"paged_attention: k_cache {k_cache.shape} and v_cache {v_cache.shape} differ")
    if Hk != H or N % K:
        raise ValueError(f"paged_attention: q {q.shape} does not fit a cache of {K} KV heads x head_dim {Hk}")
    check_block_tables(block_tables, context_lens, query_starts, T, nb, bs, window)


def check_block_tables(block_tables, context_lens, query_starts, num_rows: int, num_blocks: int,
                       block_size: int, window: int | None = None) -> None:
    """The batch-layout half of check_paged_inputs: every sequence's rows, context and block table make sense for
    a batch of `num_rows` (T) new rows and a pool of `num_blocks` blocks of `block_size`. It depends on the step,
    not on the layer, so the engine runs it once per step (vectorised: a dozen NumPy calls, no loop over B).
    With a sliding `window` (lesson 11's local layers) only the blocks from the first new row's window on must be
    valid: the ones before it are never read, and the block manager may have freed them (-1)."""
    T, nb, bs = num_rows, num_blocks, block_size
    block_tables = np.asarray(block_tables)
    context_lens, query_starts = np.asarray(context_lens), np.asarray(query_starts)
    B = len(context_lens)
    if query_starts.shape != (B + 1,) or query_starts[0] != 0 or query_starts[-1] != T:
        raise ValueError(f"paged_attention: query_starts must be [B+1={B + 1}] from 0 to T={T}, "
                         f"got {query_starts.tolist()}")
    if block_tables.ndim != 2 or block_tables.shape[0] != B:
        raise ValueError(f"paged_attention: block_tables must be [B={B}, max_blocks], got {block_tables.shape}")
    m = np.diff(query_starts)                                                    # [B] new rows per sequence
    bad = (m < 1) | (context_lens < m)
    if bad.any():
        b = int(np.argmax(bad))
        raise ValueError(f"paged_attention: sequence {b} has {m[b]} new rows but context_len {context_lens[b]} "
                         f"(need 1 <= new rows <= context_len)")
    nblocks = blocks_for(context_lens, bs)                                       # [B] blocks each sequence reads
    first = np.zeros_like(nblocks) if window is None else np.maximum(0, context_lens - m - window + 1) // bs
    cols = np.arange(block_tables.shape[1])[None, :]
    used = (cols < nblocks[:, None]) & (cols >= first[:, None])                  # [B, max_blocks]
    bad = (nblocks > block_tables.shape[1]) | (used & ((block_tables < 0) | (block_tables >= nb))).any(axis=1)
    if bad.any():
        b = int(np.argmax(bad))
        raise ValueError(f"paged_attention: sequence {b} has context_len {context_lens[b]} = {nblocks[b]} blocks "
                         f"of {bs}, but its block table starts {block_tables[b, :nblocks[b]].tolist()} "
                         f"(needs {nblocks[b]} valid ids in [0, {nb}))")




def batch_attention_extra_seconds(config, n_seqs: int, context: int, backend: str = "numpy", block_size: int = 16,
                                  repeat: int = 50) -> float:
    """Lessons 8 and 9: what a decode step of n_seqs sequences spends in attention beyond one sequence's forward of
    n_seqs rows (speculative.measure_verify_costs). The batch calls attention once per sequence and layer, each
    over its own block table; the one sequence, once per layer. Both timed on this backend's unchecked attention
    (the Engine's), at `context` positions, their difference times the layers. The K/V are zeros: the time does
    not depend on the values."""
    from .config import check_positive_int
    from .measure import time_repeated
    n_seqs = check_positive_int("n_seqs", n_seqs, "batch_attention_extra_seconds")
    context = check_positive_int("context", context, "batch_attention_extra_seconds")
    if n_seqs == 1:
        return 0.0                                           # the very same call
    attend = get_paged_attention(backend, checked=False)
    per_seq = blocks_for(context, block_size)
    pool = np.zeros((n_seqs * per_seq, block_size, config.n_kv_heads, config.head_dim), np.float32)
    rng = np.random.default_rng(0)

    def one_layer(seqs: int, rows: int) -> float:
        q = rng.standard_normal((seqs * rows, config.n_heads, config.head_dim)).astype(np.float32)
        args = (q, pool, pool, np.arange(seqs * per_seq, dtype=np.int64).reshape(seqs, per_seq),
                np.full(seqs, context, np.int64), np.arange(0, seqs * rows + 1, rows, dtype=np.int64))
        return time_repeated(lambda: attend(*args), repeat, warmup=5).median
    return config.n_layers * (one_layer(n_seqs, 1) - one_layer(1, n_seqs))
