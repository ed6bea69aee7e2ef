"""Element types, numbered as ONNX's ``TensorProto.DataType`` so the C ABI can use the same codes."""
from __future__ import annotations

import enum

import ml_dtypes
import numpy as np

from ..errors import UnsupportedTypeError


class DType(enum.IntEnum):
    FLOAT = 1
    UINT8 = 2
    INT8 = 3
    UINT16 = 4
    INT16 = 5
    INT32 = 6
    INT64 = 7
    STRING = 8
    BOOL = 9
    FLOAT16 = 10
    DOUBLE = 11
    UINT32 = 12
    UINT64 = 13
    COMPLEX64 = 14
    COMPLEX128 = 15
    BFLOAT16 = 16
    FLOAT8E4M3FN = 17
    FLOAT8E4M3FNUZ = 18
    FLOAT8E5M2 = 19
    FLOAT8E5M2FNUZ = 20
    UINT4 = 21
    INT4 = 22
    FLOAT4E2M1 = 23
    FLOAT8E8M0 = 24
    UINT2 = 25
    INT2 = 26

    @property
    def short(self) -> str:
        return _SHORT[self]

    @property
    def numpy(self) -> np.dtype:
        if self not in _TO_NUMPY:
            raise UnsupportedTypeError(f"element type {self.name} is not supported here (numpy has no equivalent); cast the "
                                       f"model's tensors of that type to float32 or float16")
        return np.dtype(_TO_NUMPY[self])

    @property
    def is_float(self) -> bool:
        return self in (DType.FLOAT, DType.FLOAT16, DType.DOUBLE, DType.BFLOAT16)

    @property
    def is_int(self) -> bool:
        return self in _INTS

    @property
    def is_minifloat(self) -> bool:
        """float8 and float4 formats: values are kept as their bit patterns (one byte each, as ml_dtypes holds
        them) and only converted by Cast, QuantizeLinear and DequantizeLinear; they have no arithmetic."""
        return self in MINIFLOATS

    @property
    def narrow_bits(self) -> int:
        """Bits of a 2- or 4-bit integer (held one per byte, in the low bits, as ml_dtypes holds them); 0 for
        other types."""
        return _NARROW_BITS.get(self, 0)

    @property
    def int_range(self):
        """(min, max) of an integer type."""
        info = ml_dtypes.iinfo(self.numpy) if self.narrow_bits else np.iinfo(self.numpy)
        return int(info.min), int(info.max)

    @property
    def itemsize(self) -> int:
        return self.numpy.itemsize

    @staticmethod
    def from_numpy(dt) -> "DType":
        dt = np.dtype(dt)
        for k, v in _TO_NUMPY.items():
            if np.dtype(v) == dt:
                return k
        raise TypeError(f"numpy dtype {dt} has no Cuvil equivalent")

    @staticmethod
    def from_short(s: str) -> "DType":
        for k, v in _SHORT.items():
            if v == s:
                return k
        raise ValueError(f"unknown dtype {s!r}")


_SHORT = {
    DType.FLOAT: "f32", DType.UINT8: "u8", DType.INT8: "i8", DType.UINT16: "u16", DType.INT16: "i16",
    DType.INT32: "i32", DType.INT64: "i64", DType.STRING: "str", DType.BOOL: "bool", DType.FLOAT16: "f16",
    DType.DOUBLE: "f64", DType.UINT32: "u32", DType.UINT64: "u64", DType.COMPLEX64: "c64",
    DType.COMPLEX128: "c128", DType.BFLOAT16: "bf16", DType.FLOAT8E4M3FN: "f8e4m3fn", DType.FLOAT8E4M3FNUZ: "f8e4m3fnuz",
    DType.FLOAT8E5M2: "f8e5m2", DType.FLOAT8E5M2FNUZ: "f8e5m2fnuz", DType.UINT4: "u4", DType.INT4: "i4",
    DType.FLOAT4E2M1: "f4e2m1", DType.FLOAT8E8M0: "f8e8m0", DType.UINT2: "u2", DType.INT2: "i2",
}
_TO_NUMPY = {
    DType.FLOAT: np.float32, DType.UINT8: np.uint8, DType.INT8: np.int8, DType.UINT16: np.uint16,
    DType.INT16: np.int16, DType.INT32: np.int32, DType.INT64: np.int64, DType.STRING: np.object_,
    DType.BOOL: np.bool_, DType.FLOAT16: np.float16, DType.DOUBLE: np.float64, DType.UINT32: np.uint32,
    DType.UINT64: np.uint64, DType.COMPLEX64: np.complex64, DType.COMPLEX128: np.complex128,
    # numpy has none of these: ml_dtypes' (one byte per element, as onnx.numpy_helper gives them)
    DType.BFLOAT16: ml_dtypes.bfloat16, DType.FLOAT8E4M3FN: ml_dtypes.float8_e4m3fn,
    DType.FLOAT8E4M3FNUZ: ml_dtypes.float8_e4m3fnuz, DType.FLOAT8E5M2: ml_dtypes.float8_e5m2,
    DType.FLOAT8E5M2FNUZ: ml_dtypes.float8_e5m2fnuz, DType.UINT4: ml_dtypes.uint4, DType.INT4: ml_dtypes.int4,
    DType.FLOAT4E2M1: ml_dtypes.float4_e2m1fn, DType.FLOAT8E8M0: ml_dtypes.float8_e8m0fnu, DType.UINT2: ml_dtypes.uint2,
    DType.INT2: ml_dtypes.int2,
}
_NARROW_BITS = {DType.UINT4: 4, DType.INT4: 4, DType.UINT2: 2, DType.INT2: 2}
_INTS = {DType.UINT8, DType.INT8, DType.UINT16, DType.INT16, DType.INT32, DType.INT64, DType.UINT32, DType.UINT64,
         *_NARROW_BITS}
MINIFLOATS = frozenset({DType.FLOAT8E4M3FN, DType.FLOAT8E4M3FNUZ, DType.FLOAT8E5M2, DType.FLOAT8E5M2FNUZ,
                        DType.FLOAT4E2M1, DType.FLOAT8E8M0})
