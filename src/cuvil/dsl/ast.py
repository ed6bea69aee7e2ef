"""The typed AST of .rule files (attrs classes). Every node carries its source location."""
from __future__ import annotations

from typing import FrozenSet, Optional, Tuple, Union

import attrs

from ..ir.dtype import DType


@attrs.frozen
class Loc:
    path: str
    line: int
    col: int

    def __str__(self):
        return f"{self.path}:{self.line}:{self.col}"


@attrs.frozen
class Var:
    """A lower-case name: binds a value (or an attribute value) on the left, refers to it on the right."""
    name: str
    loc: Loc = attrs.field(eq=False)


@attrs.frozen
class OptionalVar:
    """``b?`` as a pattern input: binds ``b`` to the input, or to *absent* when the node has no such input.
    Only the trailing positional inputs of an op may be optional (see :mod:`cuvil.dsl.cases`)."""
    name: str
    loc: Loc = attrs.field(eq=False)


@attrs.frozen
class Coalesce:
    """``x ?? y`` in a replacement: ``x`` where it is present, else ``y``. An expression is absent when an
    input it needs is an absent optional input (``b * c`` with ``b`` absent); as an optional input of an op
    an absent expression leaves that input out."""
    left: "Expr"
    right: "Expr"
    loc: Loc = attrs.field(eq=False)


@attrs.frozen
class Wildcard:
    loc: Loc = attrs.field(eq=False)


@attrs.frozen
class Num:
    value: Union[int, float]
    loc: Loc = attrs.field(eq=False)


@attrs.frozen
class ListLit:
    items: Tuple["Expr", ...]
    loc: Loc = attrs.field(eq=False)


@attrs.frozen
class OpCall:
    """An ONNX op applied to sub-patterns: positional inputs, ``name=pat`` attributes, ``..rest``."""
    op: str
    args: Tuple["Expr", ...]
    attrs: Tuple[Tuple[str, "Expr"], ...]
    rest: Optional[str]
    loc: Loc = attrs.field(eq=False)

    def attr(self, name: str):
        return dict(self.attrs).get(name)


@attrs.frozen
class FuncCall:
    """A lower-case call in a guard: ``const(w, b)``, ``rank(x)``, ``dim(x, 1)``, ``shape(a)``, ``single_use(v)``."""
    name: str
    args: Tuple["Expr", ...]
    loc: Loc = attrs.field(eq=False)


@attrs.frozen
class Compare:
    op: str  # == != < <= > >=
    left: "Expr"
    right: "Expr"
    loc: Loc = attrs.field(eq=False)


@attrs.frozen
class Arith:
    """Arithmetic inside guards (``dim(x, 1) * 2``); in patterns ``+ - * /`` are ops (Add/Sub/Mul/Div)."""
    op: str
    left: "Expr"
    right: "Expr"
    loc: Loc = attrs.field(eq=False)


Expr = Union[Var, OptionalVar, Coalesce, Wildcard, Num, ListLit, OpCall, FuncCall, Arith]

# Where a rule runs: "graph" rules rewrite the graph in optimize(); "kernel" rules the scalar expressions of
# fused kernels; "x86" rules choose algorithms for the x86 target just before it lowers the graph (each
# match is applied only where the target's cost model says it pays, see cuvil.targets.x86.choose).
PHASES = ("graph", "kernel", "x86")
Guard = Union[FuncCall, Compare]

# Element types a ``dtype(x) in [...]`` guard may name: ONNX's names (TensorProto's, lower case), plus
# float32/float64 as aliases of float/double.
DTYPE_NAMES = {
    "float": DType.FLOAT, "float32": DType.FLOAT, "double": DType.DOUBLE, "float64": DType.DOUBLE,
    "float16": DType.FLOAT16, "bfloat16": DType.BFLOAT16, "bool": DType.BOOL, "int8": DType.INT8,
    "int16": DType.INT16, "int32": DType.INT32, "int64": DType.INT64, "uint8": DType.UINT8,
    "uint16": DType.UINT16, "uint32": DType.UINT32, "uint64": DType.UINT64,
}


@attrs.frozen
class Rule:
    name: str
    benefit: int
    on: str                     # one of PHASES
    lhs: OpCall
    guards: Tuple[Guard, ...]
    rhs: Expr
    proof: str                  # "exact" or "real"
    loc: Loc = attrs.field(eq=False)
    text: str = attrs.field(eq=False, default="")   # the rule's source, for hashing and reports
    # Element types its proof covers (DSL names), set by verdicts.restrict_to_proof; None: every type.
    # The matcher checks every value of a float-capable position of every matched node against it.
    dtypes: Optional[Tuple[str, ...]] = attrs.field(default=None)
    # Ops (Add, Mul) whose operands the matcher may also take in the swapped order, set by
    # verdicts.restrict_to_proof where commutativity is proved for the rule's obligation and element types.
    commutative: FrozenSet[str] = attrs.field(default=frozenset(), converter=frozenset)

    def __str__(self):
        return self.text or self.name
