"""Three ways to multiply bytes (and a fourth for CPUs with none): the int8 tile of each instruction set.

Every tile has one contract, `tile(x, x_off, x_stride, w, w_off, w_stride, n4, nb, xsum, sx, s_off, s_stride,
out, o_off, o_stride)`: over nb activation blocks of 4 n4 inputs each,

    dot[r, b, o] = sum_{i in block b} (W[c, l, i] + TILE_OFFSET) * x[r, i] - TILE_OFFSET * xsum[r, b]
    out[r, o]    = (((0 + float32(dot[r, 0, o]) * sx[r, 0]) + float32(dot[r, 1, o]) * sx[r, 1]) + ...)   float32

with o = 16c + l. x: the int8 activations, signed (row r at x_off + r*x_stride), w: int8 weights packed by
kernels.matmul.pack_vnni (block c at w_off + c*w_stride: per step i, 64 bytes = 16 outputs x 4 inputs,
output-major), xsum: int32, each row's activations summed over each block, and sx: float32 activation scales (both:
row r, block b at s_off + r*s_stride + b), out: float32 (row r at o_off + r*o_stride). Subtracting
TILE_OFFSET * xsum is exact in int32, so every variant gets the same integers and, adding the blocks in the same
order, the same floats: W8A8 stays bit-identical to the NumPy reference.

The offset sits on the weights, not on the activations: the correction is then one number per row and block (xsum,
from the row the tile has at hand) instead of one per output and block (the weights' sums, an [nb, O] table that
a 1-row matmul would read from memory beside the weights, on a stride of O, slowing the stream).

    avx512vnni, avxvnni   vpdpbusd(acc, w, x): 4 products u8 x s8 per 32-bit lane, summed into it. An unsigned
                          operand is why the weights are flipped to w + 128 (w ^ 0x80, in the register: TILE_OFFSET
                          = 128). zmm: 64 MACs per op; ymm: 32.
    avx2                  no byte dot product with 32-bit sums. vpmaddubsw multiplies u8 x s8 and adds pairs into
                          16 bits, which saturate (2 x 255 x 127 > 32767). The sign trick (llama.cpp's
                          mul_sum_i8_pairs) keeps them in range: |x| (u8, <= 128) times w with x's sign moved onto
                          it (vpsignb), a pair at most 2 x 128 x 127 = 32512; then vpmaddwd by ones adds the pairs
                          into 32 bits. 4 ops for 32 MACs, no offset (TILE_OFFSET = 0).
    neon                  sdot(acc, w, x): 4 products s8 x s8 per 32-bit lane (arm64 dotprod), 16 MACs per op.
    generic               no byte dot product named: LLVM's own vector IR, which it lowers for any CPU. Each of
                          the 64 bytes of a step gets its own int32 accumulator (x and w widened, multiplied,
                          added); the 4 of each output lane are added once, after the loop. (Plain Numba loops
                          that reduce each lane in the loop ran at 1-2 GOP/s: LLVM did not vectorise them.)

A tile of R x C blocks keeps R*C accumulators in registers for the whole loop over the input; where that does not
fit the register file (AVX2's 16 ymm hold 8 blocks), the tile runs as sub-tiles, each its own pass over the input
(isa.plan_subtiles): the sum of each output is the same, only the loads repeat (from L1).
"""
from __future__ import annotations

from typing import Callable, NamedTuple

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from . import isa
from .simd import _data_pointer

BLOCK = 16                                                   # outputs per packed block
_I1, _I8, _I16, _I32 = ir.IntType(1), ir.IntType(8), ir.IntType(16), ir.IntType(32)

# Software prefetch, on the first row pass over a tile: each weight line of the *next* tile (the same position, C
# blocks further on: the next tile of this thread's share) is asked into L2 while this one computes. A tile's C
# streams are short (D x 16 bytes each), so the hardware prefetcher meets a fresh set of streams at every tile and
# starts each cold; one tile ahead, they are in L2 when the tile begins. Into L2, not L1 (locality 2, prefetcht1): a
# tile ahead is more than L1 holds. Of the prefetch rules tried this one makes the 1-row fused step fastest
# (docs/performance.md, "Why the kernels' constants are what they are").
PREFETCH_LOCALITY = 2
TILE_OFFSET = 128 if isa.NAME in ("avx512vnni", "avxvnni") else 0


def add_to_out(builder, row, offset, value, first) -> None:
    """row[offset : offset + lanes] += value, a float vector; where `first` (an i1: block 0) it is stored onto 0
    instead (the scratch's old contents are loaded, then not used)."""
    ptr = builder.bitcast(builder.gep(row, [offset]), value.type.as_pointer())
    before = builder.select(first, ir.Constant(value.type, [0.0] * value.type.count), builder.load(ptr, align=4))
    builder.store(builder.fadd(before, value), ptr, align=4)


def for_each_block(builder, nb, one_block) -> None:
    """one_block(b, first) for b = 0 .. nb - 1, in order (the blocks' float sums are added in block order); first
    is b == 0 as an i1. One loop, its body emitted once: a tile's code (and its compile time) is not doubled."""
    with cgutils.for_range(builder, nb) as blocks:
        one_block(blocks.index, builder.icmp_unsigned("==", blocks.index, ir.Constant(nb.type, 0)))


class IsaStep(NamedTuple):
    """What an instruction set brings to a tile, the int8 ones here and the int4 ones (int4_dot.py) alike: one
    4-input step of one vb-byte register of a block of 16 outputs, as LLVM IR emitted with `builder`. The tiles
    differ in what they load and how they scale the sums; the instruction set only in these pieces:

        acc_type                              an accumulator register's type
        extra_registers                       registers the step holds beside the accumulators and the weights (for
                                              the sub-tile plan: a tile's accumulators must stay in registers)
        setup(builder) -> state               intrinsics and constants, declared once per tile
        per_row(builder, state, x) -> xr      a row's 4 activation bytes, broadcast to every lane, -> step's operand
        step(builder, state, acc, w, xr) -> acc          w's 4 bytes per lane times xr's, added into acc
        finish(builder, state, acc) -> <lanes x i32>     the accumulator as one 32-bit sum per output
    """
    acc_type: ir.Type
    extra_registers: int
    setup: Callable
    per_row: Callable
    step: Callable
    finish: Callable


def unchanged(builder, state, value):
    """per_row or finish where the instruction set needs neither: the value as it is."""
    return value


def _isa_step(name: str, vb: int) -> IsaStep:
    """The int8 step of an instruction set (the module docstring says what each does)."""
    nb, nl = vb, vb // 4                                     # bytes and int32 lanes per register
    bytes_t, lanes_t = ir.VectorType(_I8, nb), ir.VectorType(_I32, nl)

    def fn(builder, name_, ret, args):
        return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name_)

    flip = ir.Constant(bytes_t, [ir.Constant(_I8, -128)] * nb)   # w ^ 0x80 = w + 128 as an unsigned byte
    if name in ("avx512vnni", "avxvnni"):
        intr = "llvm.x86.avx512.vpdpbusd.512" if vb == 64 else "llvm.x86.avx512.vpdpbusd.256"

        def setup(builder):
            return fn(builder, intr, lanes_t, [lanes_t, lanes_t, lanes_t])

        def per_row(builder, st, xb):
            return builder.bitcast(xb, lanes_t)               # the 4 signed bytes as they are

        def step(builder, st, acc, wv, xr):                  # (the flip is the same for every row: LLVM does it once)
            return builder.call(st, [acc, builder.bitcast(builder.xor(wv, flip), lanes_t), xr])
        return IsaStep(lanes_t, 1, setup, per_row, step, unchanged)

    if name == "avx2":
        s16_t = ir.VectorType(_I16, nb // 2)

        def setup(builder):
            return (fn(builder, "llvm.x86.avx2.pmadd.ub.sw", s16_t, [bytes_t, bytes_t]),
                    fn(builder, "llvm.x86.avx2.pmadd.wd", lanes_t, [s16_t, s16_t]),
                    fn(builder, "llvm.x86.avx2.psign.b", bytes_t, [bytes_t, bytes_t]),
                    fn(builder, "llvm.abs.v32i8", bytes_t, [bytes_t, _I1]),
                    ir.Constant(s16_t, [ir.Constant(_I16, 1)] * (nb // 2)))

        def per_row(builder, st, xb):
            return xb, builder.call(st[3], [xb, ir.Constant(_I1, 0)])    # x and |x| (|-128| reads as u8 128)

        def step(builder, st, acc, wv, xr):
            maddubs, maddwd, psign, _, ones = st
            xs, ax = xr
            pairs = builder.call(maddubs, [ax, builder.call(psign, [wv, xs])])     # |x| * (w * sign x), in pairs
            return builder.add(acc, builder.call(maddwd, [pairs, ones]))
        return IsaStep(lanes_t, 4, setup, per_row, step, unchanged)

    if name == "generic":
        wide_t = ir.VectorType(_I32, nb)                     # one int32 per byte: LLVM splits it for the CPU

        def setup(builder):
            return None

        def per_row(builder, st, xb):
            return builder.sext(xb, wide_t)

        def step(builder, st, acc, wv, xr):                  # acc[4l + k] += x[k] * w[l, k]: no shuffle in the loop
            return builder.add(acc, builder.mul(xr, builder.sext(wv, wide_t)))

        def finish(builder, st, acc):                        # the 4 products of each lane, added
            k = [builder.shuffle_vector(acc, ir.Constant(wide_t, None),
                                        ir.Constant(lanes_t, [4 * lane + j for lane in range(nl)])) for j in range(4)]
            return builder.add(builder.add(k[0], k[1]), builder.add(k[2], k[3]))
        return IsaStep(wide_t, 1, setup, per_row, step, finish)

    if name == "neon":
        def setup(builder):
            return fn(builder, "llvm.aarch64.neon.sdot.v4i32.v16i8", lanes_t, [lanes_t, bytes_t, bytes_t])

        def step(builder, st, acc, wv, xr):
            return builder.call(st, [acc, wv, xr])
        return IsaStep(lanes_t, 1, setup, unchanged, step, unchanged)
    raise ValueError(f"no intrinsic tile for {name!r}")


def _intrinsic_tile(R: int, C: int, name: str):
    """An R x C int8 tile for an instruction set with a byte dot product (see the module docstring)."""
    vb = isa.VARIANTS[name].vector_bytes
    parts = 64 // vb                                         # registers per 64-byte step of one block
    nl = vb // 4                                             # int32 lanes per register
    lanes_t, float_t = ir.VectorType(_I32, nl), ir.VectorType(ir.FloatType(), nl)
    acc_t, extra, setup, per_row, step, finish = _isa_step(name, vb)
    generic = name == "generic"                              # accumulates per byte: 4x the accumulators
    rs, cs = (1, 1) if generic else isa.plan_subtiles(R, C, extra)
    shift = TILE_OFFSET.bit_length() - 1                     # TILE_OFFSET * xsum as a shift (128 = 2^7)

    @intrinsic
    def tile(typingctx, x, x_off, x_stride, w, w_off, w_stride, n4, nb, xsum, sx, s_off, s_stride, out, o_off,
             o_stride):
        sig = types.void(x, x_off, x_stride, w, w_off, w_stride, n4, nb, xsum, sx, s_off, s_stride, out, o_off,
                         o_stride)

        def codegen(context, builder, signature, args):
            (x_arr, x_off, x_stride, w_arr, w_off, w_stride, n4, nb, xsum_arr, sx_arr, s_off, s_stride, out_arr,
             o_off, o_stride) = args
            ty = signature.args
            i64 = x_off.type
            k = lambda v: ir.Constant(i64, v)                                           # noqa: E731
            st = setup(builder)
            next_tile = builder.mul(w_stride, k(C))           # a weight line -> the same line of the next tile
            prefetch = cgutils.get_or_insert_function(        # (address, 0 = read, locality, 1 = data)
                builder.module, ir.FunctionType(ir.VoidType(), [_I8.as_pointer(), _I32, _I32, _I32]), "llvm.prefetch")
            x_rows = [_data_pointer(context, builder, ty[0], x_arr, builder.add(x_off, builder.mul(x_stride, k(r))))
                      for r in range(R)]
            w_cols = [_data_pointer(context, builder, ty[3], w_arr, builder.add(w_off, builder.mul(w_stride, k(c))))
                      for c in range(C)]
            xsum_base = cgutils.create_struct_proxy(ty[8])(context, builder, xsum_arr).data   # int32*
            sx_base = cgutils.create_struct_proxy(ty[9])(context, builder, sx_arr).data       # float*
            out_base = cgutils.create_struct_proxy(ty[12])(context, builder, out_arr).data    # float*
            s_rows = [builder.add(s_off, builder.mul(s_stride, k(r))) for r in range(R)]
            sx_rows = [builder.gep(sx_base, [s]) for s in s_rows]
            xsum_rows = [builder.gep(xsum_base, [s]) for s in s_rows]
            out_rows = [builder.gep(out_base, [builder.add(o_off, builder.mul(o_stride, k(r)))]) for r in range(R)]
            for c0 in range(0, C, cs):                       # one pass over the input per sub-tile
                for r0 in range(0, R, rs):
                    sub_r, sub_c = range(r0, min(R, r0 + rs)), range(c0, min(C, c0 + cs))
                    acc = {(r, c, p): cgutils.alloca_once(builder, acc_t)
                           for r in sub_r for c in sub_c for p in range(parts)}

                    def one_block(b, first):                    # activation block b (first: b == 0, an i1)
                        for r in sub_r:                         # the int sums start at -TILE_OFFSET * xsum[r, b]
                            init = ir.Constant(acc_t, None)
                            if TILE_OFFSET:
                                v = builder.neg(builder.shl(builder.load(builder.gep(xsum_rows[r], [b])),
                                                            ir.Constant(_I32, shift)))
                                init = builder.shuffle_vector(
                                    builder.insert_element(ir.Constant(lanes_t, None), v, ir.Constant(_I32, 0)),
                                    ir.Constant(lanes_t, None), ir.Constant(lanes_t, None))
                            for c in sub_c:
                                for p in range(parts):
                                    builder.store(init, acc[r, c, p])
                        start = builder.mul(b, n4)                          # the block's first 4-byte step
                        with cgutils.for_range(builder, n4) as loop:
                            i = builder.add(start, loop.index)
                            if r0 == 0:                          # (the later row passes read from cache)
                                for c in sub_c:
                                    ahead = builder.gep(w_cols[c], [builder.add(builder.mul(i, k(64)), next_tile)])
                                    builder.call(prefetch, [builder.bitcast(ahead, _I8.as_pointer())]
                                                 + [ir.Constant(_I32, a) for a in (0, PREFETCH_LOCALITY, 1)])
                            w_vec = {(c, p): builder.load(builder.bitcast(
                                         builder.gep(w_cols[c], [builder.add(builder.mul(i, k(64)), k(vb * p))]),
                                         ir.VectorType(_I8, vb).as_pointer()), align=1)
                                     for c in sub_c for p in range(parts)}
                            for r in sub_r:
                                x4 = builder.load(builder.bitcast(builder.gep(x_rows[r], [builder.mul(i, k(4))]),
                                                                  _I32.as_pointer()), align=1)  # 4 bytes as one i32
                                one = builder.insert_element(ir.Constant(lanes_t, None), x4, ir.Constant(_I32, 0))
                                xb = builder.bitcast(builder.shuffle_vector(one, ir.Constant(lanes_t, None),
                                                                            ir.Constant(lanes_t, None)),
                                                     ir.VectorType(_I8, vb))            # ... in every 32-bit lane
                                xr = per_row(builder, st, xb)
                                for c in sub_c:
                                    for p in range(parts):
                                        a = acc[r, c, p]
                                        builder.store(step(builder, st, builder.load(a), w_vec[c, p], xr), a)
                        for r in sub_r:                  # the block's exact sums, scaled by its sx, added in float32
                            s = builder.load(builder.gep(sx_rows[r], [b]))
                            sv = builder.shuffle_vector(builder.insert_element(ir.Constant(float_t, None), s,
                                                                               ir.Constant(_I32, 0)),
                                                        ir.Constant(float_t, None), ir.Constant(lanes_t, None))
                            for c in sub_c:
                                for p in range(parts):
                                    part = builder.fmul(builder.sitofp(finish(builder, st,
                                                                              builder.load(acc[r, c, p])), float_t), sv)
                                    add_to_out(builder, out_rows[r], k(BLOCK * c + nl * p), part, first)

                    for_each_block(builder, nb, one_block)
            return context.get_dummy_value()

        return sig, codegen

    return tile


def make_int8_tile(R: int, C: int):
    """The R x C int8 tile of the chosen instruction set (isa.NAME)."""
    return _intrinsic_tile(R, C, isa.NAME)
