"""Lesson 9: tensor parallelism, simulated — one model split over P devices that talk only through collectives.

Megatron-style, as vLLM's `--tensor-parallel-size` does it. Device d of P holds:
  - attention: the query heads of its K/P key/value heads (column slices of W_q, W_k, W_v) and the matching rows
    of W_o (row-parallel), plus the KV cache of those heads only: attention needs no communication at all;
  - MLP: F/P columns of W_gate and W_up, the same F/P rows of W_down: SwiGLU is elementwise per feature, so a
    device computes its features' share of the output without seeing the others;
  - LM head: V/P rows of the (tied) embedding: it computes the logits of its slice of the vocabulary.
Row-parallel matmuls leave each device with a *partial sum* of the [T, D] output, so each layer ends its attention
and its MLP with an all-reduce; the logits are all-gathered at the end. Everything else (embedding lookup, norms,
residual adds, RoPE) is replicated: every device holds the same residual stream x [T, D] after each all-reduce.

The devices here are simulated: they run one after another in this process and "send" by copying arrays through a
`Link` that counts bytes. Nothing gets faster; what the simulation shows is *what* must move, and how much, so the
calculator (`roofline.tensor_parallel_bytes_per_token`) can say when that traffic would dominate on a real link.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .config import check_positive_int
from .kv_cache import KVCache, append_kv
from .gqa import grouped_attention
from .layers import apply_rope, rms_norm, swiglu_mlp
from .model import FLOAT32, Model, check_token_ids


@dataclass(slots=True)
class Link:
    """The interconnect: every array one device sends another passes through `send`, which counts it."""
    bytes_sent: int = 0
    messages: int = 0

    def send(self, a: np.ndarray) -> np.ndarray:
        self.bytes_sent += a.nbytes
        self.messages += 1
        return a.copy()          # the receiver gets its own copy, as over a wire


def all_reduce(parts: list[np.ndarray], link: Link) -> list[np.ndarray]:
    """Ring all-reduce: P devices each hold a partial array; afterwards each holds the (identical) sum.

    parts: P arrays of one shape [..., n] -> P arrays of that shape. Split the last axis into P chunks. Reduce-
    scatter: in step s (P - 1 steps) device d sends chunk (d - s) % P to device d + 1, which adds it to its own;
    then device d holds the full sum of chunk (d + 1) % P. All-gather: P - 1 more steps pass the finished chunks
    round the ring. Every device sends 2 * (P - 1) chunks of n / P: the ring moves 2 * (P - 1) / P of the array
    per device whatever P is, which is why rings are what NCCL and TPUs use for large arrays.
    """
    if not parts or any(p.shape != parts[0].shape for p in parts):
        raise ValueError(f"all_reduce needs one array per device, all of one shape; got "
                         f"{[p.shape for p in parts]}")
    P = len(parts)
    chunks = [np.array_split(p.copy(), P, axis=-1) for p in parts]       # [P devices][P chunks]
    for s in range(P - 1):                                                # reduce-scatter
        sent = [link.send(chunks[d][(d - s) % P]) for d in range(P)]      # all devices send at once...
        for d in range(P):                                                # ...then add what they received
            c = (d - 1 - s) % P
            chunks[d][c] = chunks[d][c] + sent[(d - 1) % P]
    for s in range(P - 1):                                                # all-gather the reduced chunks
        sent = [link.send(chunks[d][(d + 1 - s) % P]) for d in range(P)]
        for d in range(P):
            chunks[d][(d - s) % P] = sent[(d - 1) % P]
    return [np.concatenate(c, axis=-1) for c in chunks]


def all_gather(parts: list[np.ndarray], link: Link) -> list[np.ndarray]:
    """Ring all-gather: device d holds slice d of an array (split on the last axis); afterwards all hold it all.

    parts: P arrays [..., n_d] -> P arrays [..., sum(n_d)]. In step s device d passes slice (d - s) % P on to
    device d + 1: (P - 1) slices sent per device.
    """
    if not parts or any(p.shape[:-1] != parts[0].shape[:-1] for p in parts):
        raise ValueError(f"all_gather needs one array per device, alike but for the last axis; got "
                         f"{[p.shape for p in parts]}")
    P = len(parts)
    have = [{d: parts[d]} for d in range(P)]                              # device -> {slice index: array}
    for s in range(P - 1):
        sent = [link.send(have[d][(d - s) % P]) for d in range(P)]
        for d in range(P):
            have[d][(d - 1 - s) % P] = sent[(d - 1) % P]
    return [np.concatenate([h[i] for i in range(P)], axis=-1) for h in have]


@dataclass(slots=True)
class LayerShard:
    wq: np.ndarray        # [D, N/P*H]   column-parallel
    wk: np.ndarray        # [D, K/P*H]   column-parallel
    wv: np.ndarray        # [D, K/P*H]   column-parallel
    wo: np.ndarray        # [N/P*H, D]   row-parallel: a partial sum of the output
    w_gate: np.ndarray    # [D, F_d]     column-parallel
    w_up: np.ndarray      # [D, F_d]     column-parallel
    w_down: np.ndarray    # [F_d, D]     row-parallel


@dataclass(slots=True)
class Device:
    index: int
    layers: list[LayerShard]
    lm_head: np.ndarray                   # [V_d, D]: this device's rows of the tied embedding
    cache: KVCache | None = None          # [L, S_max, K/P, H]: the KV cache of its own heads only

    def nbytes(self) -> int:
        """Weight bytes this device holds (its shards; the replicated norms and embedding lookup not counted)."""
        return self.lm_head.nbytes + sum(a.nbytes for w in self.layers for a in
                                         (w.wq, w.wk, w.wv, w.wo, w.w_gate, w.w_up, w.w_down))


def _bounds(n: int, P: int) -> list[tuple[int, int]]:
    edges = np.linspace(0, n, P + 1).round().astype(int)  # as even as possible when P does not divide n
    return list(zip(edges[:-1].tolist(), edges[1:].tolist()))


@dataclass(slots=True)
class TensorParallelModel:
    model: Model                          # the single-device model: its norms and embedding (replicated)
    devices: list[Device]
    link: Link = field(default_factory=Link)

    @classmethod
    def shard(cls, model: Model, n_devices: int) -> "TensorParallelModel":
        """Split `model` over n_devices: heads by KV head group (n_kv_heads must be a multiple of n_devices),
        MLP features and vocabulary rows as evenly as possible."""
        cfg = model.config
        P = check_positive_int("n_devices", n_devices, "TensorParallelModel.shard")
        if model.quant != FLOAT32:   # lesson 7's int8 weights are not plain arrays to slice
            raise ValueError("TensorParallelModel.shard splits the float32 weights: load the model without quant")
        if cfg.n_kv_heads % P:
            raise ValueError(f"cannot shard attention {P} ways: the model has {cfg.n_kv_heads} KV heads (each "
                             "device needs whole KV heads and their query heads; use a divisor of it)")
        H, Np, Kp = cfg.head_dim, cfg.n_heads // P, cfg.n_kv_heads // P
        F_parts, V_parts = _bounds(cfg.intermediate_size, P), _bounds(cfg.vocab_size, P)
        c = np.ascontiguousarray                                    # each device owns its own copy
        devices = []
        for d in range(P):
            q, kv = slice(d * Np * H, (d + 1) * Np * H), slice(d * Kp * H, (d + 1) * Kp * H)
            f = slice(*F_parts[d])
            layers = [LayerShard(c(w.wq[:, q]), c(w.wk[:, kv]), c(w.wv[:, kv]), c(w.wo[q]),
                                 c(w.w_gate[:, f]), c(w.w_up[:, f]), c(w.w_down[f])) for w in model.layers]
            devices.append(Device(d, layers, c(model.embed[slice(*V_parts[d])])))
        return cls(model, devices)

    @property
    def n_devices(self) -> int:
        return len(self.devices)

    def allocate_caches(self, max_len: int) -> None:
        """A fresh KV cache on every device, for its K/P heads: [L, max_len, K/P, H] each."""
        cfg = self.model.config
        max_len = check_positive_int("max_len", max_len, "allocate_caches")
        if max_len > cfg.max_seq_len:
            raise ValueError(f"allocate_caches: max_len {max_len} exceeds the context window ({cfg.max_seq_len})")
        shape = (cfg.n_layers, max_len, cfg.n_kv_heads // self.n_devices, cfg.head_dim)
        for dev in self.devices:
            dev.cache = KVCache(np.zeros(shape, np.float32), np.zeros(shape, np.float32))

    def forward(self, tokens: Sequence[int], all_logits: bool = False) -> np.ndarray:
        """Run m new tokens of one sequence after what the caches hold (prefill or decode), like
        kv_cache.forward_with_cache: logits [m, V] if all_logits else [1, V] (the last row)."""
        if self.devices[0].cache is None:
            raise ValueError("allocate_caches(max_len) first: each device needs its own KV cache")
        model, cfg = self.model, self.model.config
        tokens = check_token_ids(cfg, tokens, what="tensor-parallel forward tokens")                # [m]
        T, H = len(tokens), cfg.head_dim
        for dev in self.devices:
            dev.cache.check_room(T)
        start = self.devices[0].cache.length
        positions = np.arange(start, start + T)
        cos, sin = model.rope_cos[positions], model.rope_sin[positions]                             # [T, H/2]
        x = model.embed[tokens]                                                  # [T, D], the same on every device
        for i, w in enumerate(model.layers):
            h = rms_norm(x, w.attn_norm, cfg.norm_eps)                                              # [T, D] replicated
            partial = []
            for dev in self.devices:                            # each device: its own heads, no communication
                s = dev.layers[i]
                q = apply_rope((h @ s.wq).reshape(T, -1, H), cos, sin)                              # [T, N/P, H]
                k = apply_rope((h @ s.wk).reshape(T, -1, H), cos, sin)                              # [T, K/P, H]
                v = (h @ s.wv).reshape(T, -1, H)                                                    # [T, K/P, H]
                k_all, v_all = append_kv(dev.cache, i, k, v)                                        # [S, K/P, H]
                partial.append(grouped_attention(q, k_all, v_all).reshape(T, -1) @ s.wo)            # [T, D] partial
            # every device now holds the same sum (the ring copies finished chunks): one copy serves as all of them
            x = x + all_reduce(partial, self.link)[0]
            h = rms_norm(x, w.mlp_norm, cfg.norm_eps)
            partial = [swiglu_mlp(h, s.w_gate, s.w_up, s.w_down)                                    # [T, D] partial
                       for s in (dev.layers[i] for dev in self.devices)]
            x = x + all_reduce(partial, self.link)[0]
        for dev in self.devices:
            dev.cache.length += T
        if not all_logits:
            x = x[-1:]
        h = rms_norm(x, model.final_norm, cfg.norm_eps)                                             # [R, D]
        return all_gather([h @ dev.lm_head.T for dev in self.devices], self.link)[0]                # [R, V]

    def generate(self, ids: Sequence[int], max_new_tokens: int) -> list[int]:
        """Greedy decoding (prefill once, then one token per step), on fresh caches: the new token ids."""
        max_new_tokens = check_positive_int("max_new_tokens", max_new_tokens, "generate")
        ids = check_token_ids(self.model.config, ids)
        self.allocate_caches(min(len(ids) + max_new_tokens, self.model.config.max_seq_len))
        logits = self.forward(ids)
        out = [int(np.argmax(logits[0]))]
        while len(out) < max_new_tokens and len(ids) + len(out) < self.model.config.max_seq_len:
            out.append(int(np.argmax(self.forward([out[-1]])[0])))
        return out
