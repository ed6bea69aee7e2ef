"""The prover: every rule's equivalence obligation, discharged before the rule may run.

A rule is instantiated on symbolic tensors (every element a Z3 variable) and both sides are evaluated
with the op semantics of :mod:`cuvil.rewrite_rules.semantics`:

* ``prove exact``: equal bit for bit in IEEE-754 float32 (NaN, +-0, +-inf, subnormals);
* ``prove real``: equal over the reals wherever the left side is defined, and the right side defined
  there too (division by zero, Sqrt/Log of out-of-domain arguments are definedness conditions).

The verdict (:class:`Verdict`) is one of

* ``proved``: for every shape. Rules whose ops are all elementwise are proved once on scalars
  ("shape-generic"), exact ones in float32 and again in float16, bfloat16 and float64; structured rules
  when :func:`cuvil.rewrite_rules.generic.prove_generic` proves them with symbolic dims and attributes.
* ``bounded``: proved by Z3 on N concrete instances with dims up to K, drawn adversarially (each
  attribute variable independent, boundary values, reduced axes of 3 to 8 elements) and kept only if the
  pattern matches them and the replacement type-checks. Bounded ``prove exact`` rules whose ops sum are
  off by default (:attr:`Verdict.on_by_default`).
* ``refuted``, with a counterexample; ``unknown``, with a reason (a timeout, no instance, an op without
  semantics, or a failure of the prover itself: never a traceback).

A ``prove real`` obligation whose every element is a polynomial on both sides is decided without Z3, by
exact normal forms (:mod:`cuvil.rewrite_rules.polynomial`); the verdict's ``method`` says what decided it.

Before Z3, a random refuter runs both sides numerically (:mod:`cuvil.rewrite_rules.refute`: onnx.reference
on many drawn instances, then, for exact rules, Cuvil's own float32 semantics on concrete values), so a
wrong rule is refuted in milliseconds. Each verdict records the element types its proof covers; the
engine lets a rule fire only on those (:func:`cuvil.rewrite_rules.verdicts.restrict_to_proof`).
"""
from __future__ import annotations

import hashlib
import itertools
import re
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import attrs
import numpy as np
import onnx
import z3

from ..dsl.ast import Compare, DTYPE_NAMES, Expr, FuncCall, ListLit, Num, OpCall, Rule, Var, Wildcard
from ..dsl.cases import expand_cases
from ..dsl.compiler import BuildError, build, match
from ..dsl.validate import KERNEL_OPS
from ..errors import CuvilError, ShapeError, UnsupportedOpError
from ..ir.graph import Graph
from ..ir.registry import BROADCAST, attr_defaults, lookup, op_schema, ops_with
from ..ir.dtype import DType
from ..ir.types import TensorType
from . import polynomial
from . import semantics as sem
from .generic import prove_generic
from .refute import Sample, draw_values, refute

PROVER_VERSION = "3"  # 3: literals no longer make a rule pure data movement (every dtype)
DEFAULT_TIMEOUT_MS = 20_000
MAX_INSTANCES = 3  # the deterministic search's instances (a fallback when random drawing finds none)
MAX_SEARCH = 4000  # candidate instantiations tried per rule
# Adversarial instances: the random refuter runs on REFUTE_INSTANCES with dims up to REFUTE_MAX_DIM; Z3
# then checks BOUNDED_INSTANCES of them with dims up to BOUNDED_MAX_DIM (every element a Z3 variable).
REFUTE_INSTANCES, REFUTE_MAX_DIM, REFUTE_MAX_ELEMS = 24, 8, 2048
BOUNDED_INSTANCES, BOUNDED_MAX_DIM, BOUNDED_MAX_ELEMS = 8, 6, 64
DRAW_ATTEMPTS = 1500
# Z3 on bounded instances stops drawing on more once MIN_BOUNDED are proved and BOUNDED_BUDGET_S have passed.
MIN_BOUNDED, BOUNDED_BUDGET_S = 3, 6.0
SEED = 25
RANDOM_METHOD = "random testing"
GENERIC_METHOD = "z3 (shape-generic)"
MAX_GENERIC = 300  # generic input-shape combinations tried per op of a pattern

# Ops the elementwise prover takes: every output element a function of the input elements at its (numpy
# broadcast) index alone, with Z3 semantics, and an element type the data fixes (the prover types every value
# alike, so not Cast); plus the ops that exist only inside kernels (Fma). Derived from the op registry.
ELEMENTWISE = frozenset(((ops_with("elementwise", BROADCAST) - ops_with("converts_dtype")) & set(sem.SEMANTICS))
                        | KERNEL_OPS)
SHAPE_GUARDS = {"rank", "dim", "shape"}
# The DSL name of each element type (the first of its spellings in DTYPE_NAMES).
DTYPE_NAME: Dict[DType, str] = {}
for _name, _dt in DTYPE_NAMES.items():
    DTYPE_NAME.setdefault(_dt, _name)


@attrs.frozen
class Verdict:
    rule: str
    obligation: str             # "exact" or "real"
    status: str                 # "proved", "bounded", "refuted" or "unknown"
    shapes: str                 # what the proof covers, in words
    ms: float
    counterexample: Optional[str] = None
    detail: Optional[str] = None
    key: str = ""
    instances: int = 0          # bounded: the number of concrete instances Z3 checked (0: generic)
    max_dim: int = 0            # bounded: the largest dim among them
    dtypes: Tuple[str, ...] = attrs.field(default=(), converter=tuple)  # element types the proof covers
    order_dependent: bool = False  # an op of the rule sums (Conv, MatMul, ReduceSum ...): order matters
    # A rule with optional inputs (``b?``): one obligation per case, each {"case", "status", "shapes",
    # "dtypes", "method"}; the verdict above is the weakest of them (see prove_rule).
    cases: Tuple[dict, ...] = attrs.field(default=(), converter=tuple)
    # What decided it: "z3", the "polynomial normal form (exact, over the reals)" (cuvil.rewrite_rules.polynomial),
    # both (bounded instances decided one way or the other), "z3 (shape-generic)", "random testing".
    method: str = ""

    @property
    def proved(self) -> bool:
        return self.status == "proved"

    @property
    def on_by_default(self) -> bool:
        """Proved rules run; bounded ones too, except ``prove exact`` rules whose ops sum (a bounded check
        cannot see an ordering difference on larger shapes): those need ``allow_bounded``."""
        return self.proved or (self.status == "bounded" and not (self.obligation == "exact" and self.order_dependent))

    def runnable(self, allow_bounded: bool = False) -> bool:
        return self.on_by_default or (allow_bounded and self.status == "bounded")

    def to_json(self) -> dict:
        d = attrs.asdict(self)
        d["dtypes"] = list(self.dtypes)
        if not self.cases:
            del d["cases"]  # rules without optional inputs keep their record as it was
        return d

    @staticmethod
    def from_json(d: dict) -> "Verdict":
        fields = attrs.fields_dict(Verdict)
        return Verdict(**{k: d[k] for k in fields if k in d})


class RuleRejectedError(CuvilError):
    """A rule that is not proved was asked to run."""


def normalized_text(rule: Rule) -> str:
    text = "\n".join(line.split("#", 1)[0] for line in (rule.text or rule.name).splitlines())
    return re.sub(r"\s+", " ", text).strip()


def rule_key(rule: Rule) -> str:
    """Cache key of a rule's verdict: its text (comments and spacing aside) and the semantics' versions."""
    h = hashlib.sha256()
    for part in (normalized_text(rule), rule.proof, sem.SEMANTICS_VERSION, PROVER_VERSION):
        h.update(part.encode())
        h.update(b"\x00")
    return h.hexdigest()[:32]


# --- instances ---------------------------------------------------------------------------------------

@attrs.define
class Instance:
    shapes: Dict[str, Tuple[int, ...]]      # value variable -> shape
    attrs: Dict[str, Any]                   # attribute variable -> concrete value (None: symbolic float)
    rests: Dict[str, Dict[str, Any]]        # ..rest name -> attributes
    wild: Dict[int, Tuple[int, ...]]        # id of a Wildcard input pattern -> shape

    def describe(self) -> str:
        parts = [f"{k}=[{','.join(map(str, s))}]" for k, s in sorted(self.shapes.items())]
        parts += [f"{k}={v}" for k, v in sorted(self.attrs.items()) if v is not None]
        parts += [f"..{k}={{{', '.join(f'{a}={b}' for a, b in sorted(r.items()))}}}" for k, r in sorted(self.rests.items()) if r]
        return " ".join(parts)


def ops_in(e: Expr) -> Iterator[OpCall]:
    """Every op call of a pattern or replacement, outermost first."""
    if isinstance(e, OpCall):
        yield e
        for a in e.args:
            yield from ops_in(a)


def is_elementwise(rule: Rule) -> bool:
    if any(c.op not in ELEMENTWISE for c in itertools.chain(ops_in(rule.lhs), ops_in(rule.rhs))):
        return False
    if any(c.rest for c in ops_in(rule.lhs)):
        return False

    def uses_shape(e) -> bool:
        if isinstance(e, FuncCall):
            return e.name in SHAPE_GUARDS or any(uses_shape(a) for a in e.args)
        return any(uses_shape(x) for x in getattr(e, "args", ())) or any(
            uses_shape(getattr(e, k)) for k in ("left", "right") if hasattr(e, k))

    return not any(uses_shape(g) for g in rule.guards)


def _attr_type(op: str, name: str) -> Optional[int]:
    a = op_schema(op).attributes.get(name)
    return None if a is None else a.type


def _is_float_attr(op: str, name: str) -> bool:
    """Float scalars: FLOAT attributes, and lifted scalar inputs of the data's type (Clip's min/max,
    Pad's constant_value). These are symbolic in proofs."""
    if _attr_type(op, name) == onnx.AttributeProto.FLOAT:
        return True
    try:
        return any(n == name and kind == "data" for n, _, kind in lookup(op).lifted)
    except UnsupportedOpError:
        return False


def _leaf_vars(e: Expr, out: Dict[str, None]) -> None:
    if isinstance(e, Var):
        out.setdefault(e.name)
    elif isinstance(e, OpCall):
        for a in e.args:
            _leaf_vars(a, out)


def _input_is_bool(op: str, i: int) -> bool:
    try:
        schema = op_schema(op)
    except Exception:  # kernel-only ops (Fma)
        return False
    if not schema.inputs:
        return False
    formal = schema.inputs[min(i, len(schema.inputs) - 1)]
    allowed = {tc.type_param_str: list(tc.allowed_type_strs) for tc in schema.type_constraints}
    types = allowed.get(formal.type_str, [formal.type_str])
    return types == ["tensor(bool)"]


def var_kinds(rule: Rule) -> Dict[str, str]:
    """"bool" for value variables in boolean input positions (Where's condition, Dropout's training_mode)."""
    kinds: Dict[str, str] = {}
    for c in ops_in(rule.lhs):
        for i, a in enumerate(c.args):
            if isinstance(a, Var):
                kinds.setdefault(a.name, "bool" if _input_is_bool(c.op, i) else "float")
    return kinds


def _float_attr_vars(rule: Rule) -> Dict[str, Tuple[str, str]]:
    """Attribute variables bound to float attributes: they are symbolic in proofs."""
    out = {}
    for c in ops_in(rule.lhs):
        for name, p in c.attrs:
            if isinstance(p, Var) and _is_float_attr(c.op, name):
                out.setdefault(p.name, (c.op, name))
    return out


def elementwise_instance(rule: Rule) -> Instance:
    leaves: Dict[str, None] = {}
    _leaf_vars(rule.lhs, leaves)
    wild = {id(w): () for c in ops_in(rule.lhs) for w in c.args if isinstance(w, Wildcard)}
    attrs_ = {}
    for c in ops_in(rule.lhs):
        for name, p in c.attrs:
            if isinstance(p, Var):
                attrs_.setdefault(p.name, None if _is_float_attr(c.op, name) else attr_defaults(c.op).get(name))
    return Instance({k: () for k in leaves}, attrs_, {}, wild)


# Candidate shapes and attribute values for the instance search. Small on purpose: every element
# becomes a Z3 variable.
_POOL = [(2, 3), (1, 2, 3), (3,), (2, 1, 3), (), (1, 2, 2, 2)]


def _related(known: Sequence[Tuple[int, ...]]) -> List[Tuple[int, ...]]:
    out: List[Tuple[int, ...]] = []
    for s in known:
        cands = [s, (), (1,)] + [s[k:] for k in range(1, len(s))] + [(s[-1],)] if s else [s, (), (1,)]
        if len(s) >= 2:
            cands.append((s[1],) + (1,) * (len(s) - 2))
            cands.append((1,) + tuple(s[1:]))
        for c in cands:
            if c not in out:
                out.append(c)
    return out or list(_POOL)


def _window_inputs(op, known):
    # the last input is large enough for a 3x3 kernel over several output tiles (Winograd: 4x4 tiles)
    xs = [known[0]] if known[0] is not None else [(1, 2, 3, 3), (1, 1, 4, 4), (1, 2, 4), (1, 2, 6, 5)]
    for x in xs:
        c, k = x[1], len(x) - 2
        ws = []
        for m in (2, 1):
            for ks in (1, 2):
                ws.append((m, c) + (ks,) * k if op != "ConvTranspose" else (c, m) + (ks,) * k)
        ws.append((c, 1) + (1,) * k)
        if op == "Conv" and k == 2 and min(x[2:]) >= 5:
            ws.append((2, c, 3, 3))
        if op == "ConvTranspose" and k == 2:
            ws.append((c, 1, 4, 4))     # the usual learned 2x upsampling: a 4x4 kernel at stride 2
        for w in ([known[1]] if len(known) > 1 and known[1] is not None else ws):
            m = w[0] if op != "ConvTranspose" else w[1]
            yield [x, w, (m,)]


def _matmul_inputs(op, known):
    # the last: batched [B, H, S, D] operands (attention's Q · Kt, P · V)
    pairs = [((2, 3), (3, 4)), ((2, 3), (4, 3)), ((3, 2), (3, 4)), ((2, 2, 3), (3, 4)), ((3,), (3, 4)),
             ((1, 2, 2, 2), (1, 2, 2, 3))]
    for a, b in pairs:
        if known[0] is not None and known[0] != a:
            continue
        for c in [(4,), (2, 4), (1, 4), (), (2, 1), (3,), (2, 3)]:
            yield [a, b, c]
    if known[0] is not None and len(known) > 1 and known[1] is not None:
        a, b = known[0], known[1]
        if len(a) >= 2 and len(b) >= 2 and a[-1] == b[-2]:   # both known (attention: Q·Kt of two subpatterns)
            yield [a, b, ()]
    if known[0] is not None and len(known[0]) >= 3:
        a = known[0]   # batched products (attention's [B, H, S, D] operands): the same batch dims on the right
        for b in [a[:-2] + (a[-1], 2), a[:-2] + (a[-1], a[-2])]:
            yield [a, b, (b[-1],)]
    if known[0] is not None:
        a = known[0]
        for b in [(a[-1], 2), (a[0], 2), (2, a[-1]), (2, a[0])] if a else []:
            for c in [(b[-1],), (), (b[0],)]:
                yield [a, b, c]
    elif len(known) > 1 and known[1] is not None and len(known[1]) >= 1:
        b = known[1]
        for a in [(2, b[0]), (2, b[-1])] if len(b) >= 2 else [(2, b[0])]:
            for c in [(b[-1],), (), (2, b[-1])]:
                yield [a, b, c]


def _norm_inputs(op, known):
    xs = [known[0]] if known[0] is not None else [(1, 2, 3, 3), (2, 3), (1, 2, 3)]
    for x in xs:
        if len(x) < 2:
            continue
        c = (x[1],)
        if op == "LayerNormalization":
            for k in range(1, len(x)):
                yield [x, tuple(x[k:]), tuple(x[k:])]
        else:
            yield [x, c, c, c, c]


_SPECIFIC = {"Conv": _window_inputs, "ConvTranspose": _window_inputs, "Gemm": _matmul_inputs,
             "MatMul": _matmul_inputs, "BatchNormalization": _norm_inputs,
             "InstanceNormalization": _norm_inputs, "LayerNormalization": _norm_inputs}


def _perms(rank):
    ps = list(itertools.permutations(range(rank)))
    return [list(p) for p in ps[:24]]


def _attr_candidates(op: str, name: str, shapes: List[Optional[Tuple[int, ...]]]) -> List[Any]:
    x = shapes[0] if shapes and shapes[0] is not None else ()
    r = len(x)
    k = max(r - 2, 1)
    table = {
        "perm": lambda: _perms(r),
        "axis": lambda: sorted({0, -1, 1} if r >= 2 else {0, -1}),
        "axes": lambda: [[0], [-1], [1], [0, 1]] if op != "Unsqueeze" else [[0], [r], [1]],
        "keepdims": lambda: [1, 0],
        "shape": lambda: [[-1], list(reversed(x)), [1] + list(x), [int(np.prod(x))] if x else [1], list(x)],
        "pads": lambda: [[1] * (2 * k), [0] * k + [1] * k, [1] * k + [0] * k, [0] * (2 * r), [0, 1] * r],
        "strides": lambda: [[2] * k, [1] * k],
        "dilations": lambda: [[2] * k, [1] * k],
        "kernel_shape": lambda: [[2] * k, [1] * k, [3] * k],
        "group": lambda: [1] + ([x[1]] if r >= 2 else []),
        "transA": lambda: [0, 1], "transB": lambda: [0, 1],
        "repeats": lambda: [[1] * r, [2] + [1] * (r - 1)] if r else [[]],
        "split": lambda: [[1, x[0] - 1]] if r and x[0] > 1 else [],
        "starts": lambda: [[0], [1]], "ends": lambda: [[1], [2], [9_223_372_036_854_775_807]],
        "steps": lambda: [[1], [2]],
        "to": lambda: [int(onnx.TensorProto.FLOAT)],
        "count_include_pad": lambda: [0, 1], "ceil_mode": lambda: [0, 1],
        "mode": lambda: ["constant"],
        "allowzero": lambda: [0],
    }
    fn = table.get(name)
    vals = fn() if fn else []
    default = attr_defaults(op).get(name)
    if default is not None and not any(_eq(default, v) for v in vals):
        vals = [default] + vals
    return vals


def _rest_candidates(op: str, shapes, mentioned) -> List[Dict[str, Any]]:
    x = shapes[0] if shapes and shapes[0] is not None else ()
    k = max(len(x) - 2, 1)
    opts: List[Dict[str, Any]] = [{}]
    if op in ("Conv", "ConvTranspose", "MaxPool", "AveragePool", "LpPool"):
        opts += [{"pads": [1] * (2 * k)}, {"strides": [2] * k}, {"dilations": [2] * k}]
        if op in ("Conv", "ConvTranspose") and len(x) >= 2 and x[1] > 1:
            opts.append({"group": x[1]})
        if op not in ("Conv", "ConvTranspose"):
            opts = [dict(o, kernel_shape=[2] * k) for o in opts]
    elif op == "Gemm":
        opts += [{"transB": 1}, {"transA": 1}, {"alpha": 0.5}]
    return [{a: v for a, v in o.items() if a not in mentioned} for o in opts]


def _eq(a, b) -> bool:
    return (a == b) if not isinstance(a, np.ndarray) else False


def _infer(op: str, in_shapes, attrs_) -> Optional[Tuple[int, ...]]:
    g = Graph()
    vals = [None if s is None else g.add_input(f"i{k}", TensorType(9 if _input_is_bool(op, k) else 1, s))
            for k, s in enumerate(in_shapes)]
    try:
        node = g.add_node(op, vals, attrs_)
    except (ShapeError, UnsupportedOpError, ValueError, TypeError, IndexError, KeyError, ZeroDivisionError):
        return None
    t = node.outputs[0].type
    return tuple(t.shape) if t.is_static else None


def search_instances(rule: Rule, limit: int = MAX_INSTANCES) -> List[Instance]:
    """Concrete shapes/attributes on which the rule's pattern matches (guards included) and its
    replacement type-checks to the same type."""
    calls = list(_post_order(rule.lhs))
    float_vars = _float_attr_vars(rule)
    rank_ok = _rank_guards(rule)
    found: List[Instance] = []
    seen = set()
    tries = [0]

    def dfs(i, shapes, attrs_, rests, wild, outs):
        if len(found) >= limit or tries[0] > MAX_SEARCH:
            return
        if i == len(calls):
            tries[0] += 1
            inst = Instance(dict(shapes), dict(attrs_), {k: dict(v) for k, v in rests.items()}, dict(wild))
            key = inst.describe()
            if key not in seen and _check_instance(rule, inst):
                seen.add(key)
                found.append(inst)
            return
        c = calls[i]
        known = []
        for a in c.args:
            if isinstance(a, Var):
                known.append(shapes.get(a.name))
            elif isinstance(a, OpCall):
                known.append(outs[id(a)])
            elif isinstance(a, Num):
                known.append(())
            elif isinstance(a, Wildcard):
                known.append(wild.get(id(a)))
            else:
                known.append(None)
        for full in _input_options(c.op, known, len(c.args)):
            tries[0] += 1
            if tries[0] > MAX_SEARCH or len(found) >= limit:
                return
            s2, w2 = dict(shapes), dict(wild)
            ok = True
            for a, s in zip(c.args, full):
                if isinstance(a, Var):
                    if s2.setdefault(a.name, s) != s or not rank_ok(a.name, s):
                        ok = False
                elif isinstance(a, Wildcard):
                    w2[id(a)] = s
            if not ok:
                continue
            for a_choice, r_choice in _attr_options(c, full, attrs_, rests, float_vars):
                at = _node_attrs(c, a_choice, r_choice, float_vars)
                out = _infer(c.op, list(full), at)
                if out is None:
                    continue
                o2 = dict(outs)
                o2[id(c)] = out
                rs = dict(rests)
                if c.rest:
                    rs[c.rest] = r_choice
                dfs(i + 1, s2, a_choice, rs, w2, o2)
                if len(found) >= limit or tries[0] > MAX_SEARCH:
                    return

    dfs(0, {}, {}, {}, {}, {})
    return found


_RANK_TESTS = {"==": lambda r, n: r == n, "!=": lambda r, n: r != n, "<": lambda r, n: r < n,
               "<=": lambda r, n: r <= n, ">": lambda r, n: r > n, ">=": lambda r, n: r >= n}


def _rank_guards(rule: Rule):
    """``ok(var, shape)``: whether ``shape`` passes the rule's guards ``rank(var) OP N`` (N a literal). The
    search prunes a shape that fails one as soon as the variable is bound, instead of after building the
    whole pattern: a large pattern (attention's two copies of the score chain) fits the budget."""
    tests: Dict[str, List] = {}
    for gd in rule.guards:
        if (isinstance(gd, Compare) and isinstance(gd.left, FuncCall) and gd.left.name == "rank"
                and len(gd.left.args) == 1 and isinstance(gd.left.args[0], Var) and isinstance(gd.right, Num)
                and gd.op in _RANK_TESTS):
            tests.setdefault(gd.left.args[0].name, []).append((_RANK_TESTS[gd.op], int(gd.right.value)))
    return lambda name, shape: all(t(len(shape), n) for t, n in tests.get(name, ()))


def _post_order(e: Expr) -> Iterator[OpCall]:
    if isinstance(e, OpCall):
        for a in e.args:
            yield from _post_order(a)
        yield e


def _input_options(op: str, known, n) -> Iterator[List[Tuple[int, ...]]]:
    known = list(known)
    spec = _SPECIFIC.get(op)
    produced = set()
    if spec is not None:
        for full in spec(op, known + [None] * 5):
            full = list(full[:n])
            if len(full) == n and all(k is None or k == f for k, f in zip(known, full)):
                if tuple(full) not in produced:
                    produced.add(tuple(full))
                    yield full
        return  # the op's own generator knows its shapes; the generic one would only waste the budget
    unknown = [k for k, s in enumerate(known) if s is None]
    base = [s for s in known if s is not None]
    pools = [(_related(base) if base else list(_POOL)) for _ in unknown]
    if unknown and not base:  # nothing known: the first unknown comes from the pool, the rest relate to it
        for first in _POOL:
            rest_pool = _related([first])
            for combo in itertools.product(*([[first]] + [rest_pool] * (len(unknown) - 1))):
                full = list(known)
                for k, s in zip(unknown, combo):
                    full[k] = s
                if tuple(full) not in produced:
                    produced.add(tuple(full))
                    yield full
        return
    for combo in itertools.islice(itertools.product(*pools), MAX_GENERIC):
        full = list(known)
        for k, s in zip(unknown, combo):
            full[k] = s
        if tuple(full) not in produced:
            produced.add(tuple(full))
            yield full


def _attr_options(c: OpCall, shapes, attrs_, rests, float_vars):
    """(attribute-variable choices, ..rest choice) pairs for one op of the pattern."""
    choices: List[Tuple[str, List[Any]]] = []
    for name, p in c.attrs:
        if isinstance(p, Var) and p.name not in attrs_ and p.name not in float_vars:
            choices.append((p.name, _attr_candidates(c.op, name, shapes)))
        elif isinstance(p, ListLit):
            for x in p.items:
                if isinstance(x, Var) and x.name not in attrs_:
                    choices.append((x.name, [1, 2, 0, -1]))  # non-trivial values first
    mentioned = {name for name, _ in c.attrs}
    rest_opts = [rests[c.rest]] if c.rest and c.rest in rests else (
        _rest_candidates(c.op, shapes, mentioned) if c.rest else [{}])
    names = [n for n, _ in choices]
    for combo in itertools.product(*[vals for _, vals in choices]):
        a2 = dict(attrs_)
        a2.update(dict(zip(names, combo)))
        for fv in float_vars:
            a2.setdefault(fv, None)
        for r in rest_opts:
            yield a2, r


def _node_attrs(c: OpCall, attrs_, rest, float_vars) -> Dict[str, Any]:
    """Concrete attributes for shape inference (symbolic floats get a placeholder value)."""
    out = dict(rest)
    for name, p in c.attrs:
        v = _attr_concrete(p, attrs_, c.op, name)
        if v is not _SKIP:
            out[name] = v
    return out


_SKIP = object()


def _attr_concrete(p, attrs_, op, name):
    if isinstance(p, Num):
        return p.value
    if isinstance(p, ListLit):
        return [_attr_concrete(x, attrs_, op, name) for x in p.items]
    if isinstance(p, Var):
        v = attrs_.get(p.name)
        if v is None:
            return 0.5 if _is_float_attr(op, name) else _SKIP
        return v
    return _SKIP  # wildcard: the default


def _check_instance(rule: Rule, inst: Instance) -> bool:
    """Build the instance as a graph: the pattern must match it (structural guards too) and the
    replacement must type-check to the root's type. Guards on values and float attributes are left to
    the proof, as assumptions."""
    fv = _float_attr_vars(rule)
    rule = attrs.evolve(rule, guards=tuple(g for g in rule.guards if not _value_guard(g, rule, fv)))
    g = Graph()
    const_vars = {a.name for gd in rule.guards if isinstance(gd, FuncCall) and gd.name == "const" for a in gd.args
                  if isinstance(a, Var)}
    vals = {}
    kinds = var_kinds(rule)
    for name, shape in inst.shapes.items():
        boolean = kinds.get(name) == "bool"
        if name in const_vars:
            vals[name] = g.const(np.full(shape, True if boolean else 0.5, np.bool_ if boolean else np.float32), name)
        else:
            vals[name] = g.add_input(name, TensorType(9 if boolean else 1, shape))
    try:
        root = _build_lhs(rule.lhs, g, vals, inst)
    except (ShapeError, UnsupportedOpError, BuildError, ValueError, TypeError, KeyError):
        return False
    b = match(rule, root, g)
    if b is None:
        return False
    try:
        new = build(rule, b, g, [])
    except BuildError:
        return False
    return new.type == root.type


def _build_lhs(e: Expr, g: Graph, vals, inst: Instance, dtype: DType = DType.FLOAT):
    if isinstance(e, Var):
        return vals[e.name]
    if isinstance(e, Wildcard):
        return g.add_input("wild", TensorType(dtype, inst.wild[id(e)]))
    if isinstance(e, Num):
        return g.const(np.asarray(e.value, dtype.numpy), "lit")
    ins = [g.const(np.asarray(bool(a.value)), "lit") if isinstance(a, Num) and _input_is_bool(e.op, k)
           else _build_lhs(a, g, vals, inst, dtype) for k, a in enumerate(e.args)]
    at = dict(inst.rests.get(e.rest, {})) if e.rest else {}
    for name, p in e.attrs:
        v = _attr_concrete(p, inst.attrs, e.op, name)
        if v is not _SKIP:
            at[name] = v
        elif isinstance(p, Wildcard) and name in attr_defaults(e.op):
            at[name] = attr_defaults(e.op)[name]
    return g.add_node(e.op, ins, at).outputs[0]


# --- adversarial instances -----------------------------------------------------------------------------
# Drawn at random, each attribute variable independently: asymmetric pads, reduced axes of 3 to 8
# elements, boundary values (0, 1, dim-1, dim, dim+1, negative axes, huge ends) and random ones.

_BIG = 9_223_372_036_854_775_807


def _rand_dim(rng, max_dim: int) -> int:
    return int(rng.choice([1, 2] + list(range(3, max_dim + 1)) * 2))


def _rand_shape(rng, max_dim: int, rank: Optional[int] = None) -> Tuple[int, ...]:
    r = int(rng.choice([0, 1, 2, 2, 3, 3, 4, 4])) if rank is None else rank
    if rng.random() < 0.3:  # all dims equal: permutations and reshapes that keep the shape
        return (_rand_dim(rng, max_dim),) * r
    return tuple(_rand_dim(rng, max_dim) for _ in range(r))


def _rand_inputs(op: str, known, n: int, rng, max_dim: int) -> Optional[List[Tuple[int, ...]]]:
    """Input shapes for one op: the known ones kept, the others drawn (related to the known ones, so the
    op's shape rules hold often enough)."""
    known = list(known) + [None] * 5
    dim = lambda: _rand_dim(rng, max_dim)  # noqa: E731
    if op in ("Conv", "ConvTranspose"):
        x = known[0] if known[0] is not None else (int(rng.integers(1, 3)), int(rng.integers(1, 4))) + tuple(dim() for _ in range(int(rng.choice([1, 2, 2]))))
        k = len(x) - 2
        if known[1] is not None:
            w = known[1]
        else:
            m, c = int(rng.integers(1, 4)), x[1] if len(x) > 1 else 1
            ks = tuple(int(rng.integers(1, 4)) for _ in range(k))
            w = (m, c) + ks if op == "Conv" else (c, m) + ks
        m = w[0] if op == "Conv" else (w[1] if len(w) > 1 else 1)
        return [x, w, known[2] if known[2] is not None else (m,)][:n]
    if op in ("MatMul", "Gemm"):
        a = known[0] if known[0] is not None else ((dim(), dim()) if rng.random() < 0.8 else (dim(), dim(), dim()))
        kdim = a[-1] if a else dim()
        if known[1] is not None:
            b = known[1]
        else:
            b = (kdim, dim()) if rng.random() < 0.5 or op == "MatMul" else (dim(), kdim)
            if op == "Gemm" and rng.random() < 0.3:
                b = (a[0], dim()) if a else b  # transA
        nn = b[-1] if b else 1
        c = known[2] if known[2] is not None else [(nn,), (), (1, nn), (a[0] if a else 1, nn), (a[0] if a else 1, 1)][int(rng.integers(0, 5))]
        return [a, b, c][:n]
    if op in ("BatchNormalization", "InstanceNormalization"):
        x = known[0] if known[0] is not None else (int(rng.integers(1, 3)),) + tuple(dim() for _ in range(int(rng.integers(1, 4))))
        c = (x[1],) if len(x) > 1 else (1,)
        return [x] + [known[i] if known[i] is not None else c for i in range(1, n)]
    if op == "LayerNormalization":
        x = known[0] if known[0] is not None else _rand_shape(rng, max_dim, int(rng.integers(2, 5)))
        tail = tuple(x[int(rng.integers(1, len(x))):]) if len(x) > 1 else tuple(x)
        return [x] + [known[i] if known[i] is not None else tail for i in range(1, n)]
    base = next((s for s in known if s is not None), None)
    out = []
    for s in known[:n]:
        if s is not None:
            out.append(s)
        elif base is None or (base == () and rng.random() < 0.7):  # a scalar broadcasts against anything
            drawn = _rand_shape(rng, max_dim)
            base = drawn if base is None else base
            out.append(drawn)
        else:
            if rng.random() < 0.4:
                out.append(base)
                continue
            sh = tuple(base[int(rng.integers(0, len(base) + 1)):]) if rng.random() < 0.6 else tuple(base)
            if rng.random() < 0.5:  # broadcast: some dims 1 (per-channel constants)
                sh = tuple(1 if rng.random() < 0.5 else d for d in sh)
            out.append(sh)
    return out


def _rand_int_item(rng, shape) -> int:
    dims = list(shape) or [1]
    d = int(rng.choice(dims))
    return int(rng.choice([0, 1, 2, 3, -1, d - 1, d, d + 1, d - 1, d, d + 1, -d, -d - 1, _BIG, -_BIG]))


def _rand_attr(op: str, name: str, shapes, rng, max_dim: int, item: bool = False):
    """One attribute value (or one item of a list attribute when ``item``), drawn adversarially."""
    x = shapes[0] if shapes and shapes[0] is not None else ()
    r = len(x)
    k = max(r - 2, 1)
    if name == "pads":
        return int(rng.integers(0, 4)) if item else [int(rng.integers(0, 4)) for _ in range(2 * (k if op != "Pad" else r))]
    if name in ("strides", "dilations", "kernel_shape"):
        hi = {"strides": 4, "dilations": 3, "kernel_shape": 4}[name]
        return int(rng.integers(1, hi)) if item else [int(rng.integers(1, hi)) for _ in range(k)]
    if item:
        return _rand_int_item(rng, x)
    if name == "perm":
        return [int(i) for i in rng.permutation(r)]
    if name == "axis":
        return int(rng.integers(-r, r)) if r else 0
    if name == "axes":
        top = r + 1 if op == "Unsqueeze" else r
        if not top:
            return [0]
        m = int(rng.integers(1, top + 1))
        picks = sorted(int(a) for a in rng.choice(top, m, replace=False))
        return [a - top if rng.random() < 0.3 else a for a in picks]
    if name in ("starts", "ends"):
        return [_rand_int_item(rng, x)]
    if name == "steps":
        return [int(rng.choice([1, 1, 2, -1]))]
    if name == "shape":
        opts = [list(x), list(reversed(x)), [-1], [1] + list(x), [int(np.prod(x))] if x else [1], list(x) + [1],
                [0] * r, [-1, x[-1]] if x else [1]]
        return opts[int(rng.integers(0, len(opts)))]
    if name == "group":
        return int(rng.choice([1, x[1]])) if r >= 2 else 1
    if name == "mode" and op == "Pad":
        return str(rng.choice(["constant", "reflect", "edge"]))
    if name in ("keepdims", "transA", "transB", "count_include_pad", "ceil_mode", "noop_with_empty_axes"):
        return int(rng.integers(0, 2))
    if name == "repeats":
        return [int(rng.integers(1, 3)) for _ in range(r)]
    if name == "split":
        return [1, x[0] - 1] if r and x[0] > 1 else [1]
    cands = _attr_candidates(op, name, list(shapes))
    return cands[int(rng.integers(0, len(cands)))] if cands else _SKIP


def _rand_rest(op: str, shapes, mentioned, rng, max_dim: int) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    if op in ("Conv", "ConvTranspose", "MaxPool", "AveragePool", "LpPool"):
        for name in ("pads", "strides", "dilations"):
            if rng.random() < 0.5:
                out[name] = _rand_attr(op, name, shapes, rng, max_dim)
        if op in ("Conv", "ConvTranspose") and rng.random() < 0.3:
            out["group"] = _rand_attr(op, "group", shapes, rng, max_dim)
        if op not in ("Conv", "ConvTranspose"):
            out["kernel_shape"] = _rand_attr(op, "kernel_shape", shapes, rng, max_dim)
            if op == "AveragePool" and rng.random() < 0.5:
                out["count_include_pad"] = 1
    elif op == "Gemm":
        for name in ("transA", "transB"):
            if rng.random() < 0.4:
                out[name] = 1
        if rng.random() < 0.3:
            out["alpha"] = float(rng.choice([0.5, 2.0, -1.5]))
        if rng.random() < 0.3:
            out["beta"] = float(rng.choice([0.5, 0.0, 3.0]))
    elif rng.random() < 0.5:
        for name in ("axis", "keepdims"):
            if name in attr_defaults(op):
                out[name] = _rand_attr(op, name, shapes, rng, max_dim)
    return {a: v for a, v in out.items() if a not in mentioned and v is not _SKIP}


def draw_instances(rule: Rule, rng: np.random.Generator, count: int, max_dim: int, max_elems: int) -> List[Instance]:
    """Up to ``count`` distinct instances on which the pattern matches (guards included) and the
    replacement type-checks, drawn at random: every attribute variable independently."""
    calls = list(_post_order(rule.lhs))
    float_vars = _float_attr_vars(rule)
    rank_ok = _rank_guards(rule)
    found: List[Instance] = []
    seen = set()
    for _ in range(DRAW_ATTEMPTS):
        if len(found) >= count:
            break
        shapes: Dict[str, Tuple[int, ...]] = {}
        attrs_: Dict[str, Any] = {}
        rests: Dict[str, Dict[str, Any]] = {}
        wild: Dict[int, Tuple[int, ...]] = {}
        outs: Dict[int, Tuple[int, ...]] = {}
        ok = True
        for c in calls:
            known = []
            for a in c.args:
                known.append(shapes.get(a.name) if isinstance(a, Var) else outs.get(id(a)) if isinstance(a, OpCall)
                             else () if isinstance(a, Num) else wild.get(id(a)) if isinstance(a, Wildcard) else None)
            full = _rand_inputs(c.op, known, len(c.args), rng, max_dim)
            for a, sh in zip(c.args, full):
                if isinstance(a, Var):
                    ok = ok and shapes.setdefault(a.name, sh) == sh
                elif isinstance(a, Wildcard):
                    wild[id(a)] = sh
            if not ok or any(int(np.prod(sh)) > max_elems for sh in full):
                ok = False
                break
            for name, p in c.attrs:
                if isinstance(p, Var) and p.name not in attrs_:
                    attrs_[p.name] = None if p.name in float_vars else _rand_attr(c.op, name, full, rng, max_dim)
                elif isinstance(p, ListLit):
                    for x in p.items:
                        if isinstance(x, Var) and x.name not in attrs_:
                            attrs_[x.name] = _rand_attr(c.op, name, full, rng, max_dim, item=True)
            if any(v is _SKIP for v in attrs_.values()):
                ok = False
                break
            if c.rest:
                if c.rest not in rests:
                    rests[c.rest] = _rand_rest(c.op, full, {n for n, _ in c.attrs}, rng, max_dim)
            out = _infer(c.op, list(full), _node_attrs(c, attrs_, rests.get(c.rest, {}) if c.rest else {}, float_vars))
            if out is None or int(np.prod(out)) > max_elems:
                ok = False
                break
            outs[id(c)] = out
        if not ok:
            continue
        inst = Instance(shapes, attrs_, rests, wild)
        key = inst.describe()
        if key in seen:
            continue
        try:
            good = _check_instance(rule, inst)
        except Exception:  # an instance the op registry rejects in an unforeseen way is not an instance
            good = False
        if good:
            seen.add(key)
            found.append(inst)
    return found


def _uses_kernel_ops(rule: Rule) -> bool:
    """Ops that exist only inside fused kernels (Fma): no ONNX graph can hold them."""
    return any(c.op not in ELEMENTWISE or c.op == "Fma" for c in itertools.chain(ops_in(rule.lhs), ops_in(rule.rhs)))


def _vector_instance(inst: Instance, n: int = 256) -> Instance:
    """An elementwise rule's scalar instance widened to vectors: many values in one run."""
    return Instance({k: (n,) for k in inst.shapes}, dict(inst.attrs), dict(inst.rests), {k: (n,) for k in inst.wild})


def max_dim_of(instances: Sequence[Instance]) -> int:
    return max((d for i in instances for s in list(i.shapes.values()) + list(i.wild.values()) for d in s), default=0)


def build_sample(rule: Rule, inst: Instance, dtype: DType, rng: np.random.Generator, exact: bool) -> Optional[Sample]:
    """The instance as a graph computing both sides (the pattern's root and the built replacement), with
    concrete values for ``const`` operands and float attributes; None if the pattern does not match these
    values (a guard on values failed)."""
    fv = _float_attr_vars(rule)
    at = dict(inst.attrs)
    for name in fv:
        if at.get(name) is None:
            at[name] = float(rng.choice([1e-5, 0.5, 2.0, -1.5, 0.0, 1.0])) if exact else float(rng.uniform(0.01, 3.0))
    inst = attrs.evolve(inst, attrs=at)
    g = Graph()
    const_vars = {a.name for gd in rule.guards if isinstance(gd, FuncCall) and gd.name == "const" for a in gd.args
                  if isinstance(a, Var)}
    kinds = var_kinds(rule)
    vals = {}
    for k, (name, shape) in enumerate(inst.shapes.items()):
        boolean = kinds.get(name) == "bool"
        if name in const_vars:
            arr = draw_values(rng, shape, np.bool_ if boolean else dtype.numpy, exact, k, "bool" if boolean else "float")
            if not exact and not boolean:
                arr = np.abs(arr) + np.asarray(0.25, dtype.numpy)  # variances, scales: the pattern's domain
            vals[name] = g.const(arr, name)
        else:
            vals[name] = g.add_input(name, TensorType(DType.BOOL if boolean else dtype, shape))
    root = _build_lhs(rule.lhs, g, vals, inst, dtype)
    b = match(rule, root, g)
    if b is None:
        return None
    try:
        new = build(rule, b, g, [])
    except BuildError:
        return None
    if new.type != root.type:
        return None
    g.add_output(root, "lhs")
    g.add_output(new, "rhs")
    return Sample(g, root, new, inst.describe())


def random_refutation(rule: Rule, instances: Sequence[Instance], rng: np.random.Generator,
                      elementwise: bool = False) -> Tuple[Optional[str], int]:
    """Both sides run by onnx.reference: float32 for exact rules; float64 for real ones (float32 where a
    rule only type-checks there, e.g. it casts to float)."""
    exact = rule.proof == "exact"
    samples = []
    for inst in instances:
        for dtype in (DType.FLOAT,) if exact else (DType.DOUBLE, DType.FLOAT):
            try:
                s = build_sample(rule, inst, dtype, rng, exact)
            except Exception:  # noqa: BLE001 - not an instance in this dtype: the others still count
                s = None
            if s is not None:
                samples.append(s)
                break
    return refute(samples, rng, exact, var_kinds(rule), elementwise)


SEMANTIC_DRAWS = 2       # value draws per bounded instance for the semantic refuter
SEMANTIC_ELEMENTS = 12   # output elements compared per draw
SCALAR_DRAWS = 200       # value draws for an elementwise rule's scalar instance
FORMAT_TIMEOUT_MS = 1000  # per extra float format of an elementwise exact rule (not covered if it runs out)


def semantic_refutation(rule: Rule, instances: Sequence[Instance], rng: np.random.Generator, float_vars,
                        draws: int) -> Optional[str]:
    """Random testing against Cuvil's own float32 semantics (``prove exact`` only): the symbolic sides
    evaluated on concrete values. It sees what onnx.reference cannot: the order of a sum (numpy's
    reductions are order-blind) and ops onnx.reference lacks (Fma). Only a difference between two
    concrete floats counts; terms left symbolic (transcendentals, training-mode masks) are inconclusive."""
    if rule.proof != "exact":
        return None
    kinds = var_kinds(rule)
    for inst in instances:
        dom = sem.FP32Domain()
        env = _Env(dom, inst, float_vars, kinds)
        lhs = np.asarray(_eval(rule.lhs, env), dtype=object)
        rhs = np.asarray(_eval(rule.rhs, env), dtype=object)
        if lhs.shape != rhs.shape or all(z3.is_const(t) for t in itertools.chain(lhs.flat, rhs.flat)):
            continue  # both sides only move elements: the onnx.reference runs already compared them
        spots = list(np.ndindex(*lhs.shape))
        if len(spots) > SEMANTIC_ELEMENTS:  # a sample of the outputs, the first and last included
            pick = rng.choice(len(spots), SEMANTIC_ELEMENTS - 2, replace=False)
            spots = [spots[0], spots[-1]] + [spots[int(k)] for k in pick]
        for draw in range(draws):
            subs, shown = [], []
            for k, (name, arr) in enumerate(env.values.items()):
                kind = kinds.get(name, "float")
                vals = draw_values(rng, arr.shape, np.float32, True, draw + k, kind)
                shown.append(f"{name} = {_show_values(vals)}")
                for idx in np.ndindex(*arr.shape):
                    v = bool(vals[idx]) if kind == "bool" else dom.const(float(vals[idx]))
                    subs.append((arr[idx], z3.BoolVal(v) if kind == "bool" else v))
            for name, var in env.attrs.items():
                if isinstance(var, z3.ExprRef):
                    v = float(rng.choice([1e-5, 0.5, 2.0, -1.5, 0.0, -0.0, 1.0, np.inf, np.nan]))
                    shown.append(f"{name} = {sem.format_value(v)}")
                    subs.append((var, dom.const(v)))
            for idx in spots:
                a, b = (z3.simplify(z3.substitute(t, *subs)) if isinstance(t, z3.ExprRef) else t
                        for t in (lhs[idx], rhs[idx]))
                if not all(isinstance(t, (z3.FPNumRef, z3.BoolRef)) for t in (a, b)):
                    continue
                same = z3.simplify(dom.equal(a, b))
                if z3.is_false(same):
                    at = f"[{','.join(map(str, idx))}]" if idx else ""
                    where = inst.describe() + " " if any(inst.shapes.values()) or inst.wild else ""
                    return (f"{where}{', '.join(shown)}: lhs{at} = "
                            f"{sem.format_value(dom.value_of(None, a))}, rhs{at} = {sem.format_value(dom.value_of(None, b))}")
    return None


SEMANTIC_ORACLE = "Cuvil's float32 semantics on concrete values"


def _onnx_oracle(rule: Rule) -> str:
    return "onnx.reference, float32, bit for bit" if rule.proof == "exact" else "onnx.reference, relative tolerance"


def _show_values(vals: np.ndarray, limit: int = 6) -> str:
    flat = [sem.format_value(v.item()) for v in np.asarray(vals).reshape(-1)[:limit]]
    if np.ndim(vals) == 0:
        return flat[0]
    return "[" + ", ".join(flat) + (", ..." if np.size(vals) > limit else "") + "]"


# --- evaluation on symbolic tensors -----------------------------------------------------------------

class _Env:
    def __init__(self, dom: sem.Domain, inst: Instance, float_vars, kinds):
        self.dom, self.inst = dom, inst
        self.values = {name: sem.symbolic(dom, name, shape, kinds.get(name, "float"))
                       for name, shape in inst.shapes.items()}
        self.wild = {k: sem.symbolic(dom, f"_{n}", s) for n, (k, s) in enumerate(inst.wild.items())}
        self.attrs: Dict[str, Any] = {}
        self.calls: List[Tuple[str, Tuple[Tuple[int, ...], ...], Dict[str, Any]]] = []  # non-elementwise ops
        for name, v in inst.attrs.items():
            self.attrs[name] = dom.var(name) if name in float_vars else v


def _eval(e: Expr, env: _Env) -> np.ndarray:
    dom = env.dom
    if isinstance(e, Var):
        if e.name in env.values:
            return env.values[e.name]
        v = env.attrs[e.name]  # an attribute used as a scalar input
        return sem.constant_tensor(dom, v) if not isinstance(v, z3.ExprRef) else _scalar(v)
    if isinstance(e, Wildcard):
        return env.wild[id(e)]
    if isinstance(e, Num):
        return sem.constant_tensor(dom, float(e.value))
    if isinstance(e, OpCall):
        ins = [np.asarray(bool(a.value)) if isinstance(a, Num) and _input_is_bool(e.op, k) else _eval(a, env)
               for k, a in enumerate(e.args)]
        at = dict(env.inst.rests.get(e.rest, {})) if e.rest else {}
        for name, p in e.attrs:
            v = _attr_symbolic(p, env)
            if v is not _SKIP:
                at[name] = v
        if e.op not in ELEMENTWISE and isinstance(dom, sem.FP32Domain):
            env.calls.append((e.op, tuple(np.shape(i) for i in ins), at))
        if e.op == "Fma":
            return sem._map(lambda a, b, c: z3.fpFMA(z3.RNE(), a, b, c) if dom.name == "exact" else a * b + c, *ins)
        return sem.evaluate(dom, e.op, ins, at)[0]
    raise TypeError(e)


def _guard_terms(e, env: _Env):
    """A guard operand as a list of Z3 terms (one per element), or a Python number; None if concrete-only."""
    dom = env.dom
    if isinstance(e, Num):
        return e.value
    if isinstance(e, Var):
        if e.name in env.values:
            return list(env.values[e.name].reshape(-1))
        return env.attrs.get(e.name)
    if isinstance(e, OpCall) and e.op in ("Add", "Sub", "Mul", "Div", "Neg"):
        args = [_guard_terms(a, env) for a in e.args]
        if any(a is None for a in args):
            return None
        fn = {"Add": dom.add, "Sub": dom.sub, "Mul": dom.mul, "Div": dom.div, "Neg": dom.neg}[e.op]
        return _pointwise(lambda *xs: fn(*[dom.lift(x) for x in xs]), args)
    return None


def _pointwise(fn, args):
    n = max((len(a) for a in args if isinstance(a, list)), default=0)
    if n == 0:
        return fn(*args)
    return [fn(*[a[i] if isinstance(a, list) else a for a in args]) for i in range(n)]


def _guard_assumptions(gd, env: _Env) -> List[Any]:
    dom = env.dom
    left, right = _guard_terms(gd.left, env), _guard_terms(gd.right, env)
    if left is None or right is None:
        return []

    def cmp(a, b):
        if isinstance(a, z3.BoolRef) or isinstance(b, z3.BoolRef):
            a, b = (z3.BoolVal(bool(x)) if not isinstance(x, z3.ExprRef) else x for x in (a, b))
            eq = a == b
            return eq if gd.op == "==" else z3.Not(eq) if gd.op == "!=" else z3.BoolVal(False)
        a, b = dom.lift(a), dom.lift(b)
        return {"==": lambda: dom.eq(a, b), "!=": lambda: z3.Not(dom.eq(a, b)), "<": lambda: dom.lt(a, b),
                "<=": lambda: dom.le(a, b), ">": lambda: dom.lt(b, a), ">=": lambda: dom.le(b, a)}[gd.op]()

    out = _pointwise(cmp, [left, right])
    return out if isinstance(out, list) else [out]


def _scalar(v) -> np.ndarray:
    out = np.empty((), dtype=object)
    out[()] = v
    return out


def _attr_symbolic(p, env: _Env):
    if isinstance(p, Num):
        return p.value
    if isinstance(p, ListLit):
        return [_attr_symbolic(x, env) for x in p.items]
    if isinstance(p, Var):
        v = env.attrs.get(p.name)
        return _SKIP if v is None else v
    return _SKIP


# --- the obligation ------------------------------------------------------------------------------------

def _name_attr_wildcards(rule: Rule) -> Rule:
    """``attr=_`` matches any value, so the proof must cover any value: each becomes a fresh variable."""
    counter = itertools.count()

    def fix(e):
        if isinstance(e, OpCall):
            at = tuple((n, Var(f"_any{next(counter)}", p.loc) if isinstance(p, Wildcard) else p) for n, p in e.attrs)
            return attrs.evolve(e, args=tuple(fix(a) for a in e.args), attrs=at)
        return e

    return attrs.evolve(rule, lhs=fix(rule.lhs))


def _value_guard(gd, rule: Rule, float_vars) -> bool:
    """A comparison on values or float attributes: an assumption of the proof, not a search filter."""
    leaves: Dict[str, None] = {}
    _leaf_vars(rule.lhs, leaves)

    def refs(e) -> bool:
        if isinstance(e, Var):
            return e.name in leaves or e.name in float_vars
        if isinstance(e, FuncCall):
            return False
        return any(refs(x) for x in getattr(e, "args", ())) or any(refs(getattr(e, k)) for k in ("left", "right") if hasattr(e, k))

    return not isinstance(gd, FuncCall) and refs(gd)


FLOAT_DTYPES = ("float", "float16", "bfloat16", "double")
ALL_DTYPES = ("*",)  # the rule only moves elements: every element type


def prove_rule(rule: Rule, timeout_ms: int = DEFAULT_TIMEOUT_MS) -> Verdict:
    """The rule's verdict. Never raises: a failure of the prover itself is an ``unknown`` verdict.

    A rule with optional inputs (``b?``) has one obligation per case (each optional input present or
    absent, :func:`cuvil.dsl.cases.expand_cases`); each is proved on its own and the verdict is the weakest
    (:func:`combine_cases`): proved only if every case is proved, refuted if one case is."""
    cases = expand_cases(rule)
    if len(cases) == 1:
        return _prove_case(rule, rule_key(rule), timeout_ms)
    t0 = time.perf_counter()
    return combine_cases(rule, [(label, _prove_case(case, rule_key(rule), timeout_ms)) for label, case in cases],
                         round(1e3 * (time.perf_counter() - t0), 1))


def _prove_case(rule: Rule, key: str, timeout_ms: int) -> Verdict:
    t0 = time.perf_counter()

    def verdict(status, shapes, cex=None, detail=None, **kw):
        return Verdict(rule.name, rule.proof, status, shapes, round(1e3 * (time.perf_counter() - t0), 1), cex,
                       detail, key, **kw)

    try:
        return _prove(rule, timeout_ms, verdict)
    except Exception as e:  # noqa: BLE001 - any failure of the prover is a verdict with its reason
        return verdict("unknown", "", detail=f"the prover failed on this rule: {type(e).__name__}: {e}"[:400])


# From the strongest verdict to the weakest: a rule's verdict is its weakest case's.
_STRENGTH = ("proved", "bounded", "unknown", "refuted")


def combine_cases(rule: Rule, cases: Sequence[Tuple[str, Verdict]], ms: float) -> Verdict:
    """One verdict from the verdicts of a rule's cases: the weakest status (its counterexample or reason,
    named by its case), the element types every case covers, and each case's own verdict in ``cases``."""
    weakest = max((v for _, v in cases), key=lambda v: _STRENGTH.index(v.status))
    label = next(lbl for lbl, v in cases if v is weakest)
    dtypes: Optional[Tuple[str, ...]] = None
    for _, v in cases:
        if tuple(v.dtypes) == ALL_DTYPES or not v.dtypes:
            continue
        dtypes = tuple(v.dtypes) if dtypes is None else tuple(d for d in dtypes if d in v.dtypes)
    if dtypes is None:
        dtypes = ALL_DTYPES if all(tuple(v.dtypes) == ALL_DTYPES for _, v in cases) else ()
    if weakest.status in ("proved", "bounded") and not dtypes:
        return attrs.evolve(weakest, ms=ms, dtypes=(), status="unknown", shapes="",
                            detail="its cases' proofs cover no element type in common",
                            cases=_case_records(cases))
    bounded = [v for _, v in cases if v.status == "bounded"]
    return Verdict(
        rule.name, rule.proof, weakest.status, "; ".join(f"{lbl}: {v.shapes}" for lbl, v in cases), ms,
        f"{label}: {weakest.counterexample}" if weakest.counterexample else None,
        f"{label}: {weakest.detail}" if weakest.detail else None, rule_key(rule),
        instances=sum(v.instances for v in bounded), max_dim=max((v.max_dim for v in bounded), default=0),
        dtypes=dtypes if weakest.status in ("proved", "bounded") else (),
        order_dependent=any(v.order_dependent for _, v in cases), cases=_case_records(cases),
        method=weakest.method if weakest.status in ("refuted", "unknown") else
        "; ".join(dict.fromkeys(v.method for _, v in cases if v.method)))


def _case_records(cases) -> Tuple[dict, ...]:
    return tuple({"case": lbl, "status": v.status, "shapes": v.shapes, "dtypes": list(v.dtypes), "method": v.method}
                 for lbl, v in cases)


def _guard_dtypes(rule: Rule) -> Optional[set]:
    """The element types the rule's ``dtype(x) in [...]`` guards allow (None: no such guard)."""
    allowed = None
    for gd in rule.guards:
        if getattr(gd, "op", None) == "in":
            names = {DTYPE_NAME[DTYPE_NAMES[item.name]] for item in gd.right.items}
            allowed = names if allowed is None else allowed & names
    return allowed


def _restrict(dtypes: Sequence[str], guard: Optional[set]) -> Tuple[str, ...]:
    if guard is None:
        return tuple(dtypes)
    if tuple(dtypes) == ALL_DTYPES:
        return tuple(sorted(guard))
    return tuple(d for d in dtypes if d in guard)


def _prove(rule: Rule, timeout_ms: int, verdict) -> Verdict:
    guard = _guard_dtypes(rule)
    named = _name_attr_wildcards(rule)
    float_vars = _float_attr_vars(named)
    exact = rule.proof == "exact"
    if rule.on == "kernel" and not is_elementwise(rule):
        return verdict("unknown", "", detail="kernel rules must be scalar (elementwise)")
    if is_elementwise(rule):
        inst = elementwise_instance(named)
        rng = np.random.default_rng(SEED)
        cex, oracle = semantic_refutation(named, [inst], rng, float_vars, SCALAR_DRAWS), SEMANTIC_ORACLE
        if cex is None and not _uses_kernel_ops(rule):
            (cex, _), oracle = random_refutation(named, [_vector_instance(inst)], rng, True), _onnx_oracle(rule)
        if cex is not None:
            return verdict("refuted", "random testing (elementwise)", cex, detail=f"found by the random refuter ({oracle})",
                           method=RANDOM_METHOD)
        status, cex, detail, info = _prove_instance(named, inst, float_vars, timeout_ms)
        method = info.get("method", "")
        if status != "proved":
            return verdict(status, inst.describe() or "scalars", cex, detail, method=method)
        if info["moves"]:
            dtypes = ALL_DTYPES
        elif exact:  # bit-exactness depends on the format: prove the rule in each one
            dtypes = ["float"]
            for fmt, (e, m, top) in sem.FP_FORMATS.items():
                if guard is None or fmt in guard:
                    fmt_ms = min(timeout_ms, FORMAT_TIMEOUT_MS)
                    if _prove_instance(named, inst, float_vars, fmt_ms, sem.FPDomain(fmt, e, m, top))[0] == "proved":
                        dtypes.append(fmt)
        else:
            dtypes = FLOAT_DTYPES
        dtypes = _restrict(dtypes, guard)
        if not dtypes:
            return verdict("unknown", "", detail="the proof covers none of the element types the dtype guard allows")
        return verdict("proved", "shape-generic (elementwise, proved on scalars)", dtypes=dtypes, method=method)

    rng = np.random.default_rng(SEED)
    drawn = draw_instances(named, rng, REFUTE_INSTANCES, REFUTE_MAX_DIM, REFUTE_MAX_ELEMS)
    cex, ran = random_refutation(named, drawn, rng)
    if cex is not None:
        return verdict("refuted", f"random testing: {ran} runs on {len(drawn)} instances, dims up to "
                       f"{max_dim_of(drawn)}", cex, detail=f"found by the random refuter ({_onnx_oracle(rule)})",
                       method=RANDOM_METHOD)

    bounded = draw_instances(named, np.random.default_rng(SEED + 1), BOUNDED_INSTANCES, BOUNDED_MAX_DIM,
                             BOUNDED_MAX_ELEMS) or search_instances(named)
    cex = semantic_refutation(named, bounded, rng, float_vars, SEMANTIC_DRAWS)
    if cex is not None:
        return verdict("refuted", f"random testing on {len(bounded)} instances, dims up to {max_dim_of(bounded)}",
                       cex, detail=f"found by the random refuter ({SEMANTIC_ORACLE})", method=RANDOM_METHOD)
    generic = prove_generic(rule, timeout_ms)
    if generic is not None and generic.status == "refuted":
        return verdict("refuted", generic.coverage, generic.counterexample, detail="generic proof", method=GENERIC_METHOD)
    if not bounded:
        if generic is not None and generic.status == "proved":
            return verdict("proved", generic.coverage, dtypes=_restrict(["float"] if exact else FLOAT_DTYPES, guard),
                           method=GENERIC_METHOD)
        return verdict("unknown", "none", detail="no small shapes satisfy the pattern, guards and types")
    proved_generically = generic is not None and generic.status == "proved"
    moves, order_dependent = True, False
    started, checked, timed_out, methods = time.perf_counter(), [], [], []
    needed = min(MIN_BOUNDED, len(bounded))
    for inst in bounded:  # with a generic proof: only what the sides do (no solving), for the dtypes
        if len(checked) >= MIN_BOUNDED and time.perf_counter() - started > BOUNDED_BUDGET_S:
            break  # the verdict states the instances actually checked
        status, cex, detail, info = _prove_instance(named, inst, float_vars, timeout_ms, solve=not proved_generically)
        if status == "unknown" and (detail or "").startswith("z3: "):
            # Z3 gave up on this instance (a wall-clock limit, so a loaded machine gives up sooner): no evidence
            # either way. It is not counted, and the next instance is tried; too few proved is `unknown` below.
            timed_out.append((inst, detail))
            continue
        if status not in ("proved", "evaluated"):
            return verdict(status, inst.describe(), cex, detail, method=info.get("method", ""))
        methods.append(info.get("method", ""))
        moves &= info["moves"]
        order_dependent |= info["sums"]
        checked.append(inst)
    if len(checked) < needed:
        inst, detail = timed_out[-1]
        return verdict("unknown", inst.describe(), None,
                       f"{detail} on {len(timed_out)} instance(s); {len(checked)} proved, {needed} needed")
    bounded = checked
    dtypes = _restrict(ALL_DTYPES if moves else ["float"] if exact else FLOAT_DTYPES, guard)
    if not dtypes:
        return verdict("unknown", "", detail="the proof covers none of the element types the dtype guard allows")
    if proved_generically:
        return verdict("proved", generic.coverage, dtypes=dtypes, order_dependent=order_dependent, method=GENERIC_METHOD)
    k = max_dim_of(bounded)
    return verdict("bounded", f"checked on {len(bounded)} instances, dims up to {k}",
                   detail="; ".join(i.describe() for i in bounded), instances=len(bounded), max_dim=k,
                   dtypes=dtypes, order_dependent=order_dependent, method=_methods(methods))


def _methods(methods: Sequence[str]) -> str:
    """One method, or each with the number of instances it decided ("z3 (2 instances), ...")."""
    counts: Dict[str, int] = {}
    for m in methods:
        counts[m] = counts.get(m, 0) + 1
    if len(counts) == 1:
        return next(iter(counts))
    return ", ".join(f"{m} ({n} instance{'s' if n > 1 else ''})" for m, n in counts.items())


def _prove_instance(rule: Rule, inst: Instance, float_vars, timeout_ms: int, dom: Optional[sem.Domain] = None,
                    solve: bool = True):
    """(status, counterexample, detail, facts) with facts["moves"]: both sides only move elements (so the
    proof holds for every element type) and facts["sums"]: an op of the rule adds elements of one tensor.
    ``solve=False`` stops after the facts (status "evaluated")."""
    dom = dom or (sem.FP32Domain() if rule.proof == "exact" else sem.RealDomain())
    env = _Env(dom, inst, float_vars, var_kinds(rule))
    facts = {"moves": False, "sums": False}
    try:
        lhs = _eval(rule.lhs, env)
        n_side = len(dom.side)
        rhs = _eval(rule.rhs, env)
    except UnsupportedOpError as e:
        return "unknown", None, f"no semantics: {e}", facts
    # Moved elements are input variables. A numeral (a literal, a default padding value) is not: its value
    # was rounded to this domain's format, so it may differ in another element type.
    facts["moves"] = all(z3.is_const(x) and x.decl().kind() == z3.Z3_OP_UNINTERPRETED
                         for arr in (lhs, rhs) for x in np.asarray(arr).reshape(-1))
    facts["sums"] = any(_op_sums(*call) for call in env.calls)
    if not solve:
        return "evaluated", None, None, facts
    lhs_side, rhs_side = dom.side[:n_side], dom.side[n_side:]
    assumptions = [a for gd in rule.guards if _value_guard(gd, rule, float_vars)
                   for a in _guard_assumptions(gd, env)]
    lhs_side = assumptions + lhs_side
    facts["method"] = "z3"
    if dom.name == "real":
        decided = _by_normal_form(dom, env, lhs, rhs, lhs_side, rhs_side, timeout_ms)
        if decided is not None:
            facts["method"] = polynomial.METHOD
            return decided + (facts,)
    if dom.name == "real" and _polynomial_identity(lhs, rhs) and _implied(dom, lhs_side, rhs_side, timeout_ms):
        return "proved", None, None, facts
    s = z3.Solver()
    s.set("timeout", int(timeout_ms))
    s.add(*dom.axioms)
    s.add(*lhs_side)
    if np.shape(lhs) != np.shape(rhs):
        return "refuted", f"shapes differ: lhs {list(np.shape(lhs))}, rhs {list(np.shape(rhs))}", None, facts
    # One query per output element (and one for the replacement's definedness): the tensors are equal iff
    # every element is, and many small bit-precise queries are far easier for Z3 than one disjunction.
    # In the real domain an element whose sides are the same rational function (see _polynomial_identity)
    # needs no query: it holds wherever the denominators are non-zero, which the definedness goal covers.
    goals = [sem.tensors_equal(dom, lhs[idx], rhs[idx]) for idx in np.ndindex(*np.shape(lhs))
             if not (dom.name == "real" and _polynomial_identity(np.asarray(lhs[idx]), np.asarray(rhs[idx])))]
    if rhs_side:
        goals.append(z3.And(*rhs_side))
    # Without assumptions or axioms, a goal equal to one already proved up to a renaming of its variables
    # (the same computation on other elements) is proved too.
    seen = set() if not (dom.axioms or lhs_side) else None
    for goal in goals or [z3.BoolVal(True)]:
        if seen is not None:
            shape_of_goal = _up_to_renaming(goal)
            if shape_of_goal in seen:
                continue
            seen.add(shape_of_goal)
        s.push()
        s.add(z3.Not(goal))
        res = s.check()
        if res == z3.sat:
            return "refuted", _counterexample(s.model(), dom, env, lhs, rhs, rhs_side), None, facts
        if res == z3.unknown:
            return "unknown", None, f"z3: {s.reason_unknown()}", facts
        s.pop()
    return "proved", None, None, facts


def _by_normal_form(dom, env: _Env, lhs, rhs, lhs_side, rhs_side, timeout_ms: int):
    """(status, counterexample, detail) when every element of both sides is a polynomial
    (:mod:`cuvil.rewrite_rules.polynomial`); None leaves the obligation to Z3. Equal normal forms prove it
    (the replacement's definedness must still follow from the pattern's). Unequal ones refute it only with a
    point, found by exact evaluation, at which Z3 confirms the pattern's assumptions hold and the sides
    differ (every variable fixed: a ground check); else Z3 decides as before."""
    forms = polynomial.normal_forms(lhs, rhs)
    if forms is None:
        return None
    reader, left, right = forms
    if left == right:
        return ("proved", None, None) if _implied(dom, lhs_side, rhs_side, timeout_ms) else None
    goal = z3.And(*[sem.tensors_equal(dom, a, b) for a, b in zip(np.asarray(lhs).reshape(-1), np.asarray(rhs).reshape(-1))],
                  *rhs_side)
    for point in itertools.islice(polynomial.difference_points(left, right, len(reader.names)), 8):
        s = z3.Solver()
        s.set("timeout", int(timeout_ms))
        s.add(*dom.axioms, *lhs_side, z3.Not(goal))
        s.add(*[v == z3.RealVal(x) for v, x in zip(reader.names, point)])
        if s.check() == z3.sat:
            return "refuted", _counterexample(s.model(), dom, env, lhs, rhs, rhs_side), f"found by the {polynomial.METHOD}"
    return None


_QUOTED = re.compile(r"\|[^|]*\||\b[A-Za-z_][A-Za-z0-9_!]*\b")


def _up_to_renaming(goal) -> str:
    """The goal's S-expression with every uninterpreted constant renamed in order of first appearance."""
    names = {c.decl().name() for c in _constants(goal)}
    order: Dict[str, str] = {}

    def rename(m):
        tok = m.group(0)
        key = tok[1:-1] if tok.startswith("|") else tok
        if key not in names:
            return tok
        return order.setdefault(key, f"v{len(order)}")

    return _QUOTED.sub(rename, goal.sexpr())


def _constants(e, seen=None):
    seen = set() if seen is None else seen
    if e.get_id() in seen:
        return []
    seen.add(e.get_id())
    if z3.is_const(e) and e.decl().kind() == z3.Z3_OP_UNINTERPRETED:
        return [e]
    return [c for k in e.children() for c in _constants(k, seen)]


_ADDS = (z3.Z3_OP_FPA_ADD, z3.Z3_OP_FPA_SUB)
_SUMS: Dict[str, bool] = {}


def _op_sums(op: str, shapes, at) -> bool:
    """Whether the op's float32 semantics adds two elements of one input (a reduction: Conv, MatMul,
    ReduceSum, AveragePool, LayerNormalization ...), so the result depends on the summation order. Read
    off the semantics themselves on fresh inputs of these shapes, not from a list of op names."""
    key = repr((op, shapes, sorted(at.items())))
    if key not in _SUMS:
        dom = sem.FP32Domain()
        try:
            outs = sem.evaluate(dom, op, [sem.symbolic(dom, f"in{k}", s) for k, s in enumerate(shapes)], at)
        except Exception:  # noqa: BLE001 - unknown: assume it sums (the cautious answer)
            _SUMS[key] = True
            return True
        memo: Dict[int, frozenset] = {}
        found = [False]

        def leaves(e) -> frozenset:
            k = e.get_id()
            if k in memo:
                return memo[k]
            if z3.is_const(e):
                out = frozenset([str(e)]) if e.decl().kind() == z3.Z3_OP_UNINTERPRETED else frozenset()
            else:
                kids = [leaves(c) for c in e.children()]
                if e.decl().kind() in _ADDS and len(kids) >= 2 and not found[0]:
                    left, right = _by_tensor(kids[-2]), _by_tensor(kids[-1])
                    found[0] = any(t in right and len(left[t] | right[t]) >= 2 for t in left)
                out = frozenset().union(*kids) if kids else frozenset()
            memo[k] = out
            return out

        for o in outs:
            for x in np.asarray(o, dtype=object).reshape(-1):
                if isinstance(x, z3.ExprRef):
                    leaves(x)
        _SUMS[key] = found[0]
    return _SUMS[key]


def _by_tensor(names: frozenset) -> Dict[str, set]:
    out: Dict[str, set] = {}
    for n in names:
        out.setdefault(n.split("[")[0], set()).add(n)
    return out


_INV = z3.Function("inv", z3.RealSort(), z3.RealSort())


def _without_division(e, memo):
    """``a / b`` rewritten as ``a * inv(b)`` with ``inv`` uninterpreted, bottom-up."""
    key = e.get_id()
    if key in memo:
        return memo[key]
    if z3.is_app(e) and e.num_args():
        kids = [_without_division(c, memo) for c in e.children()]
        if z3.is_app_of(e, z3.Z3_OP_DIV):
            out = kids[0] * _INV(z3.simplify(kids[1], som=True))
        else:
            out = e.decl()(*kids)
    else:
        out = e
    memo[key] = out
    return out


def _polynomial_identity(lhs: np.ndarray, rhs: np.ndarray) -> bool:
    """Both sides normalise to the same sum of monomials, reading ``a/b`` as ``a * inv(b)``: then they are
    equal wherever every denominator is non-zero. Cheap, and it settles the rational-function identities
    (weight folding) that nonlinear real arithmetic otherwise times out on."""
    if np.shape(lhs) != np.shape(rhs):
        return False
    memo: Dict[int, Any] = {}
    for idx in np.ndindex(*np.shape(lhs)):
        a, b = lhs[idx], rhs[idx]
        if not (z3.is_arith(a) and z3.is_arith(b)):
            return False
        diff = z3.simplify(_without_division(a, memo) - _without_division(b, memo), som=True)
        if not (z3.is_rational_value(diff) and diff.as_fraction() == 0):
            return False
    return True


def _implied(dom, lhs_side, rhs_side, timeout_ms) -> bool:
    """The replacement's definedness conditions follow from the pattern's (and the axioms)."""
    if not rhs_side:
        return True
    have = {z3.simplify(c).get_id() for c in lhs_side}
    if all(z3.simplify(c).get_id() in have for c in rhs_side):
        return True
    s = z3.Solver()
    s.set("timeout", int(timeout_ms))
    s.add(*dom.axioms, *lhs_side)
    s.add(z3.Not(z3.And(*rhs_side)))
    return s.check() == z3.unsat


def _show(model, dom, arr: np.ndarray, limit: int = 8) -> str:
    vals = [sem.format_value(dom.value_of(model, x)) for x in arr.reshape(-1)[:limit]]
    if arr.ndim == 0:
        return vals[0]
    return "[" + ", ".join(vals) + (", ..." if arr.size > limit else "") + "]"


def _counterexample(model, dom, env: _Env, lhs, rhs, rhs_side) -> str:
    parts = [f"{name} = {_show(model, dom, arr)}" for name, arr in env.values.items()]
    parts += [f"{name} = {sem.format_value(dom.value_of(model, v))}" for name, v in env.attrs.items() if isinstance(v, z3.ExprRef)]
    where = sem.first_difference(model, dom, lhs, rhs)
    if not where and rhs_side:
        where = "the replacement is undefined there (division by zero or out of domain)"
    return ", ".join(parts) + (": " + where if where else "")
