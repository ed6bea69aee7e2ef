"""Op lowerings: each op's outputs as tensor expressions of its inputs (a table keyed by op name).

A lowering receives a :class:`LowerCtx` whose ``inputs`` are :class:`TensorFn` (shape, dtype and a
function from output indices to an expression) and returns one TensorFn per output. Lowerings never
allocate: an op that needs an intermediate (Softmax's row max) asks ``ctx.temp`` for a materialised one.

The table and the shared helpers are in :mod:`.core`; the lowerings sit in one module per op family, named
like the families of :mod:`cuvil.ir.ops`. Importing this package imports every family, so
:data:`LOWERINGS` is complete.
"""
from importlib import import_module

from ...ir.ops import FAMILIES
from .core import LOWERINGS, LowerCtx, TensorFn, lowering

for _family in FAMILIES:
    import_module(f"{__name__}.{_family}")

__all__ = ["LOWERINGS", "LowerCtx", "TensorFn", "lowering"]
