"""quant="gguf": a GGUF file's matrices on the fast path as the file holds them (quant.quantize_gguf).

On synthetic blocks of every format (random integers, random float16 scales), fast:
- gguf_quants.split_blocks gives the integers and scales back: d * q + m is dequantize's value bit for bit;
- each format lands on its tile (quant.tile_of) and, for the exact ones, the tile's weights ARE the file's
  (BlockLinear.dequantize() == dequantize()); Q4_K/Q5_K round only d*sc_j and dmin*m_j to float16, and the
  requantized ones (floats) stay within half a step of Q8_0's rule;
- the byte, 5-bit and nibble tiles (each with and without a stored minimum) are bit-identical to
  quant.matmul_reference_w4a8 on those blocks, the 6-bit tile (Q6_K) to quant.matmul_reference_q6;
- a tiny model whose every matrix is another format (mixed within Q|K|V and across layers) runs the Numba path as
  the NumPy reference of the same weights, packs each role on the tile its formats need, and `auto` picks gguf.
The real files' accuracy (top-1 and perplexity against the float path) is tests/test_quant_accuracy.py's.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import tinyserve as ts
from tinyserve import backend, gguf_quants, naive, quant
from tinyserve.gguf_file import LAYER_TENSORS, TensorInfo, unpermute_rope_rows
from tinyserve.kernels import forward as fast
from tinyserve.kernels import matmul as km
from tests.test_w4a8 import assert_numba_path_matches_numpy

# the largest integer of each format's q (as split_blocks returns it), to give random blocks weights of ~AMPLITUDE
Q_RANGE = {"Q8_0": 128, "Q4_0": 8, "Q4_1": 15, "Q5_0": 16, "Q5_1": 31, "Q4_K": 63 * 15, "Q5_K": 63 * 31,
           "Q6_K": 128 * 32}
AMPLITUDE = 0.1
FORMATS = gguf_quants.SUPPORTED          # the float ones too (no blocks: requantized)
EXACT = quant.NIBBLE_FORMATS + quant.FIVE_BIT_FORMATS + quant.BYTE_FORMATS + ("Q6_K",)


def block_class(type_name: str) -> type:
    """The block matrix a format's tensor becomes (quant.file_matrix)."""
    if type_name == "Q6_K":
        return quant.Q6Linear
    if type_name in quant.FIVE_BIT_FORMATS:
        return quant.Q5Linear
    return quant.Q4Linear if type_name in quant.NIBBLE_FORMATS else quant.B8Linear


def random_tensor(type_name: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """The raw bytes of a [rows, cols] tensor of a format: every quant's bits random, the float16 scales and
    minimums of a size that keeps the weights near AMPLITUDE (a model made of them stays finite and peaked)."""
    rng = np.random.default_rng(seed)
    if type_name in ("F32", "F16", "BF16"):
        w = (rng.standard_normal((rows, cols)) * AMPLITUDE).astype(np.float32)
        if type_name == "F32":
            return w.view(np.uint8).reshape(-1)
        if type_name == "F16":
            return w.astype(np.float16).view(np.uint8).reshape(-1)
        return (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(-1)
    per, nbytes = gguf_quants.BLOCKS[type_name]
    n = rows * cols // per
    b = rng.integers(0, 256, (n, nbytes), dtype=np.uint8)
    f16 = lambda scale: (rng.uniform(0.5, 1, (n, 1)) * scale).astype(np.float16).view(np.uint8)   # noqa: E731
    d = AMPLITUDE / Q_RANGE[type_name]
    at = 208 if type_name == "Q6_K" else 0
    b[:, at:at + 2] = f16(d)
    if type_name in ("Q4_1", "Q5_1"):
        b[:, 2:4] = f16(-d * Q_RANGE[type_name] / 2)
    if type_name in ("Q4_K", "Q5_K"):
        b[:, 2:4] = f16(AMPLITUDE / 63)                # dmin
    return b.reshape(-1)


def info(type_name: str, rows: int, cols: int, seed: int, name: str = "t") -> TensorInfo:
    return TensorInfo(name, type_name, (rows, cols), random_tensor(type_name, rows, cols, seed))


# --- the formats, one matrix at a time ---------------------------------------------------------------------------

@pytest.mark.parametrize("type_name", gguf_quants.BLOCK_FORMATS)
def test_split_blocks_give_dequantize_back_bit_for_bit(type_name):
    rows, cols = 5, 512
    raw = random_tensor(type_name, rows, cols, seed=len(type_name))
    b = gguf_quants.split_blocks(raw, type_name, (rows, cols))
    assert b.q.dtype == np.uint8 and b.q.shape == (rows, cols) and b.d.shape == b.m.shape == (rows, cols // b.group)
    assert b.q.max() < 2 ** b.bits and b.q.max() >= 2 ** (b.bits - 1)         # the whole range is used
    w = (b.d[:, :, None] * b.q.reshape(rows, -1, b.group) + b.m[:, :, None]).reshape(rows, cols)
    assert np.array_equal(w, gguf_quants.dequantize(raw, type_name, (rows, cols)))


def test_split_blocks_refuse_formats_without_blocks_and_bad_sizes():
    with pytest.raises(ValueError, match="F16 has no integer blocks"):
        gguf_quants.split_blocks(np.zeros(64, np.uint8), "F16", (1, 32))
    with pytest.raises(ValueError, match="needs 34 bytes"):
        gguf_quants.split_blocks(np.zeros(33, np.uint8), "Q8_0", (1, 32))


@pytest.mark.parametrize("type_name", FORMATS)
def test_each_format_lands_on_its_tile_without_loss(type_name):
    O, D = 48, 512
    t = info(type_name, O, D, seed=7)
    w = gguf_quants.dequantize(t.raw, type_name, t.shape).T                        # [D, O] as the model holds it
    q = quant.file_matrix(t)
    assert q.shape == (D, O) and q.mode == quant.GGUF.name
    assert isinstance(q, block_class(type_name))
    assert isinstance(q, quant.S4Linear) == (type_name == "Q4_0")           # Q4_0's m is -8 d: no m stored
    assert isinstance(q, quant.S5Linear) == (type_name == "Q5_0")           # Q5_0's m is -16 d
    assert isinstance(q, quant.S8Linear) == (type_name in ("Q8_0", "F32", "F16", "BF16"))   # -128 d: Q8_0's rule
    got = q.dequantize()
    if type_name in ("Q4_K", "Q5_K"):     # only d * sc_j and dmin * m_j are rounded: to float16, 11 bits
        # (a scale is rounded by at most 2^-11 of itself, so a weight by 2^-11 of its block's largest term)
        bound = 2.0 ** -11 * (np.abs(w).max() + 2 * AMPLITUDE)
        assert np.abs(got - w).max() <= bound and not np.array_equal(got, w)
    elif type_name in EXACT:
        assert np.array_equal(got, w)
    else:                                 # requantized by Q8_0's rule: within half a step of its block's scale
        step = np.repeat(q.d, 32, axis=0)                                          # [D, O]
        assert np.all(np.abs(got - w) <= 0.5 * step * (1 + 1e-3))


@pytest.mark.parametrize("type_name", FORMATS)
@pytest.mark.parametrize("T", [1, 2, 7, 16, 37])  # 2, 7: row tiles of 2, 4 and 3 rows (avx2's 5-bit tile runs
#                                                    sub-tiles of two rows); 16, 37: the 5-bit kinds unpacked to bytes
def test_the_tiles_are_bit_identical_to_the_reference_on_every_format(type_name, T):
    O, D = 80, 512
    q = quant.file_matrix(info(type_name, O, D, seed=3))
    x = np.random.default_rng(T).standard_normal((T, D)).astype(np.float32)
    x[:, 3] *= 40                                                                  # an outlier channel
    xu, sx = np.empty(x.shape, np.uint8), np.empty((T, D // 32), np.float32)
    km.quantize_rows(x, xu, sx)
    want = x @ q                          # the reference of its class (matmul_reference_w4a8, matmul_reference_q6)
    if isinstance(q, quant.Q6Linear):     # the 6-bit tile, Q6_K's own blocks
        np.testing.assert_array_equal(km.matmul_w4a8(xu, sx, km.pack_q6a8(q.q, q.sc, q.d)), want)
        return
    pack = (km.pack_w4a8 if isinstance(q, quant.Q4Linear) else km.pack_q5a8 if isinstance(q, quant.Q5Linear) else
            km.pack_b8a8)
    np.testing.assert_array_equal(km.matmul_w4a8(xu, sx, pack(q.q, q.d, q.m)), want)
    symmetric = {quant.S4Linear: km.pack_s4a8, quant.S5Linear: km.pack_s5a8, quant.S8Linear: km.pack_s8a8}
    if type(q) in symmetric:              # and on the tile without m, which reads d only (Q4_0, Q5_0, Q8_0's bytes)
        np.testing.assert_array_equal(km.matmul_w4a8(xu, sx, symmetric[type(q)](q.q, q.d)), want)
    # and a narrower matrix promoted (a fused matrix of mixed formats: nibbles on the 5-bit tile, anything on
    # bytes) gives the same bits
    np.testing.assert_array_equal(km.matmul_w4a8(xu, sx, km.pack_b8a8(q.q, q.d, q.m)), want)
    if isinstance(q, quant.Q4Linear):
        np.testing.assert_array_equal(km.matmul_w4a8(xu, sx, km.pack_q5a8(q.q, q.d, q.m)), want)


@pytest.mark.parametrize("type_name", ["Q5_0", "Q5_1", "Q6_K"])
@pytest.mark.parametrize("T", [16, 19])
def test_a_threads_share_of_a_5_or_6_bit_matrix_from_16_rows_is_the_reference(type_name, T):
    """A decode step's thread at batch 16 or more (matmul_blocks on its thread_share) runs its whole column groups
    of a 5- or 6-bit matrix unpacked to bytes and the rest on the kind's tile: every split, unaligned starts and a
    partial row tile included, gives the reference's bits, written or added onto out."""
    O, D = 13 * 16, 512
    q = quant.file_matrix(info(type_name, O, D, seed=5))
    x = np.random.default_rng(T).standard_normal((T, D)).astype(np.float32)
    xu, sx = np.empty(x.shape, np.uint8), np.empty((T, D // 32), np.float32)
    km.quantize_rows(x, xu, sx)
    want = x @ q
    wt = (km.q6a8_weights(km.pack_q6a8(q.q, q.sc, q.d)) if isinstance(q, quant.Q6Linear) else
          km.s5a8_weights(km.pack_s5a8(q.q, q.d)) if isinstance(q, quant.S5Linear) else
          km.q5a8_weights(km.pack_q5a8(q.q, q.d, q.m)))
    for n_threads in (1, 2, 3):
        parts = np.full((T, O), np.nan, np.float32)
        for tid in range(n_threads):
            lo, hi = km.thread_share(O // 16, tid, n_threads)
            km.matmul_blocks(wt, x, xu, sx, parts, False, lo, hi, np.empty(km.ROWS * km.COLS * 16, np.float32))
        np.testing.assert_array_equal(parts, want, err_msg=f"{n_threads} threads")
    base = np.random.default_rng(1).standard_normal((T, O)).astype(np.float32)    # and added onto out (x += f @ w)
    added = base.copy()
    for tid in range(2):
        lo, hi = km.thread_share(O // 16, tid, 2)
        km.matmul_blocks(wt, x, xu, sx, added, True, lo, hi, np.empty(km.ROWS * km.COLS * 16, np.float32))
    np.testing.assert_array_equal(added, base + want)


def test_the_byte_tile_takes_every_byte_value_at_the_activation_extremes():
    """q = 0 and 255 against activations of +-127 in every position of a block: the largest sums the tile forms
    (where avx2's 16-bit pairs would saturate as they stand: its sign trick runs q - 128, -128 and 127, and adds 128
    times the activations' sum back), with m and without it (Q8_0's bytes: m = -128 d formed from d)."""
    D, O, T = 64, 32, 4
    q = np.where(np.arange(D * O).reshape(D, O) % 3 == 0, 255, 0).astype(np.uint8)
    q[:, :16] = 255
    q[:, 30:] = 0                                                                   # w = -128: |w| is 128 unsigned
    d = np.full((D // 32, O), 0.5, np.float32)
    m = np.full((D // 32, O), -64.0, np.float32)
    x = np.array([[1.0] * D, [-1.0] * D, [(-1.0) ** i for i in range(D)], np.linspace(-1, 1, D)], np.float32)
    xu, sx = np.empty(x.shape, np.uint8), np.empty((T, D // 32), np.float32)
    km.quantize_rows(x, xu, sx)
    got = km.matmul_w4a8(xu, sx, km.pack_b8a8(q, d, m))
    np.testing.assert_array_equal(got, quant.matmul_reference_w4a8(x, quant.B8Linear(q, d, m)))
    assert got[0, 0] == 32 * (255 * 0.5 - 64) * 2                                  # 2 blocks of 32 ones
    assert got[1, 31] == -32 * (0 * 0.5 - 64) * 2                                  # q = 0 against -1s
    got = km.matmul_w4a8(xu, sx, km.pack_s8a8(q, d))
    np.testing.assert_array_equal(got, quant.matmul_reference_w4a8(x, quant.S8Linear(q, d, np.float32(-128) * d)))
    assert got[1, 31] == -32 * (0 - 128) * 0.5 * 2 and got[0, 0] == 32 * (255 - 128) * 0.5 * 2


def _extreme_rows(D: int, T: int) -> np.ndarray:
    """T rows of activations that quantise to +-127 in every position: all +1, all -1, alternating, and a ramp."""
    x = np.array([[1.0] * D, [-1.0] * D, [(-1.0) ** i for i in range(D)], np.linspace(-1, 1, D)], np.float32)
    return np.tile(x, (T // 4, 1))


@pytest.mark.parametrize("T", [4, 20])          # 20: a prefill's rows, the 5-bit values unpacked to bytes
def test_the_5_bit_tiles_take_every_value_at_the_activation_extremes(T):
    """q = 0 and 31 (both fifth bits, every step's) against activations of +-127: the 5-bit tile forms q from its
    nibble and its fifth bit in registers; with m and without it (m = -16 d formed from d), as the byte tile. The
    largest sums avx2's 16-bit pairs hold before they are widened (4 steps of 2 x 31 x 127)."""
    D, O = 64, 32
    q = np.where(np.arange(D * O).reshape(D, O) % 3 == 0, 31, 0).astype(np.uint8)
    q[:, :16] = 31
    q[::5, 16:] = 16                                                               # a fifth bit alone
    d = np.full((D // 32, O), 0.5, np.float32)
    x = _extreme_rows(D, T)
    xu, sx = np.empty(x.shape, np.uint8), np.empty((T, D // 32), np.float32)
    km.quantize_rows(x, xu, sx)
    for m, wp in ((np.full_like(d, -3.0), km.pack_q5a8(q, d, np.full_like(d, -3.0))), (-16 * d, km.pack_s5a8(q, d))):
        got = km.matmul_w4a8(xu, sx, wp)
        np.testing.assert_array_equal(got, quant.matmul_reference_w4a8(x, quant.Q5Linear(q, d, m)))
        assert np.all(got[::4, 0] == 2 * (32 * 31 * 0.5 + 32 * m[0, 0]))          # 2 blocks of 32 ones
    with pytest.raises(ValueError, match="5-bit values"):
        km.pack_q5a8(q + 1, d, d)


@pytest.mark.parametrize("T", [4, 20])
def test_the_6_bit_tile_takes_every_value_at_the_activation_extremes(T):
    """Q6_K's q = 0 and 63 against activations of +-127, scales at the ends of int8: the largest sums the 6-bit tile
    forms (avx2 widens its 16-bit pairs after every 2 steps: 2 x 2 x 63 x 127 fits, 4 steps would not)."""
    D, O = 256, 32
    q = np.where(np.arange(D * O).reshape(D, O) % 3 == 0, 63, 0).astype(np.uint8)
    q[:, :16] = 63
    sc = np.where(np.arange(D // 16 * O).reshape(D // 16, O) % 2 == 0, 127, -128).astype(np.int8)
    d = np.full((D // 256, O), 2.0 ** -10, np.float32)
    x = _extreme_rows(D, T)
    xu, sx = np.empty(x.shape, np.uint8), np.empty((T, D // 32), np.float32)
    km.quantize_rows(x, xu, sx)
    got = km.matmul_w4a8(xu, sx, km.pack_q6a8(q, sc, d))
    np.testing.assert_array_equal(got, quant.matmul_reference_q6(x, quant.Q6Linear(q, sc, d)))
    ones = 16 * (63 - 32) * sc[:, 0].astype(np.int64).sum()                      # every half of 16: q 63, x 127
    np.testing.assert_allclose(got[::4, 0], ones * 127 * 2.0 ** -10 * sx[0, 0], rtol=1e-6)


# --- a model of every format --------------------------------------------------------------------------------------

# per layer, each matrix's format: Q|K|V and gate|up mix nibbles, bytes, floats and Q6_K (a fused matrix on the byte
# tile), `o` is Q4_0 on every layer (the symmetric nibble tile), `down` nibbles beside a 5-bit matrix (the 5-bit
# tile with its minimum); the tied embedding is Q6_K (the 6-bit tile for the LM head)
LAYER_FORMATS = [
    {"wq": "Q4_0", "wk": "Q4_1", "wv": "Q4_K", "wo": "Q4_0", "w_gate": "Q5_0", "w_up": "Q5_1", "w_down": "Q4_1"},
    {"wq": "Q5_K", "wk": "Q8_0", "wv": "F16", "wo": "Q4_0", "w_gate": "Q4_1", "w_up": "Q6_K", "w_down": "Q5_K"},
    {"wq": "Q8_0", "wk": "Q5_0", "wv": "Q5_1", "wo": "Q4_0", "w_gate": "BF16", "w_up": "F32", "w_down": "Q4_0"},
]


@pytest.fixture(scope="module")
def every_format():
    """A tiny llama (D = 256, so that K-quant rows fit) whose matrices are LAYER_FORMATS' random blocks, its float32
    weights their dequantized values (Q/K rows unpermuted as gguf_file does), with the tensors as a GGUF's."""
    base = ts.tiny_model(seed=0, dim=256, intermediate_size=512, n_heads=4, n_kv_heads=2, n_layers=3)
    cfg = base.config
    names = {f: n for n, f in LAYER_TENSORS.items()}
    tensors, layers = {}, []
    for i, (w, fmts) in enumerate(zip(base.layers, LAYER_FORMATS)):
        new = {}
        for j, f in enumerate(quant.MATRICES):
            D, O = getattr(w, f).shape
            t = info(fmts[f], O, D, seed=10 * i + j, name=f"blk.{i}.{names[f]}")
            tensors[t.name] = t
            v = gguf_quants.dequantize(t.raw, t.type_name, t.shape)                 # [O, D]
            if f in ("wq", "wk"):
                v = unpermute_rope_rows(v, cfg.n_heads if f == "wq" else cfg.n_kv_heads)
            new[f] = np.ascontiguousarray(v.T)
        layers.append(dataclasses.replace(w, **new))
    emb = info("Q6_K", cfg.vocab_size, cfg.dim, seed=99, name="token_embd.weight")   # as the 1B files' head
    tensors[emb.name] = emb
    embed = gguf_quants.dequantize(emb.raw, "Q6_K", emb.shape)                      # [V, D], tied: the LM head
    return dataclasses.replace(base, layers=layers, embed=embed, gguf_tensors=tensors)


def test_the_gguf_mode_holds_the_files_blocks(every_format):
    qm = quant.quantize_model(every_format, quant.GGUF.name)
    for w, qw, fmts in zip(every_format.layers, qm.layers, LAYER_FORMATS):
        for f in quant.MATRICES:
            q = getattr(qw, f)
            # (Q6_K beside other formats in gate|up: requantized onto the byte tile its role runs on)
            assert isinstance(q, quant.B8Linear if fmts[f] == "Q6_K" else block_class(fmts[f])), f
            if fmts[f] in EXACT and fmts[f] not in ("Q4_K", "Q5_K", "Q6_K"):   # Q/K: the rows unpermuted as the floats
                assert np.array_equal(q.dequantize(), getattr(w, f)), (f, fmts[f])
    assert isinstance(qm.lm_head_q, quant.Q6Linear)
    assert np.array_equal(qm.lm_head_q.dequantize(), every_format.embed.T)       # the Q6_K head, exactly


def test_each_role_packs_on_the_tile_its_formats_need(every_format):
    m = backend.set_backend(every_format, quant.GGUF.name, "numba")
    fw = fast.prepare(m)
    assert isinstance(fw.layers[0].o, km.S4A8Weights)                  # Q4_0 on every layer: d only
    assert isinstance(fw.layers[0].down, km.Q5A8Weights)               # nibbles beside 5-bit values: the 5-bit tile
    for role in ("qkv", "gate_up"):                                    # bytes somewhere: bytes on every layer
        assert isinstance(getattr(fw.layers[0], role), km.B8A8Weights), role
    assert isinstance(fw.lm_head, km.Q6A8Weights)                      # Q6_K alone: the 6-bit tile
    assert fw.decode.layers.qkv.w.shape[0] == len(LAYER_FORMATS)       # stacked for the fused step


def test_a_decode_step_reads_each_role_at_its_tiles_bytes(every_format):
    """quant.bytes_per_decode_step counts each fused role as kernels/forward.py packs it: `o` at Q4_0's 18 bytes per
    32 weights, `down` at the 5-bit tile's 24, Q|K|V and gate|up at the byte tile's 36 (a Q6_K part requantized), the Q6_K
    head at its own 210 per 256; and the packed arrays the fused step streams are that many bytes."""
    qm = quant.quantize_model(every_format, quant.GGUF.name)
    cfg, L = qm.config, len(LAYER_FORMATS)
    D, NH, KH, F, V = cfg.dim, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.intermediate_size, \
        cfg.vocab_size
    weights = {"o": L * NH * D, "down": L * F * D, "qkv": L * D * (NH + 2 * KH), "gate_up": L * D * 2 * F}
    rate = {"o": 18 / 32, "down": 24 / 32, "qkv": 36 / 32, "gate_up": 36 / 32}
    want = sum(weights[r] * rate[r] for r in weights) + D * V * 210 / 256
    assert quant.bytes_per_decode_step(qm) == want
    fw = fast.prepare(backend.set_backend(every_format, quant.GGUF.name, "numba"))
    packed = sum(getattr(fw.decode.layers, r).w.nbytes for r in weights) + fw.lm_head.w.nbytes
    assert packed == want


def test_the_numba_path_computes_the_numpy_reference(every_format):
    """Prefill and decode on the kernels (three-call layers) against model.forward on the NumPy reference of the
    same blocks: the same logits up to attention's float order; and the fused decode step's greedy tokens."""
    assert_numba_path_matches_numpy(quant.quantize_model(every_format, quant.GGUF.name), "gguf")


def test_auto_picks_gguf_for_a_file_and_keeps_w4a8_for_the_folder(every_format):
    assert backend.default_quant(every_format, "numba") == quant.GGUF.name
    assert backend.default_quant(dataclasses.replace(every_format, gguf_tensors=None), "numba") != quant.GGUF.name
    assert backend.default_quant(every_format, "numpy") == quant.NONE.name
    m = backend.set_backend(every_format, "auto", "numba")
    assert m.quant == quant.GGUF.name
    with pytest.raises(ValueError, match="cannot become"):
        backend.set_backend(m, "w8a8-64", "numba")


def test_a_model_without_a_file_runs_gguf_requantized():
    """quant="gguf" on a float32 model with no file behind it: every matrix on the byte tile by Q8_0's rule."""
    m = ts.tiny_model(seed=1)
    qm = quant.quantize_model(m, quant.GGUF.name)
    assert all(isinstance(getattr(w, f), quant.B8Linear) for w in qm.layers for f in quant.MATRICES)
    ref = naive.forward(m, [3, 4, 5, 6])
    got = naive.forward(backend.set_backend(qm, "gguf", "numba"), [3, 4, 5, 6])
    assert np.array_equal(got.argmax(-1), ref.argmax(-1))
