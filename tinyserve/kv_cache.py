"""Lesson 2: a KV cache — prefill the prompt once, then decode one token per step.

Lesson 1 recomputed every earlier token's keys and values for each new token. But token t's K and V in layer l
depend only on tokens 0..t (causal attention), so once computed they never change: keep them. Generation
splits into two phases that run the *same* code path:

    prefill   m = prompt length (or a chunk of it) new positions, S0 = 0 (or the chunks before)
    decode    m = 1 new position attending to the S0 cached ones plus itself

Both are one "rectangular" attention: m new query rows over S = S0 + m keys, with the causal mask applied only
inside the new m x m block (history is visible to every new row). Positions (RoPE) come from the cache length.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np

from .attention_backends import KVLayout
from .config import ModelConfig, check_positive_int, is_int
from .gqa import grouped_attention
from .layers import rectangular_mask, softmax
from .backend import dense_attention, dense_window_attention, forward as model_forward   # model.forward, or the kernels for a model
                                                                 # loaded for them
from .model import AttentionFn, Model, check_token_ids
from .kv_sizing import max_kv_positions
from .sampling import SamplingParams, sample
from .stopping import start_request

# attend(q [m, N, H], k [S, K, H], v [S, K, H]) -> [m, N, H]: rectangular causal attention, last m keys are new.
AttendFn = Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]


class KVCacheFull(ValueError):
    """Appending would write past the positions the cache was allocated for."""


@dataclass(slots=True)
class KVCache:
    """One sequence's keys and values for every layer, in one pre-allocated contiguous buffer.

    Positions 0 .. length-1 are filled; the rest is reserved. Reserving max_len up front is simple and never
    reallocates, but a short request pays for a long one's memory: lesson 4 replaces it with paged blocks.
    """
    k: np.ndarray      # [L, S_max, K, H]
    v: np.ndarray      # [L, S_max, K, H]
    length: int = 0    # positions filled (the same in every layer once a forward has finished)

    @classmethod
    def allocate(cls, config: ModelConfig, max_len: int | None = None, dtype=np.float32) -> "KVCache":
        max_len = config.max_seq_len if max_len is None else max_len
        if not is_int(max_len) or not 1 <= max_len <= config.max_seq_len:
            raise ValueError(f"KV cache max_len must be an integer in [1, {config.max_seq_len}] (the context "
                             f"window), got {max_len!r}")
        shape = (config.n_layers, int(max_len), config.n_kv_heads, config.head_dim)
        # np.zeros maps fresh zero pages lazily: untouched positions cost address space, not RAM
        return cls(np.zeros(shape, dtype), np.zeros(shape, dtype))

    @property
    def max_len(self) -> int:
        return self.k.shape[1]

    @property
    def free(self) -> int:
        return self.max_len - self.length

    @property
    def nbytes(self) -> int:
        """Bytes reserved: 2 (K and V) * L * S_max * K * H * bytes per value."""
        return self.k.nbytes + self.v.nbytes

    @property
    def bytes_per_token(self) -> int:
        return self.nbytes // self.max_len

    def check_room(self, m: int) -> None:
        if self.length + m > self.max_len:
            raise KVCacheFull(f"KV cache full: it holds {self.max_len} positions, {self.length} are used, "
                              f"cannot add {m} more; allocate a larger cache (KVCache.allocate(config, max_len))")

    def append(self, layer: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """append_kv(self, ...): write one layer's new block [m, K, H], get history + block back."""
        return append_kv(self, layer, k, v)

    def rewind(self, n: int) -> None:
        """rewind(self, n): forget the last n positions (lesson 6: draft tokens the target rejected)."""
        rewind(self, n)

    def view(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """The filled part of one layer: k, v [length, K, H] (views, no copy)."""
        return self.k[layer, :self.length], self.v[layer, :self.length]

    def __repr__(self) -> str:
        L, S, K, H = self.k.shape
        return (f"KVCache(L={L}, S_max={S}, K={K}, H={H}, {self.k.dtype}, length={self.length}, "
                f"{self.bytes_per_token} B/token, {self.nbytes / 2**20:.1f} MiB reserved)")


def append_kv(cache: KVCache, layer: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Write one layer's new block after the `cache.length` cached positions; return history + new block.

    k, v: [m, K, H] -> (k_all, v_all): [cache.length + m, K, H] views into the cache (no copy).
    `cache.length` is NOT advanced here: every layer appends at the same positions during one forward, so the
    caller advances it once, after the last layer. Raises KVCacheFull if the block does not fit.
    """
    m = k.shape[0]
    cache.check_room(m)
    start, end = cache.length, cache.length + m
    cache.k[layer, start:end] = k
    cache.v[layer, start:end] = v
    return cache.k[layer, :end], cache.v[layer, :end]


def rewind(cache: KVCache, n: int) -> None:
    """Drop the last n positions: the cache then holds its first `cache.length - n` (lesson 6's rollback).

    Speculative decoding writes K/V for k drafted tokens before knowing which survive; the rejected ones must
    leave. A contiguous cache only moves its length back: nothing reads past `length` (attention slices :length)
    and the next append overwrites those positions, so clearing them would only cost time. n = 0 is a no-op.
    """
    if not is_int(n) or not 0 <= n <= cache.length:
        raise ValueError(f"rewind: n must be an integer in [0, {cache.length}] (the positions cached), got {n!r}")
    cache.length -= int(n)


# rectangular_mask(m, S) -> [m, S] lives in layers.py (lesson 1's attention and gqa use it too); imported above,
# so `tinyserve.kv_cache.rectangular_mask` is still lesson 2's reference answer.


def rectangular_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, window: int | None = None) -> np.ndarray:
    """Lesson 2's attention: m new queries over S cached + new keys, K/V repeated to N heads (as in lesson 1).

    q: [m, N, H]; k, v: [S, K, H] -> [m, N, H]. Lesson 3's gqa.grouped_attention computes the same without
    the np.repeat copies. `window`: a sliding-window layer's (Gemma 3's local layers) keys older than the window
    are masked too.
    """
    m, N, H = q.shape
    S, K, _ = k.shape
    k = np.repeat(k, N // K, axis=1)                                # [S, N, H]: g copies of each K/V head
    v = np.repeat(v, N // K, axis=1)
    scores = q.transpose(1, 0, 2) @ k.transpose(1, 2, 0)            # [N, m, S]
    scores *= np.float32(1.0 / np.sqrt(H))
    scores[:, rectangular_mask(m, S, window)] = -np.inf
    return (softmax(scores) @ v.transpose(1, 0, 2)).transpose(1, 0, 2)  # [N, m, H] -> [m, N, H]


def attention_for(model: Model) -> AttendFn:
    """The attention a strategy uses unless told otherwise: lesson 3's grouped attention, or on the numba backend
    (lesson 7) its kernel (kernels/dense_attention.py: same result within rtol 1e-4)."""
    return dense_attention(model.backend) or grouped_attention


def cache_attention(cache: KVCache, attend: AttendFn = grouped_attention,
                    config: ModelConfig | None = None, windowed=None) -> AttentionFn:
    """The attention `model.forward` calls: store this step's k/v in the cache, attend over history + new.

    A sliding-window layer of `config` (Gemma 3's local layers) attends with the window through
    rectangular_attention (or `windowed`: the numba backend's kernel); the cache still keeps every position (a
    local layer could drop the older ones: the paged engine does)."""
    windowed = windowed or rectangular_attention
    def attention(layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        k_all, v_all = append_kv(cache, layer, k, v)    # [S0 + m, K, H] each
        window = None if config is None else config.layer_window(layer)
        return attend(q, k_all, v_all) if window is None else windowed(q, k_all, v_all, window)
    return attention


def fused_step_layout(model: Model, cache: KVCache, m: int, all_logits: bool,
                      attend: AttendFn | None) -> KVLayout | None:
    """Lesson 7: with its default attention on the numba backend, a step of a few rows that all need logits (a
    decode step, a speculative verify) may run as one kernel that also writes the K/V (kernels/decode_step.py).
    The kernel reads row j as a sequence of its own whose context ends at j; the cache is one block of max_len
    positions. None: the step runs layer by layer."""
    if attend is not None or model.backend != "numba" or not (m == 1 or all_logits):
        return None
    return KVLayout(cache.k, cache.v, np.zeros((m, 1), np.int64), cache.max_len,
                    np.arange(cache.length + 1, cache.length + m + 1))


def forward_with_cache(model: Model, cache: KVCache, tokens: Sequence[int], attend: AttendFn | None = None,
                       all_logits: bool = False) -> np.ndarray:
    """Run m new tokens after the cache's history and append their K/V: the one step of prefill and decode.

    Returns logits [m, V] if all_logits else [1, V] (the last row: the LM head is the largest matmul, and only
    the last position's prediction is needed to continue).
    """
    if len(tokens) == 0:
        raise ValueError("forward_with_cache needs at least one new token")
    # cheap next to the forward, and a negative id would otherwise silently read embed[-1]
    tokens = check_token_ids(model.config, tokens, what="forward_with_cache tokens")   # [m]
    m = len(tokens)
    cache.check_room(m)  # fail before any layer has written anything
    positions = np.arange(cache.length, cache.length + m)   # RoPE positions continue from the history
    rows = None if all_logits else np.array([m - 1])
    attention = cache_attention(cache, attend or attention_for(model), model.config,
                                None if attend else dense_window_attention(model.backend))
    layout = fused_step_layout(model, cache, m, all_logits, attend)
    logits = model_forward(model, tokens, positions, attention, logit_rows=rows, kv_layout=layout)
    cache.length += m  # every layer has appended its block at the same positions
    return logits


def prefill(model: Model, cache: KVCache, tokens: Sequence[int], chunk_size: int | None = None,
            attend: AttendFn | None = None) -> np.ndarray:
    """Fill the cache with the prompt (in chunks of `chunk_size`, or all at once); return the last logits [V].

    Chunking gives the same K/V as one shot because each chunk attends to the chunks before it through the
    cache; it bounds the size of one forward (lesson 4 mixes prefill chunks with other requests' decodes).
    """
    if len(tokens) == 0:
        raise ValueError("prefill needs at least one token: the logits of the last one predict the next")
    tokens = check_token_ids(model.config, tokens, what="prefill tokens")                # [T]
    chunk_size = len(tokens) if chunk_size is None else check_positive_int("chunk_size", chunk_size, "prefill")
    cache.check_room(len(tokens))
    for start in range(0, len(tokens), chunk_size):
        logits = forward_with_cache(model, cache, tokens[start:start + chunk_size], attend)
    return logits[0]


def generate_stream(model: Model, ids: Sequence[int], max_new_tokens: int | None = None,
                    params: SamplingParams | None = None, tokenizer=None, attend: AttendFn | None = None,
                    prefill_chunk: int | None = None) -> Iterator[int]:
    """Yield new token ids one by one: prefill once, then one decode step per token (same stopping as naive)."""
    params = params or SamplingParams()
    tokens, stopper, rng = start_request(model.config, ids, max_new_tokens, params, tokenizer)  # prompt: [T]
    # prompt + max_new_tokens - 1 positions (the last sampled token is never run through the model), capped by
    # the context window (StopChecker stops there too): the one formula every strategy sizes its memory with
    cache = KVCache.allocate(model.config,
                             max_kv_positions(len(tokens), stopper.max_new_tokens, model.config.max_seq_len))
    logits = prefill(model, cache, tokens, prefill_chunk, attend)          # [V]: predicts the first new token
    seq = list(tokens)                                                     # prompt + output: repetition penalty
    out: list[int] = []
    while True:
        tok = sample(logits, params, rng, seen=seq)
        out.append(tok)
        seq.append(tok)
        yield tok
        if stopper.should_stop(out):
            return
        logits = forward_with_cache(model, cache, [tok], attend)[0]        # decode: one row over the cache
        assert cache.length == len(seq)  # every token so far (prompt + output) has its K/V in the cache


def generate(model: Model, ids: Sequence[int], max_new_tokens: int | None = None,
             params: SamplingParams | None = None, tokenizer=None) -> list[int]:
    """Prefill + decode loop: the new token ids only (prompt excluded), ending with EOS if it stopped there.

    Same tokens as naive.generate (greedy), at a cost per token that no longer grows with the matmuls.
    """
    return list(generate_stream(model, ids, max_new_tokens, params, tokenizer))
