"""The pieces of a LLaMA block, in plain NumPy, float32. Shapes use the legend in config.py."""
from __future__ import annotations

import numpy as np


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:  # [T, D], [D] -> [T, D]
    # RMSNorm rescales each row to unit root-mean-square; unlike LayerNorm it does not centre the row,
    # which saves a reduction and works as well in practice.
    ms = np.mean(np.square(x), axis=-1, keepdims=True)
    return x * (1.0 / np.sqrt(ms + eps)) * weight


def rope_tables(max_pos: int, head_dim: int, theta: float,
                factors: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of every (position, frequency) pair: [max_pos, H/2] each, float32.

    factors [H/2] (Llama 3's rope_freqs): each frequency is divided by its factor. Llama 3 slows its lowest
    frequencies down (factors up to 8) so that their angles stay in the range it saw in training at longer contexts,
    and leaves the high ones (factor 1) alone."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)  # [H/2]
    if factors is not None:
        inv_freq = inv_freq / np.asarray(factors, dtype=np.float64)
    angles = np.arange(max_pos, dtype=np.float64)[:, None] * inv_freq[None, :]          # [P, H/2]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:  # [T, heads, H], [T, H/2] x2 -> same
    # Hugging Face's pairing ("rotate half"): dimension i rotates with dimension i + H/2. llama.cpp pairs
    # neighbours (2i, 2i+1) instead, and stores the Q/K weight rows permuted to match; weights.py undoes that
    # permutation, so here we rotate exactly as the model was trained in PyTorch.
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]  # broadcast over heads
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:  # [..., n] -> [..., n], each row sums to 1 along axis
    # Subtracting the row max changes nothing mathematically and keeps exp() from overflowing.
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return e / np.sum(e, axis=axis, keepdims=True)


def silu(x: np.ndarray) -> np.ndarray:  # any shape -> same (elementwise x * sigmoid(x))
    return x / (1.0 + np.exp(-x))


def gelu_tanh(x: np.ndarray) -> np.ndarray:  # any shape -> same: GELU with the tanh approximation (Gemma)
    return 0.5 * x * (1.0 + np.tanh(np.float32(np.sqrt(2.0 / np.pi)) * (x + np.float32(0.044715) * x * x * x)))


def swiglu_mlp(x: np.ndarray, w_gate: np.ndarray, w_up: np.ndarray, w_down: np.ndarray) -> np.ndarray:
    # [T, D], [D, F], [D, F], [F, D] -> [T, D]: a gated MLP; the gate decides, per feature, how much of `up` passes.
    return (silu(x @ w_gate) * (x @ w_up)) @ w_down


def gated_mlp(x: np.ndarray, w_gate, w_up, w_down, activation: str = "silu") -> np.ndarray:
    """swiglu_mlp, or with activation "gelu_tanh" Gemma's GeGLU (the same gate, a smoother curve)."""
    if activation == "silu":
        return swiglu_mlp(x, w_gate, w_up, w_down)
    return (gelu_tanh(x @ w_gate) * (x @ w_up)) @ w_down


def rectangular_mask(m: int, S: int, window: int | None = None) -> np.ndarray:
    """[m, S] bool, True where new row i must NOT see key j (key j is in row i's future).

    The m new positions are the last m of the S keys, so row i sits at absolute position S - m + i and sees
    every key j <= S - m + i: all S - m history keys plus new keys 0..i. Decode (m = 1) masks nothing;
    plain prefill (S = m) is lesson 1's triangle. With a sliding `window` (Gemma 3's local layers) row i also
    stops seeing keys `window` or more positions behind it: it sees keys j with i_pos - window < j <= i_pos.
    """
    if not 1 <= m <= S:
        raise ValueError(f"need 1 <= m <= S (the new block is part of the keys), got m={m}, S={S}")
    row_pos = (S - m + np.arange(m))[:, None]                # [m, 1] absolute position of each new row
    keys = np.arange(S)[None, :]                             # [1, S]
    mask = keys > row_pos
    if window is not None:
        mask |= keys <= row_pos - window
    return mask


def causal_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Lesson 1's attention: every token attends to itself and all earlier tokens.

    q: [T, N, H], k and v: [T, K, H] -> [T, N, H]. With grouped-query attention (K < N) each K/V head serves
    g = N // K query heads; here we simply repeat K and V g times (lesson 3 shows how to avoid the copy).
    """
    T, N, H = q.shape
    g = N // k.shape[1]
    k = np.repeat(k, g, axis=1)                                     # [T, N, H]
    v = np.repeat(v, g, axis=1)
    scores = q.transpose(1, 0, 2) @ k.transpose(1, 2, 0)            # [N, T, T]
    scores *= np.float32(1.0 / np.sqrt(H))
    scores[:, rectangular_mask(T, T)] = -np.inf                    # [T, T]: True above the diagonal (key after query)
    return (softmax(scores) @ v.transpose(1, 0, 2)).transpose(1, 0, 2)  # [N, T, H] -> [T, N, H]
