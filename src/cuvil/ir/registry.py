"""The op registry: one :class:`OpDef` per ONNX op, declared once in ``ir/ops/<family>.py``.

An OpDef holds the op's shape/dtype inference (symbolic-aware), its canonical form (which constant inputs
are lifted into attributes on import), an optional symbolic evaluator for shape computations, and its
traits (elementwise, half-precision class, ...). Every set of ops that other layers need (fusion consumers,
the elementwise prover's ops, the float16 pass's ops) is derived from the traits with :func:`ops_with`,
never kept by hand. Other interpretations of ops (Z3 semantics, kernel lowerings) are tables keyed by op
name in their own modules, named after the same families. Arity and attribute defaults come from ONNX's
own schema at :data:`CANON_OPSET`.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import attrs
import numpy as np
import onnx
import onnx.defs

from ..errors import InvalidAttributeError, ShapeError, UnsupportedOpError
from .dim import Dim, SymExpr, as_dim, dmax, floordiv, mul
from .dtype import DType
from .types import TensorType

# Cuvil's canonical op semantics are those of this default-domain opset (ops newer than it: their first).
CANON_OPSET = 21
# Cuvil's own ops (introduced by rewrite rules, never imported from a model) live in this domain; their
# ONNX schemas are registered with onnx.defs so arity, attributes and defaults read like any op's.
CUSTOM_DOMAIN = "ai.cuvil"
CUSTOM_OPSET = 1
_CUSTOM_SCHEMAS: Dict[str, "onnx.defs.OpSchema"] = {}


# Values of the ``elementwise`` trait: how an elementwise op reads its inputs at the output's index.
BROADCAST = "broadcast"    # every input at the output's index, up to numpy (multidirectional) broadcasting
PER_CHANNEL = "channel"    # input 0 at the output's index, the others at its channel (axis 1): BatchNormalization

# Values of the ``half`` trait: what the float16 precision pass does with the op.
HALF_COMPUTE = "compute"        # computed in half (storage and elementwise math)
HALF_EXACT = "exact"            # data movement or selection, exact in any type
HALF_ACCUMULATE = "accumulate"  # half in and out, float32 accumulators (sums of products, averages)
HALF_FLOAT32 = "float32"        # kept in float32 on purpose (overflows or loses too much in half)
HALF_CLASSES = (HALF_COMPUTE, HALF_EXACT, HALF_ACCUMULATE, HALF_FLOAT32)


class UnknownRank(Exception):
    """Raised by InferCtx.shape when an input's rank is unknown; outputs then get unknown rank too."""


@attrs.frozen
class OpDef:
    name: str
    family: str
    infer: Callable[["InferCtx"], Any]
    # Canonical form: (attribute name, input index, element type) triples; a constant input at that index
    # becomes the attribute on import (ints as lists, 0-d as scalars) and goes back to an input on export,
    # as int64 ("i64"), float32 ("f32") or the dtype of input 0 ("data").
    lifted: Tuple[Tuple[str, int, str], ...] = ()
    # Elements of small integer outputs as dimensions (shape arithmetic), or None per output.
    sym_eval: Optional[Callable[["InferCtx"], List[Optional[Tuple[Dim, ...]]]]] = None
    domain: str = ""    # "" for ONNX ops, CUSTOM_DOMAIN for Cuvil's own
    # Traits (see the constants above). elementwise: None, BROADCAST or PER_CHANNEL; the fusion consumers
    # of the kernel layer are the elementwise ops, the elementwise prover takes the BROADCAST ones.
    elementwise: Optional[str] = None
    # The float16 pass's class: one of HALF_CLASSES, or None (not half-capable: kept in float32 too).
    half: Optional[str] = None
    # The output's element type is chosen by an attribute or another input (Cast, CastLike), not by the data.
    converts_dtype: bool = False
    # The output is not a function of the inputs (random ops): never folded nor merged.
    nondeterministic: bool = False
    # op(a, b) == op(b, a) for every element type (Add, Mul; not Max/Min, whose ties depend on the order): the
    # matcher may try both operand orders once the fact is proved per domain (rewrite_rules/commutativity.py).
    commutative: bool = False
    # A sliding window (convolutions, pools): unset pads/strides/dilations mean zeros/ones, though ONNX gives
    # them no default (the canonical form, ir/lifting.py).
    window: bool = False
    # The output depends on the input's shape only, not its values (Shape, Size).
    shape_only: bool = False

    @functools.cached_property
    def schema(self) -> onnx.defs.OpSchema:
        return op_schema(self.name)

    @property
    def attr_defaults(self) -> Dict[str, Any]:
        return attr_defaults(self.name)

    @property
    def lifted_names(self) -> Dict[str, int]:
        return {name: idx for name, idx, _ in self.lifted}


REGISTRY: Dict[str, OpDef] = {}


def op(*names: str, lifted: Sequence[Tuple[str, int, str]] = (), sym_eval=None, domain: str = "",
       elementwise: Optional[str] = None, half: Optional[str] = None, converts_dtype: bool = False,
       nondeterministic: bool = False, commutative: bool = False, window: bool = False,
       shape_only: bool = False):
    """Decorator: declare ops ``names`` with the decorated function as their shape inference (``domain``:
    CUSTOM_DOMAIN for Cuvil's own ops, whose schema :func:`register_custom_schema` declared first) and the
    given traits (see :class:`OpDef`). Ops that share a shape function but not their traits stack several
    ``@op`` on it."""
    if elementwise not in (None, BROADCAST, PER_CHANNEL):
        raise ValueError(f"elementwise must be None, {BROADCAST!r} or {PER_CHANNEL!r}, not {elementwise!r}")
    if half is not None and half not in HALF_CLASSES:
        raise ValueError(f"half must be None or one of {HALF_CLASSES}, not {half!r}")

    def deco(fn):
        family = fn.__module__.rsplit(".", 1)[-1]
        for name in names:
            if name in REGISTRY:
                raise RuntimeError(f"op {name} declared twice ({REGISTRY[name].family} and {family})")
            if domain and name not in _CUSTOM_SCHEMAS:
                raise RuntimeError(f"op {name} of domain {domain} has no registered schema")
            REGISTRY[name] = OpDef(name, family, fn, tuple(lifted), sym_eval, domain, elementwise, half,
                                   converts_dtype, nondeterministic, commutative, window, shape_only)
        return fn

    return deco


def lookup(name: str, *, node: str = "", opset: Optional[int] = None, domain: str = "") -> OpDef:
    _load_families()
    try:
        return REGISTRY[name]
    except KeyError:
        raise UnsupportedOpError(name, node, opset, domain=domain) from None


def all_ops() -> Dict[str, OpDef]:
    _load_families()
    return dict(REGISTRY)


def ops_with(trait: str, *values: Any) -> frozenset:
    """Names of the registered ops whose ``trait`` is one of ``values`` (truthy, when no value is given):
    ``ops_with("elementwise")``, ``ops_with("half", HALF_COMPUTE, HALF_EXACT)``."""
    _load_families()
    if trait not in attrs.fields_dict(OpDef):
        raise ValueError(f"OpDef has no trait {trait!r}")
    if values:
        return frozenset(n for n, d in REGISTRY.items() if getattr(d, trait) in values)
    return frozenset(n for n, d in REGISTRY.items() if getattr(d, trait))


def register_custom_schema(schema: onnx.defs.OpSchema) -> None:
    """Declare the schema of one of Cuvil's own ops (domain CUSTOM_DOMAIN) to onnx.defs and the registry."""
    if schema.name in _CUSTOM_SCHEMAS:
        return
    try:
        onnx.defs.get_schema(schema.name, CUSTOM_OPSET, CUSTOM_DOMAIN)
    except onnx.defs.SchemaError:
        onnx.defs.register_schema(schema)
    _CUSTOM_SCHEMAS[schema.name] = onnx.defs.get_schema(schema.name, CUSTOM_OPSET, CUSTOM_DOMAIN)


@functools.lru_cache(maxsize=None)
def op_schema(name: str) -> onnx.defs.OpSchema:
    _load_families()
    if name in _CUSTOM_SCHEMAS:
        return _CUSTOM_SCHEMAS[name]
    try:
        return onnx.defs.get_schema(name, CANON_OPSET, "")
    except onnx.defs.SchemaError:
        return onnx.defs.get_schema(name, "")  # ops newer than the canonical opset: their latest schema


@functools.lru_cache(maxsize=None)
def attr_defaults(name: str) -> Dict[str, Any]:
    out = {}
    for aname, a in op_schema(name).attributes.items():
        if a.default_value is not None and a.default_value.type != 0:
            out[aname] = _attr_py(onnx.helper.get_attribute_value(a.default_value))
    return out


def _attr_py(v):
    if isinstance(v, bytes):
        return v.decode()
    if isinstance(v, list):
        return [x.decode() if isinstance(x, bytes) else x for x in v]
    if isinstance(v, onnx.TensorProto):
        return onnx.numpy_helper.to_array(v)
    return v


_LOADED = False


def _load_families():
    global _LOADED
    if not _LOADED:
        # A plugin load, not a cycle to hide: the family modules declare their ops into this registry. Marked
        # loaded only once every family imported, so a family that fails to import fails every lookup loudly
        # (a re-entrant call during the import finds the partly imported package in sys.modules).
        from . import ops  # noqa: F401
        _LOADED = True


# --- inference --------------------------------------------------------------------------------------

@attrs.frozen
class ShapeConstraint:
    """A relation between dims that the model needs and inference could not decide (symbolic dims):
    ``eq`` a == b, ``bcast`` a == b or either is 1, ``ge`` a >= b, ``mod0`` a % b == 0."""
    kind: str
    a: Dim
    b: Dim
    what: str

    def __str__(self):
        return {"eq": f"{self.a} == {self.b}", "bcast": f"{self.a} and {self.b} broadcast",
                "ge": f"{self.a} >= {self.b}", "mod0": f"({self.a}) % ({self.b}) == 0"}[self.kind]


def decide_constraint(kind: str, a: Dim, b: Dim) -> Optional[bool]:
    """Whether a ShapeConstraint of ``kind`` holds for dims ``a``, ``b``: None while either is symbolic and
    the kind does not settle it."""
    if kind in ("eq", "bcast") and a == b:
        return True
    if kind == "bcast" and (a == 1 or b == 1):
        return True
    if kind == "mod0" and b != 0 and mul(floordiv(a, b), b) == a:   # b divides a as polynomials: (B*S*S) % (B*S)
        return True
    if not (isinstance(a, int) and isinstance(b, int)):
        return None
    return {"eq": a == b, "bcast": a == b or 1 in (a, b), "ge": a >= b, "mod0": b != 0 and a % b == 0}[kind]


class InferCtx:
    """What a shape function sees of a node: input types, attributes (with defaults), constant inputs."""

    def __init__(self, node, opdef: OpDef, num_outputs: Optional[int] = None):
        self.node, self.opdef, self._num_outputs = node, opdef, num_outputs
        self._defaults = opdef.attr_defaults
        self.constraints: List[ShapeConstraint] = []

    def require(self, kind: str, a: Dim, b: Dim, what: str) -> None:
        """A shape condition: fails now when static and false, is recorded when symbolic (and checked
        over the symbols' ranges by :mod:`cuvil.ir.constraints`)."""
        ok = decide_constraint(kind, a, b)
        if ok is False:
            self.fail(what)
        if ok is None:
            self.constraints.append(ShapeConstraint(kind, a, b, what))

    def unify(self, a: Dim, b: Dim, what: str) -> Dim:
        """Two dims that must be equal: the static one if any (static ones that differ are an error)."""
        self.require("eq", a, b, what)
        return a if isinstance(a, int) else b

    @property
    def num_inputs(self) -> int:
        n = len(self.node.inputs)
        while n and self.node.inputs[n - 1] is None:
            n -= 1
        return n

    @property
    def num_outputs(self) -> int:
        return len(self.node.outputs) or self._num_outputs or 1

    def has_input(self, i: int) -> bool:
        return i < len(self.node.inputs) and self.node.inputs[i] is not None

    def type(self, i: int) -> TensorType:
        if not self.has_input(i):
            self.fail(f"input {i} is missing")
        return self.node.inputs[i].type

    def dtype(self, i: int) -> DType:
        return self.type(i).dtype

    def shape(self, i: int) -> Tuple[Dim, ...]:
        s = self.type(i).shape
        if s is None:
            raise UnknownRank()
        return s

    def rank(self, i: int) -> int:
        return len(self.shape(i))

    def attr(self, name: str, default: Any = None) -> Any:
        """The attribute's value, checked against its declared type (see :func:`check_attr`); its default
        when absent; a required attribute that is absent is an InvalidAttributeError."""
        if name in self.node.attrs:
            return check_attr(self.opdef, name, self.node.attrs[name])
        if name in self._defaults:
            return self._defaults[name]
        if default is None and name in self.opdef.schema.attributes and self.opdef.schema.attributes[name].required:
            raise InvalidAttributeError(f"missing required attribute {name!r}")
        return default

    def has_attr(self, name: str) -> bool:
        return name in self.node.attrs

    def const(self, i: int) -> Optional[np.ndarray]:
        if not self.has_input(i):
            return None
        return self.node.inputs[i].const

    def sym(self, i: int) -> Optional[Tuple[Dim, ...]]:
        """Elements of integer input ``i`` as dimensions, when known (constant or symbolic shape value)."""
        if not self.has_input(i):
            return None
        v = self.node.inputs[i]
        if v.const is not None and v.const.dtype.kind in "iub" and v.const.size <= 1 << 16:   # bools as 0/1
            return tuple(int(x) for x in v.const.reshape(-1))
        return v.sym_value

    def attr_or_input(self, name: str, i: int):
        """A lifted attribute, or its value from a constant/symbolic input when it was not lifted."""
        if name in self.node.attrs:
            return check_attr(self.opdef, name, self.node.attrs[name])
        s = self.sym(i)
        if s is not None:
            return list(s)
        c = self.const(i)
        if c is not None:
            # A constant the lifting did not take (not integer, or large): checked like the attribute.
            return check_attr(self.opdef, name, c.tolist())
        return None

    def fail(self, msg: str):
        raise ShapeError(msg)

    def axis(self, a: int, rank: int, what: str = "axis") -> int:
        if not -rank <= a < rank:
            self.fail(f"{what} {a} out of range for rank {rank}")
        return a + rank if a < 0 else a


# Attributes that name an output's element type (Cast's ``to``; ``dtype`` of EyeLike, the random ops,
# Multinomial; ``output_dtype`` of QuantizeLinear); 0 or absent means "not set here".
_DTYPE_ATTRS = ("to", "dtype", "output_dtype")


def _dtypes_without_shapes(node, n: int) -> List[DType]:
    """The element types of ``node``'s ``n`` outputs when an input's rank is unknown, so the op's own
    inference (which needs shapes) could not run. The dtype does not depend on shapes: an attribute that
    names it, else the ONNX schema's type constraints: an output that shares its type parameter with an
    input has that input's type, and a constraint that allows one type is that type (Equal's, Not's,
    IsNaN's bool; Shape's int64). Taking input 0's type instead made a Where over a bool condition bool
    and a Cast to bool its source type (TorchScript exports' attention masks)."""
    first = next((v.dtype for v in node.inputs if v is not None), DType.FLOAT)
    for name in _DTYPE_ATTRS:
        code = node.attrs.get(name)
        if isinstance(code, (int, np.integer)) and not isinstance(code, bool) and int(code) > 0:
            try:
                return [DType(int(code))] * n
            except ValueError:
                break
    try:
        schema = onnx.defs.get_schema(node.op, node.domain or "")
    except onnx.defs.SchemaError:
        return [first] * n
    allowed = {c.type_param_str: list(c.allowed_type_strs) for c in schema.type_constraints}
    formals = list(schema.inputs)
    out: List[DType] = []
    for j in range(n):
        if not schema.outputs:
            out.append(first)
            continue
        ts = schema.outputs[min(j, len(schema.outputs) - 1)].type_str
        dt = None
        for k, v in enumerate(node.inputs):
            if v is not None and formals and formals[min(k, len(formals) - 1)].type_str == ts:
                dt = v.dtype
                break
        if dt is None:
            strs = allowed.get(ts, [ts])
            dt = _dtype_of_type_str(strs[0]) if len(strs) == 1 else None
        out.append(first if dt is None else dt)
    return out


def _dtype_of_type_str(ts: str) -> Optional[DType]:
    """``tensor(int64)`` -> DType.INT64; None for anything else (sequences, unknown names)."""
    if not (ts.startswith("tensor(") and ts.endswith(")")):
        return None
    return DType.__members__.get(ts[len("tensor("):-1].upper())


def infer_node(node, num_outputs: Optional[int] = None) -> Tuple[List[TensorType], List[Optional[Tuple[Dim, ...]]]]:
    """Output types (and symbolic values) of ``node``, from the registry; errors name the node.

    ``num_outputs`` is how many outputs the node is asked for, where it has none yet (ops such as Split
    and MaxPool infer as many as are asked for).
    """
    opdef = lookup(node.op, node=node.name, domain=node.domain)
    ctx = InferCtx(node, opdef, num_outputs)
    try:
        check_flags(opdef, node.attrs)
        res = opdef.infer(ctx)
        types = [res] if isinstance(res, TensorType) else list(res)
    except UnknownRank:
        types = [TensorType(dt, None) for dt in _dtypes_without_shapes(node, ctx.num_outputs)]
    except ShapeError as e:
        raise e.with_context(f"node {node.name!r} ({node.op}): ") from None
    node.constraints = ctx.constraints
    syms: List[Optional[Tuple[Dim, ...]]] = [None] * len(types)
    if opdef.sym_eval is not None:
        try:
            got = opdef.sym_eval(ctx)
        except (UnknownRank, ShapeError, ZeroDivisionError, IndexError, ValueError, TypeError):
            got = None
        if got is not None:
            syms = list(got) + [None] * (len(types) - len(got))
    return types, syms


# --- attribute types ----------------------------------------------------------------------------------

_A = onnx.defs.OpSchema.AttrType
# What each declared attribute type admits as a Python value in a Node's ``attrs``.
_ATTR_KINDS = {_A.INT: "int", _A.FLOAT: "float", _A.STRING: "str", _A.TENSOR: "tensor", _A.SPARSE_TENSOR: "tensor",
               _A.INTS: "ints", _A.FLOATS: "floats", _A.STRINGS: "strs"}
# Lifted attributes (constant inputs moved into attributes) hold a scalar or a flat list of these.
_LIFTED_KINDS = {"i64": "int", "f32": "float", "data": "number"}
_KIND_WORDS = {"int": "an integer", "float": "a float", "str": "a string", "tensor": "a tensor", "number": "a number",
               "ints": "a list of integers", "floats": "a list of floats", "strs": "a list of strings"}


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer, SymExpr))


def _is_float(v) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating))


def _fits(kind: str, v) -> bool:
    if kind == "int":
        return _is_int(v)
    if kind in ("float", "number"):
        return _is_float(v) or (kind == "number" and isinstance(v, (bool, np.bool_)))
    if kind == "str":
        return isinstance(v, str)
    if kind == "tensor":
        return isinstance(v, (np.ndarray, onnx.TensorProto, onnx.SparseTensorProto))
    if isinstance(v, (list, tuple)):
        return all(_fits(kind[:-1], x) for x in v)
    return False


def _describe(v) -> str:
    if isinstance(v, (list, tuple)):
        inner = {type(x).__name__ for x in v}
        return f"a list of {'/'.join(sorted(inner))}" if inner else "an empty list"
    return {"int": "an integer", "float": "a float", "str": "a string", "ndarray": "a tensor"}.get(
        type(v).__name__, f"a {type(v).__name__}")


@functools.lru_cache(maxsize=None)
def _lifted_kind(op: str, idx: int, kind: str) -> str:
    """What a lifted input admits: integers where its ONNX type constraint is integer-only (Reshape's shape),
    any number where it also admits floats (OneHot's depth)."""
    kind = _LIFTED_KINDS[kind]
    schema = op_schema(op)
    if kind != "int" or idx >= len(schema.inputs):
        return kind
    tstr = schema.inputs[idx].type_str
    allowed = next((c.allowed_type_strs for c in schema.type_constraints if c.type_param_str == tstr), [tstr])
    return "number" if any("float" in t or "double" in t for t in allowed) else "int"


@functools.lru_cache(maxsize=None)
def _attr_kind(op: str, name: str) -> Optional[Tuple[str, bool]]:
    """(kind, lifted) of attribute ``name`` of ``op``, or None where nothing is declared for it."""
    opdef = REGISTRY[op]
    for n, idx, kind in opdef.lifted:
        if n == name:
            return _lifted_kind(op, idx, kind), True
    spec = opdef.schema.attributes.get(name)
    kind = _ATTR_KINDS.get(spec.type) if spec is not None else None
    return None if kind is None else (kind, False)


def check_attr(opdef: OpDef, name: str, value: Any) -> Any:
    """``value`` if it has the type that attribute ``name`` of ``opdef`` is declared with (in the op's ONNX
    schema, or its lifted-input table); else an InvalidAttributeError naming both. The one place shape
    functions' attribute access is type-checked."""
    declared = _attr_kind(opdef.name, name)
    if declared is None:
        return value
    kind, lifted = declared
    if lifted:
        if _fits(kind, value) or (isinstance(value, (list, tuple)) and _fits(kind + "s", value)):
            return value
        want = f"{_KIND_WORDS[kind]} or a flat list of them"
    else:
        if _fits(kind, value):
            return value
        want = _KIND_WORDS[kind]
    raise InvalidAttributeError(f"attribute {name!r} must be {want}, not {_describe(value)}")


#: ONNX integer attributes that are flags: the spec gives them the values 0 and 1 only (ReduceMax's keepdims,
#: Gemm's transA, TopK's largest, ...). Any other value is an error, never read as true or false: engines
#: disagree on what keepdims = -1 means (found by ``python -m cuvil.fuzz``: Cuvil kept the axis, the oracle
#: dropped it).
FLAG_ATTRS = frozenset({
    "keepdims", "noop_with_empty_axes", "select_last_index", "transA", "transB", "ceil_mode", "count_include_pad",
    "storage_order", "exclusive", "reverse", "largest", "sorted", "upper", "fmod", "allowzero", "detect_negative",
    "detect_positive", "center_point_box", "training_mode", "is_case_sensitive", "new_axis", "layout",
    "linear_before_reset", "input_forget", "exclude_outside", "antialias", "align_corners", "saturate",
    "inverse", "onesided"})


def check_flags(opdef: OpDef, attrs) -> None:
    """An InvalidAttributeError for a flag attribute (:data:`FLAG_ATTRS`) of an ONNX op set to neither 0 nor 1;
    checked for every node at inference, whether or not its shape function reads the flag."""
    if opdef.domain:
        return
    for name in FLAG_ATTRS.intersection(attrs):
        v = attrs[name]
        if _attr_kind(opdef.name, name) == ("int", False) and isinstance(v, (int, np.integer)) \
                and not isinstance(v, bool) and int(v) not in (0, 1):
            raise InvalidAttributeError(f"attribute {name!r} must be 0 or 1 (a flag), not {int(v)}")


# --- helpers shared by shape functions -----------------------------------------------------------------

def broadcast_shapes(ctx: InferCtx, *shapes: Sequence[Dim]) -> Tuple[Dim, ...]:
    """Multidirectional (numpy) broadcasting of symbolic shapes."""
    rank = max((len(s) for s in shapes), default=0)
    out = []
    for k in range(rank):
        dims = [s[len(s) - rank + k] for s in shapes if len(s) - rank + k >= 0]
        cur: Dim = 1
        for d in dims:
            if d == 1:
                continue
            if cur == 1 or cur == d:
                cur = d
                continue
            ctx.require("bcast", cur, d, f"shapes {' and '.join(_fmt(s) for s in shapes)} do not broadcast")
            if isinstance(d, int):
                cur = d  # the symbol must be 1 or equal to d
            elif not isinstance(cur, int):
                cur = dmax(cur, d)  # one of them is 1 at run time, or they are equal: max is right either way
        out.append(cur)
    return tuple(out)


def _fmt(s) -> str:
    return "[" + ",".join(str(d) for d in s) + "]"


def same_as(ctx: InferCtx, i: int = 0) -> TensorType:
    return ctx.type(i)


def dims_of(value) -> Tuple[Dim, ...]:
    return tuple(as_dim(x) for x in value)
