"""The W4A8 tile: 4-bit weights exactly as the GGUF ships them (Q4_1), times int8 activations, per instruction set.

SmolLM2's layers come as Q4_1: for each run of 32 inputs of an output channel, 32 nibbles q (0..15) and two float16,
a scale d and a minimum m, so that w = d * q + m. The float32 model (weights.py) is those values, exactly; the int8
modes round them again (to 127 steps of a per-channel scale) and read 8 bits per weight where 4.5 carry it. At
batch 1 a decode step reads every weight once, so bytes are time: 4-bit layers make a step read about two thirds
of int8's bytes (tinyserve.quant: bytes_per_decode_step).

Per block b of 32 inputs, output o (x: activations quantised per block of 32, xq = int8, scale sx[b]):

    dot[b, o] = sum_{i in b} xq[i] * q[i, o]                                          exact, in integers
    out[o]    = (((0 + t[0, o]) + t[1, o]) + ...)
    t[b, o]   = float32(dot[b, o]) * (d[b, o] * sx[b]) + m[b, o] * xs[b],     xs[b] = sx[b] * sum_{i in b} xq[i]

the float32 operations of quant.matmul_reference's W4A8 branch in its order, so the tile is bit-identical to it on
every instruction set. The nibbles are unsigned, the activations signed: exactly what the byte multiply-adds take,
no offset and no sign trick (compare kernels/int8_dot.py):

    avx512vnni, avxvnni   vpdpbusd(acc, q, x): u8 x s8, 4 products into each 32-bit lane
    avx2                  vpmaddubsw(q, x): u8 x s8, pairs into 16 bits: at most 2 x 15 x 128 = 3840, so the 8 steps
                          of a block (30720) add in 16 bits (vpaddw) and one vpmaddwd per block widens them: ~2 ops
                          per 32 multiply-adds where int8's sign trick takes 4
    neon                  sdot(acc, q, x): s8 x s8 (a nibble is a small signed byte too)
    generic               plain vector IR: bytes widened to int32, multiplied, added

Layout (kernels.matmul.pack_w4a8): for each block of 16 outputs, per input block of 32, 320 bytes: d[16] and m[16]
as float16 (64 bytes), then 4 pairs of 4-input steps, 64 bytes a pair: byte 4l + k holds step 2j's q[4(2j) + k, l] in
its low nibble and step 2j+1's in its high one (pack_vnni's byte order, two steps per byte). More layouts run
on the same tile (make_w4a8_tile's switches): Q4_0's blocks without m (symmetric: 288 bytes, m = -8 d formed from d,
exact); whole bytes (576 bytes, or 544 without m for Q8_0: m = -128 d; on avx2 the int8 tile's sign trick on
q - 128, with 128 times the block's activation sum added back: _sign_step); 5-bit values (Q5_0, Q5_1, Q5_K: the
nibbles as above, then a byte of fifth bits per 8 steps, q = nibble | bit << 4 formed in registers: 384 bytes, or
352 without m for Q5_0: m = -16 d), all with the arithmetic above; and Q6_K's own blocks (six_bits: q = its low nibble | its top 2 bits << 4, 0..63, and per half of 16 inputs
an int8 scale applied to that half's exact integer sum, then d per 256 inputs: no minimum, the offset 32 subtracted
as 32 times the half's activation sum). The float16 scales
become float32 with integer operations (magnitude << 13, times 2^112, sign put back: exact for every finite float16,
subnormals included), the same on every CPU.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.errors import TypingError
from numba.extending import intrinsic

from . import isa
from .int8_dot import IsaStep, _isa_step, add_to_out, for_each_block, unchanged
from .simd import _data_pointer

BLOCK = 16                      # outputs per packed block
GROUP = 32                      # inputs per Q4_1 block (one d, one m)
SCALE_BYTES = 2 * BLOCK * 2     # d[16] and m[16] as float16
GROUP_BYTES = SCALE_BYTES + GROUP * BLOCK // 2   # 320 bytes per (output block, input block)
BYTE_GROUP_BYTES = SCALE_BYTES + GROUP * BLOCK     # the byte tile's: 576 (whole bytes instead of nibbles)
SYM_SCALE_BYTES = BLOCK * 2     # the symmetric nibble tile keeps d[16] only: its m is -8 d
SYM_GROUP_BYTES = SYM_SCALE_BYTES + GROUP * BLOCK // 2   # 288 bytes: Q4_0's 18 bytes per 32 weights
MIN_PER_D = -8.0                # the symmetric tile's minimum per scale: Q4_0's w = d (q - 8) = d q + (-8 d)
SYM_BYTE_GROUP_BYTES = SYM_SCALE_BYTES + GROUP * BLOCK     # 544: the byte tile without m, Q8_0's 34 bytes per 32
BYTE_MIN_PER_D = -128.0         # its minimum per scale: Q8_0's w = d (q - 128) with q stored + 128
# The 5-bit tile (Q5_0, Q5_1, Q5_K): the low nibbles of q as pack_w4a8's (256 bytes), then their fifth bits (64
# bytes: bit s of byte 4l + k is step s's q[4s + k, l] >> 4), after d[16] and m[16] (384 bytes per 512 weights: 6
# bits a weight, Q5_1's) or d[16] only (352: 5.5 bits, Q5_0's, whose m is -16 d).
FIVE_BITS_BYTES = GROUP * BLOCK // 8                                        # 64
Q5_GROUP_BYTES = SCALE_BYTES + GROUP * BLOCK // 2 + FIVE_BITS_BYTES         # 384
SYM_Q5_GROUP_BYTES = SYM_SCALE_BYTES + GROUP * BLOCK // 2 + FIVE_BITS_BYTES  # 352
FIVE_MIN_PER_D = -16.0          # Q5_0's w = d (q - 16)
# The 6-bit tile (Q6_K): per block of 16 outputs and 32 inputs, sc[2][16] int8 (a scale per 16 inputs), the low
# nibbles of q as pack_w4a8's (256 bytes), then their top 2 bits (128 bytes: byte 4l + k of vector v holds steps
# 4v .. 4v + 3 at bits 0, 2, 4, 6); per 8 such blocks (Q6_K's super-block of 256 inputs) d[16] float16 first.
Q6_SC_BYTES = 2 * BLOCK
Q6_GROUP_BYTES = Q6_SC_BYTES + GROUP * BLOCK // 2 + GROUP * BLOCK // 4      # 416 bytes per 512 weights
Q6_SUPER = 8                                                                # blocks of 32 per super-block of 256
Q6_SUPER_BYTES = BLOCK * 2 + Q6_SUPER * Q6_GROUP_BYTES                      # 3360: 6.5625 bits a weight
Q6_OFFSET = 32                                                              # Q6_K's w = d sc (q - 32)
# Q6_K's values unpacked to whole bytes (a prefill's, matmul.six_bits_to_bytes): per block of 32 inputs sc[2][16],
# then the 8 steps' 64 bytes as pack_b8a8's; per super-block d[16] first, as pack_q6a8's
Q6B_GROUP_BYTES = Q6_SC_BYTES + GROUP * BLOCK                               # 544
Q6B_SUPER_BYTES = BLOCK * 2 + Q6_SUPER * Q6B_GROUP_BYTES                    # 4384
_I1, _I8, _I16, _I32 = ir.IntType(1), ir.IntType(8), ir.IntType(16), ir.IntType(32)
_F32 = ir.FloatType()


def _fn(builder, name, ret, args):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)


# beside a sub-tile's accumulators: a weight vector, its nibbles and the low-nibble mask (and 2 activation broadcasts
# per row, which _plan counts)
EXTRA_REGISTERS = 3


def _step(name: str, vb: int, whole_bytes: bool = False) -> IsaStep:
    """The W4A8 step of an instruction set (int8_dot.IsaStep's contract): w the nibbles as bytes (0..15), x the signed
    activation bytes, already broadcast (per_row passes them on). whole_bytes: w is 0..255 (the byte tile), which
    vpdpbusd and the plain loops take as they are; neon's sdot reads signed bytes, so there the step splits each
    byte into its nibbles (_split_step); avx2's vpmaddubsw would saturate its 16-bit pairs: make_w4a8_tile takes
    _sign_step there instead."""
    nl = vb // 4
    bytes_t, lanes_t = ir.VectorType(_I8, vb), ir.VectorType(_I32, nl)
    if whole_bytes and name in ("avx2", "neon"):
        return _split_step(name, vb)
    if name in ("avx512vnni", "avxvnni"):
        intr = "llvm.x86.avx512.vpdpbusd.512" if vb == 64 else "llvm.x86.avx512.vpdpbusd.256"

        def setup(builder):
            return _fn(builder, intr, lanes_t, [lanes_t, lanes_t, lanes_t])

        def step(builder, st, acc, q, x):
            return builder.call(st, [acc, builder.bitcast(q, lanes_t), builder.bitcast(x, lanes_t)])
        return IsaStep(lanes_t, EXTRA_REGISTERS, setup, unchanged, step, unchanged)
    if name == "avx2":
        s16_t = ir.VectorType(_I16, vb // 2)

        def setup(builder):
            return (_fn(builder, "llvm.x86.avx2.pmadd.ub.sw", s16_t, [bytes_t, bytes_t]),
                    _fn(builder, "llvm.x86.avx2.pmadd.wd", lanes_t, [s16_t, s16_t]),
                    ir.Constant(s16_t, [ir.Constant(_I16, 1)] * (vb // 2)))

        def step(builder, st, acc, q, x):
            return builder.add(acc, builder.call(st[0], [q, x]))        # 16-bit pair sums, no saturation (above)

        def finish(builder, st, acc):
            return builder.call(st[1], [acc, st[2]])                    # the pairs of each lane into 32 bits
        return IsaStep(s16_t, EXTRA_REGISTERS, setup, unchanged, step, finish)
    if name == "neon":
        def setup(builder):
            return _fn(builder, "llvm.aarch64.neon.sdot.v4i32.v16i8", lanes_t, [lanes_t, bytes_t, bytes_t])

        def step(builder, st, acc, q, x):
            return builder.call(st, [acc, q, x])
        return IsaStep(lanes_t, EXTRA_REGISTERS, setup, unchanged, step, unchanged)
    if name == "generic":
        wide_t = ir.VectorType(_I32, vb)

        def step(builder, st, acc, q, x):
            return builder.add(acc, builder.mul(builder.zext(q, wide_t), builder.sext(x, wide_t)))

        def finish(builder, st, acc):                                   # the 4 products of each lane, added
            k = [builder.shuffle_vector(acc, ir.Constant(wide_t, None),
                                        ir.Constant(lanes_t, [4 * lane + j for lane in range(nl)])) for j in range(4)]
            return builder.add(builder.add(k[0], k[1]), builder.add(k[2], k[3]))
        return IsaStep(wide_t, EXTRA_REGISTERS, lambda builder: None, unchanged, step, finish)
    raise ValueError(f"no W4A8 tile for {name!r}")


def _sign_step(vb: int) -> IsaStep:
    """avx2's byte tile step: q is w + 128 (0..255), the weight's own byte with its top bit flipped. Its product with
    x as it stands would saturate vpmaddubsw's 16-bit pairs (2 x 255 x 127 > 32767), so the step takes the int8 tile's
    sign trick (int8_dot.py, llama.cpp's mul_sum_i8_pairs) on w = q ^ 0x80 instead: |w| (u8, <= 128) times x with
    w's sign moved onto it (vpsignb; x is -127..127, so its negation fits), a pair at most 2 x 128 x 127 = 32512;
    then vpmaddwd by ones adds the pairs into 32 bits. That sums (q - 128) x; the tile adds 128 times the block's
    activation sum back (exact in int32), so the integer is dot(q, x) as every other instruction set forms it. 5 ops
    for 32 multiply-adds, where splitting q into nibbles took two multiply-adds, two masks and a shift."""
    int8 = _isa_step("avx2", vb)                  # the int8 tile's: its instructions (setup), its accumulator
    flip = ir.Constant(ir.VectorType(_I8, vb), [ir.Constant(_I8, -128)] * vb)

    def step(builder, st, acc, q, x):             # (w and |w| are the same for every row: LLVM forms them once)
        maddubs, maddwd, psign, abs_, ones = st
        w = builder.xor(q, flip)
        pairs = builder.call(maddubs, [builder.call(abs_, [w, ir.Constant(_I1, 0)]), builder.call(psign, [x, w])])
        return builder.add(acc, builder.call(maddwd, [pairs, ones]))
    return IsaStep(int8.acc_type, EXTRA_REGISTERS + 1, int8.setup, unchanged, step, unchanged)


def _split_step(name: str, vb: int) -> IsaStep:
    """The byte tile's step where the instruction set multiplies only small unsigned (avx2) or signed (neon) bytes:
    q = 16 hi + lo, so dot(q, x) = 16 dot(hi, x) + dot(lo, x), each nibble's dot taken as the W4A8 step takes it
    (in the same bounds). Its accumulator is the two nibbles' side by side: the low half the low nibbles'."""
    nl = vb // 4
    bytes_t, lanes_t = ir.VectorType(_I8, vb), ir.VectorType(_I32, nl)
    low = ir.Constant(bytes_t, [ir.Constant(_I8, 0x0F)] * vb)
    four = ir.Constant(bytes_t, [ir.Constant(_I8, 4)] * vb)
    half = _step(name, vb)                                  # the nibble step: its accumulator, its finish

    def halves(builder, acc):                               # the accumulator's low and high nibbles' halves
        n = half.acc_type.count
        return [builder.shuffle_vector(acc, ir.Constant(acc.type, None),
                                       ir.Constant(ir.VectorType(_I32, n), list(range(k * n, (k + 1) * n))))
                for k in (0, 1)]

    def step(builder, st, acc, q, x):
        lo, hi = halves(builder, acc)
        lo = half.step(builder, st, lo, builder.and_(q, low), x)
        hi = half.step(builder, st, hi, builder.and_(builder.lshr(q, four), low), x)
        n = half.acc_type.count
        return builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_I32, 2 * n), list(range(2 * n))))

    def finish(builder, st, acc):
        lo, hi = (half.finish(builder, st, a) for a in halves(builder, acc))
        return builder.add(lo, builder.shl(hi, ir.Constant(lanes_t, [ir.Constant(_I32, 4)] * nl)))
    wide_t = ir.VectorType(half.acc_type.element, 2 * half.acc_type.count)
    return IsaStep(wide_t, EXTRA_REGISTERS + 2, half.setup, half.per_row, step, finish)


def _opaque(builder, value):
    """value, hidden from LLVM's optimiser behind an empty inline assembly (no instruction is emitted, on any CPU).
    The tile's loop over a block's 4 pairs of steps gets this as its trip count: a loop of a known 4 trips is
    unrolled, and its scheduler then issues every load of the block first and spills what it loaded to the stack
    (hundreds of stack accesses in the 4 x 4 avx2 tile); kept a loop, each pair's values live one pair long, and the
    tile runs faster (docs/performance.md, "A loop the compiler knows too well")."""
    return builder.asm(ir.FunctionType(value.type, [value.type]), "", "=r,0", [value], False)


def _half_to_float(builder, h, nl, native: bool):
    """<nl x i16> float16 bits -> <nl x float>, exact for every finite value: one instruction where the CPU converts
    float16 (x86's F16C, which every AVX2 CPU has; arm64's fcvtl), else integer operations (generic)."""
    i32_t, f_t = ir.VectorType(_I32, nl), ir.VectorType(_F32, nl)
    if native:
        return builder.fpext(builder.bitcast(h, ir.VectorType(ir.HalfType(), nl)), f_t)
    c = lambda v: ir.Constant(i32_t, [ir.Constant(_I32, v)] * nl)      # noqa: E731
    w = builder.zext(h, i32_t)
    mag = builder.bitcast(builder.shl(builder.and_(w, c(0x7FFF)), c(13)), f_t)     # exponent 15 too low ...
    mag = builder.fmul(mag, ir.Constant(f_t, [ir.Constant(_F32, 2.0 ** 112)] * nl))  # ... made good (exact)
    sign = builder.shl(builder.and_(w, c(0x8000)), c(16))
    return builder.bitcast(builder.or_(builder.bitcast(mag, i32_t), sign), f_t)


def _plan(R: int, C: int, v: int, regs: int, extra: int, rows_first: bool = False) -> tuple[int, int]:
    """The largest sub-tile (r, c) whose v*r*c accumulators (v registers a block of 16 outputs) + 2r activation
    broadcasts + `extra` (a weight vector, its nibbles, the mask) fit the `regs` registers; ties: the squarer one.
    rows_first: the most rows that fit, then the most columns: for weights that take many instructions to form
    (the 5-bit tile's), which a sub-tile forms once for all its rows."""
    fits = [(r, c) for r in range(1, R + 1) for c in range(1, C + 1) if v * r * c + 2 * r + extra <= regs]
    if rows_first:
        return max(fits or [(1, 1)])
    return max(fits or [(1, 1)], key=lambda rc: (rc[0] * rc[1], -abs(rc[0] - rc[1])))


def sixteen_bit_pairs(name: str, max_q: int) -> int:
    """How many pairs of 4-input steps avx2's 16-bit sums may add before they are widened, for weights 0..max_q (the
    activations' bytes are at most 128 in size): a pair of products per lane and step, 2 x max_q x 128 each, so
    32767 // (256 max_q) steps. 0 where not even one pair fits (whole bytes: the step is the sign trick instead,
    _sign_step). Other instruction sets sum into 32 bits: a block's 4 pairs at once, and they split only what
    their byte multiply cannot take (neon's signed bytes: whole bytes)."""
    if name == "avx2":
        return 32767 // (256 * max_q) // 2
    return GROUP // 8 if name != "neon" or max_q <= 127 else 0


def make_w4a8_tile(R: int, C: int, name: str | None = None, whole_bytes: bool = False, symmetric: bool = False,
                   six_bits: bool = False, five_bits: bool = False, min_per_d: float | None = None,
                   max_q: int | None = None):
    """An R x C W4A8 tile, or with whole_bytes the byte tile (weights 0..255, matmul.pack_b8a8's layout: 576 bytes per
    block of 16 outputs and 32 inputs, the 8 steps a byte each), or with symmetric the nibble tile without a minimum
    (matmul.pack_s4a8: 288 bytes, d[16] and no m, which the tile forms as d * MIN_PER_D: exact, a power of two, so
    the same float32 m, and the same bits, as the tile that reads m = -8 d from memory), or with six_bits the Q6_K
    tile (matmul.pack_q6a8: Q6_SUPER_BYTES per block of 16 outputs and 256 inputs; per block of 32 inputs the
    integer sum sc0 (dot0 - 32 S0) + sc1 (dot1 - 32 S1) over its two halves of 16, S_h the half's activation sum
    (xs: int32 [rows, 2 nb]), then float32(sum) * (d * sx): quant.matmul_reference_q6): tile(x, x_off, x_stride, w, w_off, w_stride, nb, sx,
    xs, s_off, s_stride, out, o_off, o_stride). x: the int8 activations' bytes (row r at byte x_off + r*x_stride; signed, not the + 128 of the
    other kinds' tiles: so a row's 4 bytes go from memory straight into the broadcast, which vpdpbusd takes as its
    memory operand, where a flip of the sign bits first cost a third of the inner loop's instructions; the caller
    converts them once per matmul: matmul._tile_inputs), w: pack_w4a8's bytes (block c
    at w_off + c*w_stride), nb input blocks of 32, sx / xs: float32 [rows, nb] (row r at s_off + r*s_stride; xs
    int32, the sums themselves, for the byte kinds, and the tile forms sx * float32(sum), the reference's product:
    avx2's sign trick needs the integers, _sign_step), out:
    float32 (row r, output block c at o_off + r*o_stride + 16c), overwritten.
    five_bits: the 5-bit tile (matmul.pack_q5a8: 384 bytes, the nibbles as pack_w4a8's then a byte of fifth bits
    per 8 steps; q = nibble | fifth bit << 4 formed in registers, then the byte tile's arithmetic). symmetric goes
    with whole_bytes or five_bits too: d[16] only, m formed as d * BYTE_MIN_PER_D (Q8_0, matmul.pack_s8a8: 544
    bytes) or d * FIVE_MIN_PER_D (Q5_0, matmul.pack_s5a8: 352 bytes), exact as the nibble tile's. min_per_d, with
    symmetric, sets that factor itself: the byte tile with FIVE_MIN_PER_D runs Q5_0's values unpacked to whole bytes
    (matmul's prefill of 5-bit matrices) with the 5-bit tile's arithmetic, so with its bits; six_bits with whole_bytes
    runs Q6_K's values unpacked to whole bytes (matmul.six_bits_to_bytes: Q6B_SUPER_BYTES per block of 16 outputs
    and 256 inputs) with the 6-bit tile's arithmetic. max_q: the largest
    weight value the tile will meet (default: the kind's, 15, 31, 63 or 255), which sets how often avx2's 16-bit
    sums are widened (sixteen_bit_pairs): the byte tile running 5-bit values takes 31, so it needs no nibble split."""
    name = isa.NAME if name is None else name
    vb = isa.VARIANTS[name].vector_bytes
    parts, nl = 64 // vb, vb // 4
    bytes_t, lanes_t, float_t = ir.VectorType(_I8, vb), ir.VectorType(_I32, nl), ir.VectorType(_F32, nl)
    half_t = ir.VectorType(_I16, nl)
    # q is 0..15, 0..31 (five_bits), 0..63 (six_bits) or whole bytes: on avx2 the 16-bit sums of the wider values
    # are widened every 2 pairs (0..31) or every pair (0..63) of a block's 4; whole bytes take the sign trick
    if max_q is None:
        max_q = 63 if six_bits else 31 if five_bits else 255 if whole_bytes else 15
    per_sum = sixteen_bit_pairs(name, max_q)
    signed_bytes = name == "avx2" and per_sum == 0      # whole bytes on avx2: the sign trick, on q - 128 (_sign_step)
    acc_t, extra, setup, per_row, step, finish = _sign_step(vb) if signed_bytes else _step(name, vb, per_sum == 0)
    per_sum = per_sum or GROUP // 8
    if name == "avx2" and (five_bits or six_bits) and not whole_bytes:  # 16 registers: keep two for the top bits'
        extra += 2                                      # vector and its shifted copy (as the split step's did)
    assert whole_bytes + five_bits <= 1 and six_bits + five_bits <= 1 and not (six_bits and symmetric), \
        "one tile at a time (six_bits with whole_bytes: Q6_K unpacked)"
    group_bytes = {(False, False): GROUP_BYTES, (False, True): SYM_GROUP_BYTES,
                   (True, False): BYTE_GROUP_BYTES, (True, True): SYM_BYTE_GROUP_BYTES}[whole_bytes, symmetric]
    group_bytes = ((Q6B_GROUP_BYTES if whole_bytes else Q6_GROUP_BYTES) if six_bits else
                   (SYM_Q5_GROUP_BYTES if symmetric else Q5_GROUP_BYTES) if five_bits else group_bytes)
    super_bytes = Q6B_SUPER_BYTES if whole_bytes else Q6_SUPER_BYTES      # (six_bits: a super-block's bytes)
    if min_per_d is None:
        min_per_d = BYTE_MIN_PER_D if whole_bytes else FIVE_MIN_PER_D if five_bits else MIN_PER_D
    scale_bytes = SYM_SCALE_BYTES if symmetric else Q6_SC_BYTES if six_bits else SCALE_BYTES
    one_bit = ir.Constant(bytes_t, [ir.Constant(_I8, 0x10)] * vb)     # the fifth bit's place in q
    # the lines a block's prefetch touches: every 64 bytes, and the last byte (288 is not a whole number of lines);
    # the 6-bit tile's from its super-block's d on (32 bytes before its first block)
    lines = sorted(set(range(-32 if six_bits else 0, group_bytes, 64)) | {group_bytes - 1})
    crumb_mask = ir.Constant(bytes_t, [ir.Constant(_I8, 3)] * vb)
    # live registers: the accumulators (a split step's are two registers wide), 2 activation broadcasts per row, one
    # weight vector and its nibbles, the mask
    acc_regs = 64 // vb * (acc_t.count * acc_t.element.width) // (8 * vb)
    # avx2's 5-bit tile forms each weight vector in about a dozen instructions and multiplies it in two per row:
    # in 16 registers the largest sub-tile is one row by 4 blocks, which forms every weight again for each row; two
    # rows by one block form it once for both (docs/sliding-window.md, "Two rows of the 5-bit tile")
    rs, cs = (1, 1) if name == "generic" else _plan(R, C, acc_regs, isa.VARIANTS[name].registers, extra,
                                                    rows_first=five_bits and name == "avx2")

    @intrinsic
    def tile(typingctx, x, x_off, x_stride, w, w_off, w_stride, nb, sx, xs, s_off, s_stride, out, o_off, o_stride):
        sig = types.void(x, x_off, x_stride, w, w_off, w_stride, nb, sx, xs, s_off, s_stride, out, o_off, o_stride)
        int_sums = isinstance(xs.dtype, types.Integer)  # xs: the blocks' activation sums themselves (int32), or
        if signed_bytes and not int_sums:               # times sx already (float32)
            raise TypingError("avx2's byte tile adds 128 x the activation sums back: it takes xs as int32 sums")

        def codegen(context, builder, signature, args):
            (x_arr, x_off, x_stride, w_arr, w_off, w_stride, nb, sx_arr, xs_arr, s_off, s_stride, out_arr, o_off,
             o_stride) = args
            ty = signature.args
            i64 = x_off.type
            k = lambda v: ir.Constant(i64, v)                                           # noqa: E731
            st = setup(builder)
            low = ir.Constant(bytes_t, [ir.Constant(_I8, 0x0F)] * vb)
            four = ir.Constant(bytes_t, [ir.Constant(_I8, 4)] * vb)
            prefetch = _fn(builder, "llvm.prefetch", ir.VoidType(), [_I8.as_pointer(), _I32, _I32, _I32])
            next_tile = builder.mul(w_stride, k(C))             # a weight line -> the same line of the next tile
            x_rows = [_data_pointer(context, builder, ty[0], x_arr, builder.add(x_off, builder.mul(x_stride, k(r))))
                      for r in range(R)]
            w_cols = [_data_pointer(context, builder, ty[3], w_arr, builder.add(w_off, builder.mul(w_stride, k(c))))
                      for c in range(C)]
            sx_base = cgutils.create_struct_proxy(ty[7])(context, builder, sx_arr).data
            xs_base = cgutils.create_struct_proxy(ty[8])(context, builder, xs_arr).data
            out_base = cgutils.create_struct_proxy(ty[11])(context, builder, out_arr).data
            s_rows = [builder.add(s_off, builder.mul(s_stride, k(r))) for r in range(R)]
            out_rows = [builder.gep(out_base, [builder.add(o_off, builder.mul(o_stride, k(r)))]) for r in range(R)]

            def load_bytes(c, off):
                return builder.load(builder.bitcast(builder.gep(w_cols[c], [off]), bytes_t.as_pointer()), align=1)

            def weights(j, c, p, base):                         # steps 2j and 2j + 1 of part p of block c: [(0,
                if six_bits and not whole_bytes:                # q), (1, q)], a vector each
                    v = load_bytes(c, builder.add(base, builder.add(builder.mul(j, k(64)), k(scale_bytes + vb * p))))
                    top = load_bytes(c, builder.add(base, builder.add(builder.mul(builder.lshr(j, k(1)), k(64)),
                                                                      k(scale_bytes + 256 + vb * p))))
                    shift = builder.trunc(builder.mul(builder.and_(j, k(1)), k(4)), _I8)   # steps 2j, 2j+1's bits
                    sv = builder.shuffle_vector(builder.insert_element(ir.Constant(bytes_t, None), shift,
                                                                       ir.Constant(_I32, 0)),
                                                ir.Constant(bytes_t, None), ir.Constant(ir.VectorType(_I32, vb), None))
                    top = builder.lshr(top, sv)
                    hi0 = builder.shl(builder.and_(top, crumb_mask), four)
                    hi1 = builder.shl(builder.and_(builder.lshr(top, ir.Constant(bytes_t, [ir.Constant(_I8, 2)] * vb)),
                                                   crumb_mask), four)
                    return [(0, builder.or_(builder.and_(v, low), hi0)), (1, builder.or_(builder.lshr(v, four), hi1))]
                if five_bits:                                   # pair j's steps' fifth bits: bits 2j, 2j + 1
                    v = load_bytes(c, builder.add(base, builder.add(builder.mul(j, k(64)), k(scale_bytes + vb * p))))
                    top = load_bytes(c, builder.add(base, k(scale_bytes + GROUP * BLOCK // 2 + vb * p)))
                    shift = builder.trunc(builder.add(j, j), _I8)
                    sv = builder.shuffle_vector(builder.insert_element(ir.Constant(bytes_t, None), shift,
                                                                       ir.Constant(_I32, 0)),
                                                ir.Constant(bytes_t, None), ir.Constant(ir.VectorType(_I32, vb), None))
                    top = builder.lshr(top, sv)
                    hi0 = builder.and_(builder.shl(top, four), one_bit)
                    hi1 = builder.and_(builder.shl(top, ir.Constant(bytes_t, [ir.Constant(_I8, 3)] * vb)), one_bit)
                    return [(0, builder.or_(builder.and_(v, low), hi0)), (1, builder.or_(builder.lshr(v, four), hi1))]
                if whole_bytes:
                    return [(half, load_bytes(c, builder.add(base, builder.add(
                        builder.mul(j, k(128)), k(scale_bytes + 64 * half + vb * p))))) for half in (0, 1)]
                v = load_bytes(c, builder.add(base, builder.add(builder.mul(j, k(64)), k(scale_bytes + vb * p))))
                return [(0, builder.and_(v, low)), (1, builder.and_(builder.lshr(v, four), low))]

            def bcast(value):                                   # one float in every lane
                one = builder.insert_element(ir.Constant(float_t, None), value, ir.Constant(_I32, 0))
                return builder.shuffle_vector(one, ir.Constant(float_t, None), ir.Constant(lanes_t, None))

            def ibcast(value):                                  # one int32 in every lane
                one = builder.insert_element(ir.Constant(lanes_t, None), value, ir.Constant(_I32, 0))
                return builder.shuffle_vector(one, ir.Constant(lanes_t, None), ir.Constant(lanes_t, None))

            for c0 in range(0, C, cs):                          # one pass over the input per sub-tile
                for r0 in range(0, R, rs):
                    sub_r, sub_c = range(r0, min(R, r0 + rs)), range(c0, min(C, c0 + cs))

                    def pair_loop(b, base, keys, first_pair, n_pairs):   # the pairs' multiply-adds -> sums
                        zero = ir.Constant(acc_t, [ir.Constant(acc_t.element, 0)] * acc_t.count)
                        slot = {key: cgutils.alloca_once_value(builder, zero) for key in keys}  # (LLVM: registers)
                        with cgutils.for_range(builder, _opaque(builder, k(n_pairs))) as pairs:  # see _opaque
                            j = builder.add(pairs.index, k(first_pair))   # the pair of 4-input steps 2j, 2j + 1
                            acc = {key: builder.load(slot[key]) for key in keys}
                            xv = {}                             # each row's 4 bytes of steps 2j and 2j + 1
                            for r in sub_r:
                                for half in (0, 1):
                                    i = builder.add(builder.mul(b, k(GROUP // 4)), builder.add(builder.add(j, j),
                                                                                               k(half)))
                                    x4 = builder.load(builder.bitcast(builder.gep(x_rows[r], [builder.mul(i, k(4))]),
                                                                      _I32.as_pointer()), align=1)
                                    one = builder.insert_element(ir.Constant(lanes_t, None), x4, ir.Constant(_I32, 0))
                                    xv[r, half] = per_row(builder, st, builder.bitcast(builder.shuffle_vector(
                                        one, ir.Constant(lanes_t, None), ir.Constant(lanes_t, None)), bytes_t))
                            for c in sub_c:                     # one weight vector at a time: unpacked, used, gone
                                for p in range(parts):
                                    for half, qv in weights(j, c, p, base):
                                        for r in sub_r:
                                            acc[r, c, p] = step(builder, st, acc[r, c, p], qv, xv[r, half])
                            for key in keys:
                                builder.store(acc[key], slot[key])
                        return {key: builder.load(slot[key]) for key in keys}

                    def block_sums(b, base, keys, first_pair, n_pairs):  # the pairs' exact sums, in 32-bit lanes
                        sums = {}
                        for p0 in range(first_pair, first_pair + n_pairs, per_sum):
                            acc = pair_loop(b, base, keys, p0, min(per_sum, first_pair + n_pairs - p0))
                            for key in keys:
                                v = finish(builder, st, acc[key])
                                sums[key] = builder.add(sums[key], v) if key in sums else v
                        return sums

                    def block_base(b):                          # block b's first byte within its output block
                        if not six_bits:
                            return builder.mul(b, k(group_bytes))
                        sup = builder.udiv(b, k(Q6_SUPER))
                        return builder.add(builder.mul(sup, k(super_bytes)), builder.add(
                            k(2 * BLOCK), builder.mul(builder.urem(b, k(Q6_SUPER)), k(group_bytes))))

                    def one_block(b, first):                    # input block b (first: b == 0, an i1)
                        base = block_base(b)
                        if r0 == 0:                             # the next tile's lines of this block, into L2
                            for c in sub_c:
                                for line in lines:
                                    ahead = builder.gep(w_cols[c], [builder.add(base, builder.add(next_tile, k(line)))])
                                    builder.call(prefetch, [ahead] + [ir.Constant(_I32, a) for a in (0, 2, 1)])
                        keys = [(r, c, p) for r in sub_r for c in sub_c for p in range(parts)]
                        if six_bits:
                            six_bit_block(b, first, base, keys)
                            return
                        acc = block_sums(b, base, keys, 0, GROUP // 8)
                        for c in sub_c:                                     # the block's scales, as float32
                            dm = {}
                            for p in range(parts):
                                for which in ((0,) if symmetric else (0, 1)):    # d, then m
                                    off = builder.add(base, k(which * 2 * BLOCK + 2 * nl * p))
                                    h = builder.load(builder.bitcast(builder.gep(w_cols[c], [off]),
                                                                     half_t.as_pointer()), align=1)
                                    dm[p, which] = _half_to_float(builder, h, nl, name != "generic")
                                if symmetric:                       # m = -8 d (-128 d, -16 d), exact in float32
                                    dm[p, 1] = builder.fmul(dm[p, 0], ir.Constant(float_t, [ir.Constant(
                                        _F32, min_per_d)] * nl))
                            for r in sub_r:
                                s_at = builder.add(s_rows[r], b)
                                s = builder.load(builder.gep(sx_base, [s_at]))
                                xs = builder.load(builder.gep(xs_base, [s_at]))
                                sxv = bcast(s)
                                xsv = bcast(builder.fmul(s, builder.sitofp(xs, _F32)) if int_sums else xs)
                                back = ibcast(builder.shl(xs, ir.Constant(_I32, 7))) if signed_bytes else None
                                for p in range(parts):          # (signed_bytes: dot(q - 128, x) + 128 x the sum)
                                    dot = builder.add(acc[r, c, p], back) if signed_bytes else acc[r, c, p]
                                    dot = builder.sitofp(dot, float_t)
                                    t = builder.fadd(builder.fmul(dot, builder.fmul(dm[p, 0], sxv)),
                                                     builder.fmul(dm[p, 1], xsv))
                                    add_to_out(builder, out_rows[r], k(BLOCK * c + nl * p), t, first)

                    def six_bit_block(b, first, base, keys):    # Q6_K: each half of 16 inputs by its own scale
                        total = {}
                        for h in (0, 1):                        # steps 0-3, then 4-7: one loop of 2 pairs each
                            acc = block_sums(b, base, keys, 2 * h, GROUP // 16)
                            for c in sub_c:
                                sc = {p: builder.sext(builder.load(builder.bitcast(builder.gep(
                                    w_cols[c], [builder.add(base, k(h * BLOCK + nl * p))]),
                                    ir.VectorType(_I8, nl).as_pointer()), align=1), lanes_t) for p in range(parts)}
                                for r in sub_r:                 # the half's sum of the row's activations, x 32
                                    s_at = builder.add(builder.mul(builder.add(s_rows[r], b), k(2)), k(h))
                                    off = ibcast(builder.shl(builder.load(builder.gep(xs_base, [s_at])),
                                                             ir.Constant(_I32, 5)))
                                    for p in range(parts):
                                        v = builder.mul(sc[p], builder.sub(acc[r, c, p], off))
                                        total[r, c, p] = v if h == 0 else builder.add(total[r, c, p], v)
                        d_at = builder.sub(base, builder.add(k(2 * BLOCK), builder.mul(
                            builder.urem(b, k(Q6_SUPER)), k(group_bytes))))  # the super-block's d[16]
                        for c in sub_c:
                            dv = {p: _half_to_float(builder, builder.load(builder.bitcast(builder.gep(
                                w_cols[c], [builder.add(d_at, k(2 * nl * p))]), half_t.as_pointer()), align=1), nl,
                                name != "generic") for p in range(parts)}
                            for r in sub_r:
                                sxv = bcast(builder.load(builder.gep(sx_base, [builder.add(s_rows[r], b)])))
                                for p in range(parts):
                                    t = builder.fmul(builder.sitofp(total[r, c, p], float_t), builder.fmul(dv[p], sxv))
                                    add_to_out(builder, out_rows[r], k(BLOCK * c + nl * p), t, first)

                    for_each_block(builder, nb, one_block)
            return context.get_dummy_value()

        return sig, codegen

    return tile
