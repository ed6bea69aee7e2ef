"""Element types, numbered as ONNX's ``TensorProto.DataType`` so the C ABI can use the same codes."""
from __future__ import annotations

import enum

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
    def itemsize(self) -> int:
        return 2 if self is DType.BFLOAT16 else self.numpy.itemsize

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
    DType.COMPLEX128: "c128", DType.BFLOAT16: "bf16",
}
_TO_NUMPY = {
    DType.FLOAT: np.float32, DType.UINT8: np.uint8, DType.INT8: np.int8, DType.UINT16: np.uint16,
    DType.INT16: np.int16, DType.INT32: np.int32, DType.INT64: np.int64, DType.STRING: np.object_,
    DType.BOOL: np.bool_, DType.FLOAT16: np.float16, DType.DOUBLE: np.float64, DType.UINT32: np.uint32,
    DType.UINT64: np.uint64, DType.COMPLEX64: np.complex64, DType.COMPLEX128: np.complex128,
}
_INTS = {DType.UINT8, DType.INT8, DType.UINT16, DType.INT16, DType.INT32, DType.INT64, DType.UINT32, DType.UINT64}
