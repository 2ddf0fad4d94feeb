"""The fast path of a block that is not LLaMA's (lesson 11): model.forward itself, its matrices the kernels' tiles.

kernels/forward.py fuses LLaMA's block into three Numba calls per layer; every switch of another family (Gemma 3's
norms after attention and MLP, its Q/K norms, GELU, scaled embedding and sliding windows; Qwen2's biases) would need
those fused kernels written again. This module keeps the reference forward, switches and all, and swaps each
quantised matrix for a `TileMatrix`: the same [D_in, O] weights packed for kernels/matmul.py, whose `x @ W` runs the
kernels' tile for its kind. What stays NumPy are the row-wise steps (norms, RoPE, the activation, the residual adds:
a few reads of [T, D] each); the matmuls, which read every weight, and attention (the strategy's: on the numba
backend the paged Numba kernel, masked by window) run on the kernels.

What it does differently from the NumPy reference of the same quantised model (quant.matmul_reference): nothing
in the int8-activation kinds. The tile quantises a row as quant.quantize_blocks does and adds its blocks' exact
integer dot products in the same order, so with the same attention the logits are the same bits
(tests/test_block_forward.py). Every step is per row, so a row's logits depend on what shares its step only
through attention, whose kernels add in one order (kernels/key_chunks.py): batch invariance holds as on LLaMA.

That reference over the tiles is the readable spec, and it runs for W8A32 (`int8`). The int8-activation kinds run
`fused_forward`, the same steps in three Numba calls per layer (kernels/block_layer.py: Q|K|V one tile and gate|up
one tile, packed once; the norms, RoPE and activation inside the calls) around attention and one NumPy call (the
activation's tanh or exp): at decode a layer written op by op is ~7 matmul launches and ~30 NumPy calls, whose
overhead costs more than their arithmetic (docs/sliding-window.md, "Where a decode step's time goes"). Same bits as
the reference over the tiles (tests/test_block_forward.py). A decode step's few rows run those steps as
kernels/block_decode.py's two parallel regions a layer instead (threads meeting at spin barriers, not a fork and a
join for every matmul), or one region a layer when backend.forward is told where the K/V live (a KVLayout: the
region writes them and attends itself): same bits again.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import warnings

import numba
import numpy as np

from ..attention_backends import KVLayout
from ..model import forward as reference_forward
from ..quant import MATRICES, activation_residual
from . import block_decode, block_layer
from .forward import _pack
from .layer import lm_head
from .matmul import BLOCK, W8A32Weights, _matmul_int8, matmul_w8a32, quantize_rows
from .spin import FAILED, SYNC_SIZE, TIMEOUT_CYCLES, regions_can_run

NONE = np.zeros(0, np.float32)     # a switch that is off: block_layer reads an empty weight as "not there"


@dataclass(slots=True)
class TileMatrix:
    """A [D_in, O] matrix packed for the kernels (a kind of kernels/matmul.py: W8A8Weights, W4A8Weights,
    W8A32Weights, or a kind added there later): `x @ m` multiplies on its tile. Dispatch is on the packed kind
    only, so a new kind with int8 activations runs here unchanged."""
    w: tuple                 # the packed kind (a NamedTuple of arrays)
    shape: tuple[int, int]   # (D_in, O)
    planes: int = 1          # the input as 1 or 2 int8 planes (quant.two_planes)

    __array_ufunc__ = None   # NumPy must not treat us as an array: `x @ m` then calls m.__rmatmul__(x)

    def __rmatmul__(self, x: np.ndarray) -> np.ndarray:    # [T, D_in] float32 -> [T, O] float32
        x = np.ascontiguousarray(x, np.float32)
        y = self.one_plane(x)
        if self.planes == 1:
            return y
        return y + self.one_plane(activation_residual(x, self.w.blocks.shape[0]))

    def one_plane(self, x: np.ndarray) -> np.ndarray:
        T, O = x.shape[0], self.w.w.shape[0] * BLOCK
        if T == 0:                                         # (a prefill chunk that samples no row: no logits)
            return np.zeros((0, self.shape[1]), np.float32)
        if isinstance(self.w, W8A32Weights):               # float32 activations: nothing to quantise
            out = matmul_w8a32(x, self.w.w, self.w.scale)
        else:                                              # int8 activations, blocks.shape[0] scales a row
            xu, sx = np.empty(x.shape, np.uint8), np.empty((T, self.w.blocks.shape[0]), np.float32)
            quantize_rows(x, xu, sx)
            out = np.empty((T, O), np.float32)
            _matmul_int8(self.w, xu, sx, out, False)    # the tile of the packed kind (matmul._kind)
        return out if O == self.shape[1] else out[:, :self.shape[1]]


def tile(mode: str, q) -> TileMatrix:
    """One quantised matrix (quant.QuantizedLinear or Q4Linear) -> its TileMatrix (kernels/forward.py's packing)."""
    return TileMatrix(_pack(mode, q), tuple(q.shape), getattr(q, "planes", 1))


def prepare(model, fuse: bool = True) -> "BlockWeights":
    """Pack once. W8A32 (or fuse=False: the reference's steps over the tiles for every kind, to compare and to
    time): the model whose layer matrices and LM head are TileMatrix (the rest, embedding, norms, RoPE tables, the
    switches' extra weights, is the model's own arrays, not copied). The int8-activation kinds: each layer's fused
    tiles (FusedLayer) and the LM head, which fused_forward runs."""
    head = tile(model.quant, model.lm_head_q)
    if isinstance(head.w, W8A32Weights) or not fuse:
        layers = [dataclasses.replace(w, **{f: tile(model.quant, getattr(w, f)) for f in MATRICES})
                  for w in model.layers]
        return BlockWeights(dataclasses.replace(model, layers=layers, lm_head_q=head, backend="numpy", fast=None),
                            None, head)
    return BlockWeights(None, [fuse_layer(model.quant, w) for w in model.layers], head)


@dataclass(slots=True)
class FusedLayer:
    """One layer for kernels/block_layer.py: Q|K|V and gate|up each one packed matrix; a switch that is off is an
    empty weight (NONE)."""
    attn_norm: np.ndarray        # [D]
    qkv: tuple                   # [D, (N + 2K) H] packed
    qkv_bias: np.ndarray         # [(N + 2K) H] or [0]
    q_norm: np.ndarray           # [H] or [0]
    k_norm: np.ndarray           # [H] or [0]
    o: tuple                     # [N H, D] packed
    post_attn_norm: np.ndarray   # [D] or [0]
    mlp_norm: np.ndarray         # [D]
    gate_up: tuple               # [D, 2F] packed
    plane_lo: int                # gate_up's columns plane_lo .. plane_hi take the input's second int8 plane
    plane_hi: int                #   (quant.two_planes: Gemma 3's up half); equal: none
    down: tuple                  # [F, D] packed
    post_mlp_norm: np.ndarray    # [D] or [0]


@dataclass(slots=True)
class BlockWeights:
    tiled: object | None                # W8A32: the model over TileMatrix, the reference's steps on the tiles
    fused: list[FusedLayer] | None      # the int8-activation kinds: what fused_forward runs
    head: TileMatrix                    # [D, V] the LM head


def fuse_layer(mode: str, w) -> FusedLayer:
    """A layer's quantised matrices -> FusedLayer, packed as kernels/forward.py packs LLaMA's (its _pack: side by
    side on one tile kind; on the byte tile if any is bytes)."""
    f32 = lambda a: NONE if a is None else np.ascontiguousarray(a, np.float32)      # noqa: E731
    bias = NONE if w.q_bias is None else np.concatenate([w.q_bias, w.k_bias, w.v_bias]).astype(np.float32)
    F_gate, F_up = w.w_gate.shape[1], w.w_up.shape[1]       # gate | up side by side: the planes' column ranges
    lo, hi = (0 if w.w_gate.planes == 2 else F_gate), (F_gate + F_up if w.w_up.planes == 2 else F_gate)
    return FusedLayer(f32(w.attn_norm), _pack(mode, w.wq, w.wk, w.wv), bias, f32(w.q_norm), f32(w.k_norm),
                      _pack(mode, w.wo), f32(w.post_attn_norm), f32(w.mlp_norm), _pack(mode, w.w_gate, w.w_up),
                      lo, max(lo, hi), _pack(mode, w.w_down), f32(w.post_mlp_norm))


def fused_forward(model, fused: list[FusedLayer], head, tokens: np.ndarray, positions: np.ndarray, attention,
                  logit_rows=None, kv_layout: KVLayout | None = None) -> np.ndarray:
    """model.forward's steps with each layer as block_layer's calls; logits [len(logit_rows) or T, V] float32.
    kv_layout (the strategy's default attention): a decode step may write its K/V and attend inside its regions."""
    cfg = model.config
    T, N, K, H, F = len(tokens), cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.intermediate_size
    V = head.shape[1]
    eps = np.float32(cfg.norm_eps)
    gelu = cfg.activation == "gelu_tanh"
    transcendental = np.tanh if gelu else np.exp
    (cos_g, sin_g), (cos_l, sin_l) = model.rope_at(positions)                      # [T, H/2] each
    x = model.embed[tokens]                                                          # [T, D] (a copy: ours to update)
    if cfg.embed_scale != 1.0:
        x = x * np.float32(cfg.embed_scale)
    gu, u = np.empty((T, 2 * F), np.float32), np.empty((T, F), np.float32)         # reused by every layer
    if block_decode_usable(T, logit_rows):
        logits = _decode_regions(model, fused, head, x.copy(), cos_g, sin_g, cos_l, sin_l, gu, u, attention,
                                 kv_layout)
        if logits is not None:
            return logits if logits.shape[1] == V else np.ascontiguousarray(logits[:, :V])
    for i, w in enumerate(fused):
        local = cfg.layer_window(i) is not None
        cos, sin = (cos_l, sin_l) if local else (cos_g, sin_g)
        q, k, v = np.empty((T, N, H), np.float32), np.empty((T, K, H), np.float32), np.empty((T, K, H), np.float32)
        block_layer.pre_attention(x, w.attn_norm, eps, w.qkv, w.qkv_bias, w.q_norm, w.k_norm, cos, sin, q, k, v)
        a = np.ascontiguousarray(attention(i, q, k, v)).reshape(T, N * H)          # [T, N H]
        block_layer.post_attention(x, a, w.o, w.post_attn_norm, w.mlp_norm, eps, w.gate_up, gu, w.plane_lo,
                                   w.plane_hi)
        block_layer.act_input(gu, gelu, u)
        transcendental(u, out=u)                                                     # NumPy's, as layers.py's
        block_layer.mlp_down(x, gu, u, gelu, w.down, w.post_mlp_norm, eps)
    if logit_rows is not None:
        x = np.ascontiguousarray(x[logit_rows])                                     # [R, D]
    if x.shape[0] == 0:                                                             # no row samples
        return np.zeros((0, V), np.float32)
    logits = lm_head(x, model.final_norm, eps, head.w)                              # [R, V padded to 16]
    return logits if logits.shape[1] == V else np.ascontiguousarray(logits[:, :V])


_regions_disabled: str | None = None     # why decode steps stopped taking block_decode's regions (a barrier timed out)
threads = numba.get_num_threads          # how many threads a region starts (a test makes it lie)


def block_decode_usable(T: int, logit_rows) -> bool:
    """Can these T rows run as kernels/block_decode.py's regions? Few rows that all need logits (a decode step),
    on the `omp` threading layer (the only one whose threads of a parallel loop run at once, as a barrier needs)."""
    return _regions_disabled is None and 1 <= T < block_layer.ROW_LOOPS_PARALLEL_FROM and regions_can_run(T, logit_rows)


def _layer_kv(cfg, layout: KVLayout) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, int]]:
    """Where layer i's K/V live, for each i: (k_rows, v_rows [num_slots, K, H], block_tables [T, max_blocks],
    window or 0). With a local pool (layout.local_k) each kind is numbered in layer order, as paged.LayerPools'."""
    out, n_local = [], 0
    for i in range(cfg.n_layers):
        window = cfg.layer_window(i)
        if layout.local_k is None:
            out.append((layout.k[i], layout.v[i], layout.block_tables, window or 0))
        elif window is None:
            out.append((layout.k[i - n_local], layout.v[i - n_local], layout.block_tables, 0))
        else:
            out.append((layout.local_k[n_local], layout.local_v[n_local], layout.local_block_tables, window))
            n_local += 1
    return out


def _decode_regions(model, fused: list[FusedLayer], head, x, cos_g, sin_g, cos_l, sin_l, gu, u, attention,
                    layout: KVLayout | None = None):
    """fused_forward's steps as block_decode's regions (the head's matmul in a region of its own): logits [T, V
    padded to 16], or None if the threads failed to meet (x is then half-updated: the caller runs the step again
    from the embedding, and every later step the three-call way). With a KVLayout a layer is one region
    (region_layer: it writes the K/V and attends itself), L + 1 forks a step; without, attention runs between a
    layer's two regions (region_a, region_b), 2 L + 1."""
    global _regions_disabled
    cfg = model.config
    T, N, K, H = x.shape[0], cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    eps = np.float32(cfg.norm_eps)
    gelu = cfg.activation == "gelu_tanh"
    transcendental = np.tanh if gelu else np.exp
    n = threads()
    sync = np.zeros(SYNC_SIZE, np.int64)
    qkv = np.empty((T, fused[0].qkv.w.shape[0] * BLOCK), np.float32)                 # [T, (N + 2K) H]
    prev = fused[0]                                                                  # (layer 0 has no tail)
    kv = _layer_kv(cfg, layout) if layout is not None and len(layout.context_lens) == T else None
    for i, w in enumerate(fused):
        local = cfg.layer_window(i) is not None
        cos, sin = (cos_l, sin_l) if local else (cos_g, sin_g)
        q, k, v = np.empty((T, N, H), np.float32), np.empty((T, K, H), np.float32), np.empty((T, K, H), np.float32)
        if kv is not None:                      # attention inside the layer's one region: no Python between
            k_rows, v_rows, tables, window = kv[i]
            a = np.empty((T, N, H), np.float32)
            block_decode.region_layer(n, sync, TIMEOUT_CYCLES, x, i > 0, gu, u, gelu, prev.down, prev.post_mlp_norm,
                                      eps, w.attn_norm, w.qkv, qkv, w.qkv_bias, w.q_norm, w.k_norm, cos, sin, q, k,
                                      v, k_rows, v_rows, tables, layout.block_size, layout.context_lens, window, a,
                                      w.o, w.post_attn_norm, w.mlp_norm, w.gate_up, w.plane_lo, w.plane_hi)
            if sync[FAILED]:
                break
            transcendental(u, out=u)                                                 # NumPy's, as layers.py's
            prev = w
            continue
        block_decode.region_a(n, sync, TIMEOUT_CYCLES, x, i > 0, gu, u, gelu, prev.down, prev.post_mlp_norm, eps,
                              w.attn_norm, w.qkv, qkv, True, w.qkv_bias, w.q_norm, w.k_norm, cos, sin, q, k, v)
        if sync[FAILED]:
            break
        a = np.ascontiguousarray(attention(i, q, k, v)).reshape(T, N * H)          # [T, N H]
        block_decode.region_b(n, sync, TIMEOUT_CYCLES, x, a, w.o, w.post_attn_norm, eps, w.mlp_norm, w.gate_up,
                              w.plane_lo, w.plane_hi, gu, gelu, u)
        if sync[FAILED]:
            break
        transcendental(u, out=u)                                                     # NumPy's, as layers.py's
        prev = w
    else:
        logits = np.empty((T, head.w.w.shape[0] * BLOCK), np.float32)              # [T, V padded to 16]
        block_decode.region_a(n, sync, TIMEOUT_CYCLES, x, True, gu, u, gelu, prev.down, prev.post_mlp_norm, eps,
                              model.final_norm, head.w, logits, False, NONE, NONE, NONE, cos_g, sin_g, q, k, v)
        if not sync[FAILED]:
            return logits
    _regions_disabled = f"the {n} threads of a decode step's region did not meet within {TIMEOUT_CYCLES:.0e} cycles"
    warnings.warn(f"tinyserve: {_regions_disabled}; decode steps take block_layer's calls from now on",
                  RuntimeWarning, stacklevel=3)
    return None


def block_forward(model, tokens: np.ndarray, positions: np.ndarray, attention, logit_rows=None,
                  kv_layout: KVLayout | None = None) -> np.ndarray:
    """model.forward's contract (logits [len(logit_rows) or T, V] float32) for a quantised model whose block the
    fused LLaMA kernels lack: fused_forward for the int8-activation kinds, else the reference forward over the
    packed matrices (model.fast, packed on first use). kv_layout: backend.forward's (where the step's K/V live)."""
    if model.fast is None:
        model.fast = prepare(model)
    bw: BlockWeights = model.fast
    if bw.fused is None:
        return reference_forward(bw.tiled, tokens, positions, attention, logit_rows)
    if len(tokens) == 0:                                   # (a prefill chunk that samples no row: no logits)
        return np.zeros((0, bw.head.shape[1]), np.float32)
    return fused_forward(model, bw.fused, bw.head, tokens, positions, attention, logit_rows, kv_layout)
