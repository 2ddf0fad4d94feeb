"""The one order in which every attention kernel adds over key positions: why a greedy answer does not depend on the
batch.

On the int8-activation paths every matmul is exact integer arithmetic with a per-row float epilogue, and norms, RoPE
and quantisation are per row, so a row's logits depend on the other rows of its step only through attention's float
sums. If two kernels add the same terms in different orders they differ by ~1e-7; that moves one activation across
an int8 rounding step, and the greedy tokens part a few tokens later (docs/batch-invariance.md). So every kernel
(kernels/dense_attention.py's two, kernels/attention.py's paged prefill and decode kernels, which the fused decode
step of kernels/decode_step.py also runs) computes each (query row, head) with exactly these operations:

    The rule. A query row at position p sees keys 0 .. p. They are taken in chunks of CHUNK positions,
    [0, 64), [64, 128), ... (the last one cut at p + 1), in ascending order, with m = -inf, l = 0, acc = 0:
        s_j   = sum_d q[d] k_j[d]         one fused multiply-add per d, d = 0, 1, ..., starting from 0
        m'    = max(m, scale * max_j s_j)                                (exact: a max does not round)
        alpha = exp32(m - m')                                  (~1e-38 for the first chunk, where l = acc = 0)
        e_j   = exp32(scale * s_j - m')                                  (fast_exp.exp32, no fused multiply-add)
        l'    = l * alpha + lane_sum(e)                                  (lane_sum: below)
        pv[d] = sum_j e_j v_j[d]          one fused multiply-add per j, in ascending j, starting from 0
        acc'  = acc * alpha + pv                                         (a multiply, then an add)
    and out = acc * (1 / l).

    With a sliding window W (lesson 11's local layers) the row sees keys lo .. p, lo = max(0, p - W + 1). The chunks
    stay where they are ([0, 64), [64, 128), ...: aligned to absolute positions, never to lo), the chunks wholly
    before lo are skipped, and in the chunk holding lo the keys before it get weight e_j = 0 exactly (not
    exp32(-inf), which is ~1e-38): they add nothing to l (lane_sum adds 0) nor to pv (fma(0, v, x) = x for a finite
    v). So a windowed row's bits do not depend on the batch either, and a window that does not bind (p < W) leaves
    the rule above unchanged (chunk_softmax_window).

Nothing in it depends on how many rows or heads a kernel computes together, which thread runs them, or whether
the keys come from a contiguous cache, paged blocks or the prefill chunk itself. A kernel may compute scores for
keys a row does not see (a tile of rows shares its keys), as long as the row's sums never include them; adding a
zero weight (fma(0, v, x) = x) is allowed.

These functions are compiled without fastmath: LLVM may vectorise them but never reassociate or contract, so the
bits are the ones the rule says on every instruction set. The float32 NumPy reference (tinyserve.paged, gqa) is
exempt: BLAS picks GEMV or GEMM by the row count, so it adds in a batch-dependent order of its own.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .fast_exp import exp32, row_max

CHUNK = 64          # key positions per chunk of the rule: a multiple of the microkernels' 16-lane tiles
LANES = 16          # lane_sum's width
_F32, _I32 = ir.FloatType(), ir.IntType(32)
_VF16 = ir.VectorType(_F32, 16)


@intrinsic
def fma32(typingctx, a, b, c):
    """a * b + c with one rounding (llvm.fma.f32: vfmadd where the CPU has it, exact software elsewhere). Numba
    has no fma of its own, and "contract" would let LLVM choose per loop where to fuse: the rule needs it fixed."""
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context, builder, signature, args):
        f32 = ir.FloatType()
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f32, [f32, f32, f32]), "llvm.fma.f32")
        return builder.call(fn, args)
    return sig, codegen


@intrinsic
def lane_sum(typingctx, x, n):
    """sum(x[:n]) of a contiguous float32 array in a fixed order: lane i of 16 adds x[i], x[i + 16], ... in turn,
    from 0 (the last, partial run: the lanes below n % 16 only), then the 16 lanes fold in halves (lane i + 8 onto
    lane i, then i + 4, ...). Written as LLVM IR so the 16 running sums stay in one vector register: as a Numba loop
    over a scratch array they would go through memory, many times slower, for the same bits.
    It reads from the array's data pointer, so it takes only a C-contiguous 1-d float32 array (a row of a C array, or
    a slice of one along its last axis, as its callers pass): anything else fails to compile instead of being summed
    with the wrong stride."""
    if not (isinstance(x, types.Array) and x.ndim == 1 and x.layout == "C" and x.dtype == types.float32
            and isinstance(n, types.Integer)):
        raise TypeError(f"lane_sum takes a C-contiguous 1-d float32 array and an integer count, not ({x}, {n})")
    sig = types.float32(x, n)

    def codegen(context, builder, signature, args):
        f32, i64 = _F32, ir.IntType(64)
        vec_t, idx_t = _VF16, ir.VectorType(_I32, LANES)
        data = cgutils.create_struct_proxy(signature.args[0])(context, builder, args[0]).data
        count = context.cast(builder, args[1], signature.args[1], types.int64)
        at = lambda j: builder.bitcast(builder.gep(data, [j]), vec_t.as_pointer())       # noqa: E731
        acc = cgutils.alloca_once_value(builder, ir.Constant(vec_t, [ir.Constant(f32, 0.0)] * LANES))
        runs = builder.udiv(count, ir.Constant(i64, LANES))
        with cgutils.for_range(builder, runs) as loop:
            v = builder.load(at(builder.mul(loop.index, ir.Constant(i64, LANES))), align=4)
            builder.store(builder.fadd(builder.load(acc), v), acc)
        full = builder.mul(runs, ir.Constant(i64, LANES))
        rest = builder.trunc(builder.sub(count, full), _I32)
        lanes = ir.Constant(idx_t, [ir.Constant(_I32, i) for i in range(LANES)])
        mask = builder.icmp_unsigned("<", lanes, builder.shuffle_vector(
            builder.insert_element(ir.Constant(idx_t, None), rest, ir.Constant(_I32, 0)), ir.Constant(idx_t, None),
            ir.Constant(idx_t, [ir.Constant(_I32, 0)] * LANES)))
        masked_load = cgutils.get_or_insert_function(builder.module, ir.FunctionType(
            vec_t, [vec_t.as_pointer(), _I32, mask.type, vec_t]), "llvm.masked.load.v16f32.p0v16f32")
        tail = builder.call(masked_load, [at(full), ir.Constant(_I32, 4), mask, ir.Constant(vec_t, None)])
        total = builder.load(acc)
        total = builder.select(mask, builder.fadd(total, tail), total)      # lanes past n: not touched
        half = LANES // 2
        while half >= 1:                                                     # lane i += lane i + half
            shifted = builder.shuffle_vector(total, ir.Constant(vec_t, None),
                                             ir.Constant(idx_t, [ir.Constant(_I32, (i + half) % LANES)
                                                                 for i in range(LANES)]))
            total = builder.fadd(total, shifted)
            half //= 2
        return builder.extract_element(total, ir.Constant(_I32, 0))
    return sig, codegen


@njit(cache=True, inline="always")
def chunk_softmax(s, n, scale, m, l):
    """The rule's softmax step for one (row, head) and one chunk: s[:n] scores -> e_j in place. Returns (m', alpha,
    l'). m = -inf and l = 0 before the first chunk."""
    m_new = max(m, scale * row_max(s, n))
    alpha = exp32(m - m_new)            # inline arithmetic, not a libm call: once per (row, head, chunk) of a prefill
    for j in range(n):
        s[j] = exp32(scale * s[j] - m_new)
    return m_new, alpha, l * alpha + lane_sum(s, n)


@njit(cache=True, inline="always")
def chunk_softmax_window(s, lo, n, scale, m, l):
    """chunk_softmax for a chunk whose first `lo` keys (0 <= lo < n) are behind the row's sliding window: their
    weights become exactly 0 and the max runs over the rest. lo = 0 is chunk_softmax operation for operation."""
    m_new = max(m, scale * row_max(s[lo:], n - lo))
    alpha = exp32(m - m_new)
    for j in range(lo):
        s[j] = np.float32(0.0)
    for j in range(lo, n):
        s[j] = exp32(scale * s[j] - m_new)
    return m_new, alpha, l * alpha + lane_sum(s, n)


@njit(cache=True, inline="always")
def combine(acc, alpha, pv):
    """acc <- acc * alpha + pv: a chunk's weighted V sum joins the running one (both [H])."""
    for d in range(acc.shape[0]):
        acc[d] = acc[d] * alpha + pv[d]


@njit(cache=True, inline="always")
def finish(acc, l, out):
    """out <- acc * (1 / l) ([H])."""
    inv = np.float32(1.0) / l
    for d in range(acc.shape[0]):
        out[d] = acc[d] * inv


def _transpose_masks():
    """The four two-source shuffles of a 16 x 16 transpose: at step b (8, 4, 2, 1) rows i and i + b (bit b of i
    clear) swap their off-diagonal b x b blocks."""
    steps = []
    for b in (8, 4, 2, 1):
        lo = [l if not l & b else 16 + l - b for l in range(16)]        # row i:     its own lanes, then i+b's
        hi = [l + b if not l & b else 16 + l for l in range(16)]        # row i + b: i's upper lanes, then its own
        steps.append((b, lo, hi))
    return steps


@intrinsic
def transpose16(typingctx, src, offs, dst, dst_off, dst_stride):
    """dst[dst_off + i * dst_stride + r] = src[offs[r] + i] for r, i < 16: sixteen rows of 16 floats (anywhere in
    src, e.g. 16 keys' head dims in a paged pool) become 16 rows of 16 keys, in registers (64 shuffles where a
    scalar loop moves 256 floats one by one). Only moves bits."""
    sig = types.void(src, offs, dst, dst_off, dst_stride)

    def codegen(context, builder, signature, args):
        src_a, offs_a, dst_a, d_off, d_stride = args
        ty = signature.args
        sp = cgutils.create_struct_proxy(ty[0])(context, builder, src_a).data
        op = cgutils.create_struct_proxy(ty[1])(context, builder, offs_a).data
        dp = cgutils.create_struct_proxy(ty[2])(context, builder, dst_a).data
        rows = []
        for r in range(16):
            off = builder.load(builder.gep(op, [ir.Constant(ir.IntType(64), r)]))
            rows.append(builder.load(builder.bitcast(builder.gep(sp, [off]), _VF16.as_pointer()), align=4))
        for b, lo, hi in _transpose_masks():
            out = list(rows)
            for i in range(16):
                if i & b:
                    continue
                out[i] = builder.shuffle_vector(rows[i], rows[i + b], ir.Constant(ir.VectorType(_I32, 16), lo))
                out[i + b] = builder.shuffle_vector(rows[i], rows[i + b], ir.Constant(ir.VectorType(_I32, 16), hi))
            rows = out
        for i in range(16):
            at = builder.add(d_off, builder.mul(d_stride, ir.Constant(d_off.type, i)))
            builder.store(rows[i], builder.bitcast(builder.gep(dp, [at]), _VF16.as_pointer()), align=4)
        return context.get_dummy_value()
    return sig, codegen
