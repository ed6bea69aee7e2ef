"""LLVM types and constants for Cuvil dtypes (llvmlite), shared by the x86 and PTX backends."""
from __future__ import annotations

import llvmlite.ir as ir
import numpy as np

from ...errors import CuvilError
from ...ir.dtype import DType

I1, I8, I32, I64 = ir.IntType(1), ir.IntType(8), ir.IntType(32), ir.IntType(64)
F16, F32, F64 = ir.HalfType(), ir.FloatType(), ir.DoubleType()
PTR = ir.PointerType()
_LL = {DType.FLOAT: F32, DType.DOUBLE: F64, DType.FLOAT16: F16, DType.INT8: I8, DType.UINT8: I8,
       DType.INT16: ir.IntType(16), DType.UINT16: ir.IntType(16), DType.INT32: I32, DType.UINT32: I32,
       DType.INT64: I64, DType.UINT64: I64, DType.BOOL: I1,
       # narrow types (targets/llvm/narrow.py): bfloat16 computes in float32; float8/float4 are bit patterns;
       # 2- and 4-bit integers compute as 8-bit ones
       DType.BFLOAT16: F32, DType.FLOAT8E4M3FN: I8, DType.FLOAT8E4M3FNUZ: I8, DType.FLOAT8E5M2: I8,
       DType.FLOAT8E5M2FNUZ: I8, DType.FLOAT4E2M1: I8, DType.FLOAT8E8M0: I8, DType.INT4: I8, DType.UINT4: I8, DType.INT2: I8, DType.UINT2: I8}
UNSIGNED = {DType.UINT8, DType.UINT16, DType.UINT32, DType.UINT64, DType.BOOL, DType.UINT4,   # zero-extended,
            DType.UINT2}                                                                   # unsigned compares


def ll(dt: DType) -> ir.Type:
    """The LLVM type a value of ``dt`` is computed in (bool: i1)."""
    try:
        return _LL[dt]
    except KeyError:
        raise CuvilError(f"dtype {dt.name} is not supported by the x86 and PTX code generators") from None


def mem_type(dt: DType) -> ir.Type:
    """The LLVM type a value of ``dt`` is stored as in memory (bool: one byte; bfloat16: its 16 bits)."""
    if dt == DType.BOOL:
        return I8
    if dt == DType.BFLOAT16:
        return ir.IntType(16)
    return ll(dt)


def float_bits(dt: DType) -> int:
    return {DType.FLOAT16: 16, DType.FLOAT: 32, DType.DOUBLE: 64}[dt]


def const_value(v, dt: DType) -> ir.Constant:
    """``v`` as an LLVM constant of ``dt`` (floats rounded to ``dt`` first, integers wrapped to its width)."""
    t = ll(dt)
    if dt == DType.BOOL:
        return ir.Constant(I1, int(bool(v)))
    if dt.is_float:
        return ir.Constant(t, float(np.asarray(v, dt.numpy)))
    if dt.is_minifloat:   # its bit pattern
        return ir.Constant(t, int(np.asarray(v, dt.numpy).reshape(1).view(np.uint8)[0]))
    iv = int(v)
    bits = t.width
    iv &= (1 << bits) - 1
    if iv >= 1 << (bits - 1):
        iv -= 1 << bits
    return ir.Constant(t, iv)


def splat(b: ir.IRBuilder, x: ir.Value, n: int) -> ir.Value:
    """``x`` in every lane of an ``n``-lane vector."""
    t = ir.VectorType(x.type, n)
    return b.shuffle_vector(b.insert_element(ir.Constant(t, ir.Undefined), x, I32(0)), ir.Constant(t, ir.Undefined),
                            ir.Constant(ir.VectorType(I32, n), [0] * n))
