"""What LLVM does in a few instructions but Numba cannot say: register-tiled microkernels and bit casts, as LLVM IR.

A Numba *intrinsic* is a function whose body we write as LLVM IR. Two kinds live here:
- `make_fma_microkernel(R, C)`: an R x (16*C) tile of float32 dot products over the whole input, the R*C
  accumulators in vector registers for the whole loop (`llvm.fma` on 16-lane vectors: one zmm on AVX-512, two ymm
  on AVX2, four q registers on NEON; LLVM splits the vector for the CPU). Each weight load serves R rows (the reuse
  that makes prefill compute-bound instead of memory-bound), each activation broadcast serves C column blocks.
  W8A32 (int8 weights widened on the fly) and attention's Q K^T and P V use it.
- bit casts between float32 and int32 (fast_exp's 2^k, integer max over float bits);
- `prefetch_l2`: a software prefetch (the fused decode step asks for attention's K/V rows ahead of time).
The int8 dot product of each instruction set is in kernels/int8_dot.py; which set, in kernels/isa.py.

    for i in range(D):                              # one input channel per step
        w_c = 16 weights of column block c, step i  # one load per column block
        for r in range(R):
            x_r = x[row r, i] broadcast to all 16 lanes
            for c in range(C):
                acc[r, c] = fma(x_r, w_c, acc[r, c])
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from . import isa

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


_F32 = ir.FloatType()  # noqa: E305
_VF16 = ir.VectorType(_F32, 16)
_V16I8 = ir.VectorType(_I8, 16)


def make_fma_microkernel(R: int, C: int, b_int8: bool):
    """out[r, c*16 + l] = sum_i x[r, i] * B[c, i, l] (float32, overwritten): an R x 16C tile.

    b_int8=True: B is int8 weights packed [O/16, D, 16] (kernels.matmul.pack_w8a32), each 16 bytes widened to 16
    floats (vpmovsxbd + vcvtdq2ps) before the multiply-add: the W8A32 matmul. b_int8=False: B is float32 and
    "block c, step i" is at w_off + c*w_stride + i*b_step (elements): attention's Q K^T and P V tiles.
    Each output lane sums its products in order i = 0, 1, ... with one rounding per step (`llvm.fma`); BLAS sums in
    another order, so results agree with NumPy to ~1e-6 relative, not bit for bit. Where R x C accumulators do not
    fit the register file, the tile runs as sub-tiles (isa.plan_subtiles), one pass over the input each: every
    output still sums the same products in the same order, so the result is the same on every instruction set.
    """
    rs, cs = isa.plan_subtiles(R, C, extra=2 if b_int8 else 1)    # + the broadcast (and the widened weights)

    @intrinsic
    def tile(typingctx, x, x_off, x_stride, w, w_off, w_stride, n, b_step, out, o_off, o_stride):
        sig = types.void(x, x_off, x_stride, w, w_off, w_stride, n, b_step, out, o_off, o_stride)

        def codegen(context, builder, signature, args):
            x_arr, x_off, x_stride, w_arr, w_off, w_stride, n, b_step, out_arr, o_off, o_stride = args
            ty = signature.args
            fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VF16, [_VF16, _VF16, _VF16]),
                                                 "llvm.fma.v16f32")
            x_base = cgutils.create_struct_proxy(ty[0])(context, builder, x_arr).data            # float*
            x_rows = [builder.gep(x_base, [builder.add(x_off, builder.mul(x_stride, ir.Constant(x_off.type, r)))])
                      for r in range(R)]
            w_base = cgutils.create_struct_proxy(ty[3])(context, builder, w_arr).data            # int8* or float*
            w_cols = [builder.gep(w_base, [builder.add(w_off, builder.mul(w_stride, ir.Constant(w_off.type, c)))])
                      for c in range(C)]
            out_base = cgutils.create_struct_proxy(ty[8])(context, builder, out_arr).data      # float*
            for c0 in range(0, C, cs):                       # one pass over the input per sub-tile
                for r0 in range(0, R, rs):
                    sub_r, sub_c = range(r0, min(R, r0 + rs)), range(c0, min(C, c0 + cs))
                    acc = {(r, c): cgutils.alloca_once_value(builder, ir.Constant(_VF16, None))
                           for r in sub_r for c in sub_c}
                    with cgutils.for_range(builder, n) as loop:
                        i = loop.index
                        w_vec = {}
                        for c in sub_c:
                            p = builder.gep(w_cols[c], [builder.mul(i, b_step)])
                            if b_int8:
                                raw = builder.load(builder.bitcast(p, _V16I8.as_pointer()), align=1)
                                w_vec[c] = builder.sitofp(builder.sext(raw, _V16), _VF16)
                            else:
                                w_vec[c] = builder.load(builder.bitcast(p, _VF16.as_pointer()), align=4)
                        for r in sub_r:
                            x_vec = _broadcast(builder, builder.load(builder.gep(x_rows[r], [i])), _VF16)
                            for c in sub_c:
                                a = acc[r, c]
                                builder.store(builder.call(fma, [x_vec, w_vec[c], builder.load(a)]), a)
                    for r in sub_r:
                        row = builder.add(o_off, builder.mul(o_stride, ir.Constant(o_off.type, r)))
                        for c in sub_c:
                            q = builder.gep(out_base, [builder.add(row, ir.Constant(row.type, 16 * c))])
                            builder.store(builder.load(acc[r, c]), builder.bitcast(q, _VF16.as_pointer()), align=4)
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


@intrinsic
def prefetch_l2(typingctx, array, index):
    """A hint: bring the cache line that holds array.flat[index] (a C-contiguous array) into L2 (x86 prefetcht1,
    arm64 prfm pldl2keep; nothing where LLVM knows no prefetch). Never faults, whatever the address."""
    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        p = builder.bitcast(builder.gep(ary.data, [args[1]]), _I8.as_pointer())
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [_I8.as_pointer(), _I32, _I32, _I32]), "llvm.prefetch")
        builder.call(fn, [p] + [ir.Constant(_I32, a) for a in (0, 2, 1)])    # read, locality 2 (L2), data
        return context.get_dummy_value()
    return types.void(array, types.intp), codegen
