"""One machine instruction that LLVM will not write for us: VNNI's u8 x s8 dot product (`vpdpbusd`).

An int8 matmul is a pile of multiply-adds of bytes. AVX-512 VNNI (Intel since Cascade Lake, AMD since Zen 4) has
an instruction that does 64 of them at once: for each of 16 int32 lanes,

    acc[l] += a[4l]*b[4l] + a[4l+1]*b[4l+1] + a[4l+2]*b[4l+2] + a[4l+3]*b[4l+3]     a: uint8, b: int8

From plain Numba loops LLVM emits at best `vpmaddwd`/`vpdpwssd` (16-bit pairs: half the work per instruction,
plus the widening shuffles), never this one (perf-notes). So we emit it ourselves: `make_microkernel(R, C)` builds
a Numba *intrinsic* (a function whose body is LLVM IR) that computes an R x (16*C) tile of int32 dot products over
the whole input dimension, with the R*C accumulators living in vector registers for the whole loop:

    for i in range(D // 4):                         # 4 input channels per step
        w_c = the 64 bytes of W_packed[block c, i]  # 16 outputs x 4 inputs, one load per column block
        for r in range(R):
            x_r = x[row r, 4i:4i+4] broadcast to all 16 lanes
            for c in range(C):
                acc[r, c] = vpdpbusd(acc[r, c], x_r, w_c)

Each weight load serves R rows (the reuse that makes prefill compute-bound instead of memory-bound), each
activation broadcast serves C column blocks. R*C accumulators + C weight vectors must fit the 32 zmm registers.

The weights must be packed so that one 64-byte load holds 16 outputs x 4 consecutive inputs (see
`kernels.matmul.pack_vnni`), and the activations must be unsigned: kernels.matmul adds 128 to the int8
activations and subtracts 128 * sum(w) afterwards, which is exact in integers.

Everything here is integer arithmetic: the result is bit-identical to NumPy's int64 matmul of the same numbers.
Where the CPU lacks avx512vnni, `HAVE_VNNI` is False and kernels.matmul uses a plain Numba loop instead (same
layout, same exact results, slower).
"""
from __future__ import annotations

import os

import llvmlite.binding as llvm
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

# TINYSERVE_PORTABLE_KERNELS=1 takes the plain tiles even on a VNNI CPU (the test of that path does; give such a
# process a NUMBA_CACHE_DIR of its own: Numba's on-disk cache does not know which tile a kernel was built with)
HAVE_VNNI = ("+avx512vnni" in llvm.get_host_cpu_features().flatten().split(",")
             and os.environ.get("TINYSERVE_PORTABLE_KERNELS", "0") in ("", "0"))

_I8, _I32 = ir.IntType(8), ir.IntType(32)
_V16 = ir.VectorType(_I32, 16)     # one zmm register as 16 int32 lanes (or 64 bytes)


def _data_pointer(context, builder, array_type, array, byte_offset):
    """i8* to byte `byte_offset` of a C-contiguous 1-byte (uint8/int8) or int32 array's data."""
    data = cgutils.create_struct_proxy(array_type)(context, builder, array).data
    return builder.gep(builder.bitcast(data, _I8.as_pointer()), [byte_offset])


def _broadcast(builder, scalar, vec_type):
    """One 32-bit value in all 16 lanes (vpbroadcastd / vbroadcastss)."""
    one = builder.insert_element(ir.Constant(vec_type, None), scalar, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, ir.Constant(vec_type, None), ir.Constant(_V16, None))


def _store_tile(builder, acc, R, C, out_base, o_off, o_stride, vec_type):
    """The R x C accumulators to memory: row r of the tile at o_off + r*o_stride, block c 16 elements further."""
    for r in range(R):
        row = builder.add(o_off, builder.mul(o_stride, ir.Constant(o_off.type, r)))
        for c in range(C):
            p = builder.gep(out_base, [builder.add(row, ir.Constant(row.type, 16 * c))])
            builder.store(builder.load(acc[r * C + c]), builder.bitcast(p, vec_type.as_pointer()), align=4)


def make_microkernel(R: int, C: int):
    """An intrinsic `tile(x, x_off, x_stride, w, w_off, w_stride, n4, out, o_off, o_stride)`:

        out[r, c*16 + l] = sum_{i < 4*n4} x[x_off + r*x_stride + i] * W[c, l, i]      (int32, overwritten)

    x: uint8 1-d (activations, row r of the tile starts at x_off + r*x_stride), w: int8 1-d packed weights
    (column block c starts at w_off + c*w_stride; step i of it at + 64*i), out: int32 1-d (row r of the tile at
    o_off + r*o_stride). All offsets in elements.
    """
    assert R * C + C <= 32, "the accumulators and weight vectors must fit in the 32 vector registers"

    @intrinsic
    def tile(typingctx, x, x_off, x_stride, w, w_off, w_stride, n4, out, o_off, o_stride):
        sig = types.void(x, x_off, x_stride, w, w_off, w_stride, n4, out, o_off, o_stride)

        def codegen(context, builder, signature, args):
            x_arr, x_off, x_stride, w_arr, w_off, w_stride, n4, out_arr, o_off, o_stride = args
            ty = signature.args
            vpdpbusd = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16, [_V16, _V16, _V16]),
                                                      "llvm.x86.avx512.vpdpbusd.512")
            # allocas in the entry block: LLVM's mem2reg turns them into registers
            acc = [cgutils.alloca_once_value(builder, ir.Constant(_V16, None)) for _ in range(R * C)]
            x_rows = [_data_pointer(context, builder, ty[0], x_arr,
                                    builder.add(x_off, builder.mul(x_stride, ir.Constant(x_off.type, r))))
                      for r in range(R)]
            w_cols = [_data_pointer(context, builder, ty[3], w_arr,
                                    builder.add(w_off, builder.mul(w_stride, ir.Constant(w_off.type, c))))
                      for c in range(C)]
            with cgutils.for_range(builder, n4) as loop:
                i = loop.index
                w_vec = [builder.load(builder.bitcast(builder.gep(w_cols[c], [builder.mul(i, ir.Constant(i.type, 64))]),
                                                      _V16.as_pointer()), align=1) for c in range(C)]
                for r in range(R):
                    x4 = builder.load(builder.bitcast(builder.gep(x_rows[r], [builder.mul(i, ir.Constant(i.type, 4))]),
                                                      _I32.as_pointer()), align=1)        # 4 bytes as one i32
                    x_vec = _broadcast(builder, x4, _V16)
                    for c in range(C):
                        a = acc[r * C + c]
                        builder.store(builder.call(vpdpbusd, [builder.load(a), x_vec, w_vec[c]]), a)
            out_base = cgutils.create_struct_proxy(ty[7])(context, builder, out_arr).data     # int32*
            _store_tile(builder, acc, R, C, out_base, o_off, o_stride, _V16)
            return context.get_dummy_value()

        return sig, codegen

    return tile


_F32 = ir.FloatType()  # noqa: E305
_VF16 = ir.VectorType(_F32, 16)
_V16I8 = ir.VectorType(_I8, 16)


def make_fma_microkernel(R: int, C: int, b_int8: bool):
    """The float twin of make_microkernel: out[r, c*16 + l] = sum_i x[r, i] * B[c, i, l] (float32, overwritten).

    b_int8=True: B is int8 weights packed [O/16, D, 16] (kernels.matmul.pack_w8a32), each 16 bytes widened to 16
    floats (vpmovsxbd + vcvtdq2ps) before the multiply-add: the W8A32 matmul. b_int8=False: B is float32 and
    "block c, step i" is at w_off + c*w_stride + i*b_step (elements): attention's Q K^T and P V tiles.
    Each output lane sums its products in order i = 0, 1, ... with one rounding per step (`llvm.fma`); BLAS sums in
    another order, so results agree with NumPy to ~1e-6 relative, not bit for bit.
    """
    assert R * C + C <= 32, "the accumulators and weight vectors must fit in the 32 vector registers"

    @intrinsic
    def tile(typingctx, x, x_off, x_stride, w, w_off, w_stride, n, b_step, out, o_off, o_stride):
        sig = types.void(x, x_off, x_stride, w, w_off, w_stride, n, b_step, out, o_off, o_stride)

        def codegen(context, builder, signature, args):
            x_arr, x_off, x_stride, w_arr, w_off, w_stride, n, b_step, out_arr, o_off, o_stride = args
            ty = signature.args
            fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VF16, [_VF16, _VF16, _VF16]),
                                                 "llvm.fma.v16f32")
            acc = [cgutils.alloca_once_value(builder, ir.Constant(_VF16, None)) for _ in range(R * C)]
            x_base = cgutils.create_struct_proxy(ty[0])(context, builder, x_arr).data            # float*
            x_rows = [builder.gep(x_base, [builder.add(x_off, builder.mul(x_stride, ir.Constant(x_off.type, r)))])
                      for r in range(R)]
            w_base = cgutils.create_struct_proxy(ty[3])(context, builder, w_arr).data            # int8* or float*
            w_cols = [builder.gep(w_base, [builder.add(w_off, builder.mul(w_stride, ir.Constant(w_off.type, c)))])
                      for c in range(C)]
            with cgutils.for_range(builder, n) as loop:
                i = loop.index
                w_vec = []
                for c in range(C):
                    p = builder.gep(w_cols[c], [builder.mul(i, b_step)])
                    if b_int8:
                        raw = builder.load(builder.bitcast(p, _V16I8.as_pointer()), align=1)
                        w_vec.append(builder.sitofp(builder.sext(raw, _V16), _VF16))
                    else:
                        w_vec.append(builder.load(builder.bitcast(p, _VF16.as_pointer()), align=4))
                for r in range(R):
                    xi = builder.load(builder.gep(x_rows[r], [i]))
                    x_vec = _broadcast(builder, xi, _VF16)
                    for c in range(C):
                        a = acc[r * C + c]
                        builder.store(builder.call(fma, [x_vec, w_vec[c], builder.load(a)]), a)
            out_base = cgutils.create_struct_proxy(ty[8])(context, builder, out_arr).data      # float*
            _store_tile(builder, acc, R, C, out_base, o_off, o_stride, _VF16)
            return context.get_dummy_value()

        return sig, codegen

    return tile


# Two more things LLVM does in zero instructions but Numba cannot say: read a float32's bits as an int32 and back
# (C's memcpy / a union). Attention's softmax uses them to build 2^k for its exp, and to take a row's max with
# integer compares, which LLVM vectorises (it leaves a float max reduction scalar: a NaN could hide in one).

@intrinsic
def float_bits(typingctx, x):
    """The IEEE-754 bits of a float32, as an int32."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], _I32)
    return types.int32(types.float32), codegen


@intrinsic
def bits_float(typingctx, i):
    """The float32 whose bits are the int32 i."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], _F32)
    return types.float32(types.int32), codegen
