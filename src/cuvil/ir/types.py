"""Tensor types: an element type and a shape of dimensions (ints or symbolic expressions)."""
from __future__ import annotations

from typing import Optional, Tuple

import attrs

from .dim import Dim, SymExpr, as_dim, free_symbols, product
from .dtype import DType


def _shape(s) -> Optional[Tuple[Dim, ...]]:
    return None if s is None else tuple(as_dim(d) for d in s)


@attrs.frozen
class TensorType:
    """``dtype`` plus ``shape``; ``shape is None`` means the rank is unknown."""

    dtype: DType = attrs.field(converter=DType)
    shape: Optional[Tuple[Dim, ...]] = attrs.field(converter=_shape)

    @property
    def rank(self) -> Optional[int]:
        return None if self.shape is None else len(self.shape)

    @property
    def is_static(self) -> bool:
        return self.shape is not None and all(isinstance(d, int) for d in self.shape)

    @property
    def numel(self) -> Dim:
        if self.shape is None:
            raise ValueError("element count of a tensor of unknown rank")
        return product(self.shape)

    @property
    def free_symbols(self) -> frozenset:
        out = frozenset()
        for d in self.shape or ():
            out |= free_symbols(d)
        return out

    def with_shape(self, shape) -> "TensorType":
        return TensorType(self.dtype, shape)

    def with_dtype(self, dtype) -> "TensorType":
        return TensorType(dtype, self.shape)

    def __str__(self):
        if self.shape is None:
            return f"{self.dtype.short}[*]"
        return f"{self.dtype.short}[{','.join(str(d) for d in self.shape)}]"


def is_symbolic(d: Dim) -> bool:
    return isinstance(d, SymExpr)
