"""Memory safety of a schedule's kernels, proved with Z3 before code is generated.

Every memory access of every stage is an *obligation*: a buffer, one index expression per dim (texpr
integer arithmetic: affine terms, products with shape symbols, floor and truncating division and modulo,
clamps, selects) and the conditions under which the access happens. The obligation holds when, for every
value of the loop variables (each in its extent, symbolic extents included), of the reduction variables, of
the profile's shape symbols (each in ``[min, max]``) and of data-dependent integers (any value of their
dtype), where the conditions hold, every index is inside its dim. A view (reshape) must also fit in its
storage, and a stored buffer in its region of the arena or weights at every point of the profile.

Accesses counted:

* every ``load`` of a stage's expression, inside reductions and arg-scans too. Both arms of a ``select``
  are evaluated (LLVM ``select`` is not a branch), so a load under a select gets no condition: padding reads
  must be clamped, as ``TensorFn.at_or`` does; only a guarded load (``gload``) is conditioned on its guard;
* the stage's store: its buffer at the loop variables (a region's slice on its axis);
* the x86 micro-kernel families, which do not read through texpr loads: each states its access pattern here
  as index expressions (:func:`_family_obligations`): packed weight panels, im2col windows of a contraction
  (positions past the last one repeat it), masked window and Winograd tile loads, cropped tile stores.
  Another target passes its own (``families``: the PTX implicit-GEMM kernels', ptx/bounds_patterns.py).

An obligation that Z3 refutes (a counterexample) or cannot decide within :data:`QUERY_RLIMIT` is
*unproved*; :func:`guard_stage` then clamps the unproved loads of that stage into their buffer and takes
its micro-kernel node back to its plain expression, and the stage is listed as guarded in the manifest.
Proofs are cached by a canonical key of the obligation (index expressions with variables renamed, their
extents, the symbol ranges, the buffer's shape), so equal kernels and equal accesses are proved once.
"""
from __future__ import annotations

import time
from typing import Dict, List, Optional, Tuple

import attrs
import z3

from ..ir.dim import SymExpr, bounds, product
from ..ir.dtype import DType
from .contraction import (AMX_TILE, Contraction, DepthwiseWindow, MatContraction, PadWindow, WinogradInput, WinogradOutput,
                   fallback_weights)
from .attention import AttentionTile, stored_index
from .contraction_int8 import MAX_NR, Int8Contraction, Int8Planes
from .contraction_nhwc import NHWC_MR, ChannelsLastContraction, ChannelsLastRows, is_channels_last
from .contraction_planes import CHANNEL_BLOCK, PairPlanes, PlaneContraction
from .schedule import ARENA, WEIGHTS, Schedule, Stage, root_of
from .texpr import E, Buf, _rebuild, as_index, dim_index, nodes, substitute, var

#: Z3's resource limit for one obligation (its ``rlimit``, a count of solver steps): one that is not decided
#: within it counts as unproved. A step count, not a time, so the verdict, and with it the library (a guarded
#: kernel is other code), is the same on a fast idle machine and on a loaded one: builds stay reproducible.
#: The obligations of the zoo and the torch exports take at most ~0.1 M steps (tens of ms); 10 M is ~1-4 s.
QUERY_RLIMIT = 10_000_000
#: A wall-clock backstop far above what QUERY_RLIMIT takes, so a pathological query cannot hang a build.
QUERY_TIMEOUT_MS = 120_000
I64 = DType.INT64
_FAMILIES = ("contract", "window", "wino_in", "wino_out", "padwin", "attention", "attention_keys", "qgemm", "qplanes",
             "pplanes", "nhwc_rows")


@attrs.define
class Access:
    """One obligation: ``buf[idx]`` (or, with ``flat``, element ``idx[0]`` of its row-major storage) is in
    bounds wherever every condition in ``conds`` holds, each variable in ``domains`` ranging over
    ``[lo, hi)``."""
    kind: str                # "load", "store", "family:<name>"
    buf: Buf
    idx: List[E]
    conds: List[E]
    domains: Dict[str, Tuple[object, object]]
    node: Optional[E] = None     # the load (or micro-kernel node) to guard when unproved
    flat: bool = False


@attrs.define
class KernelCertificate:
    """The proof record of one stage: ``status`` is ``proved`` (every access in bounds), ``guarded`` (some
    were not proved; the stage runs with its unproved loads clamped and its micro-kernel node replaced by
    its plain expression) or ``unproved`` (still failing after guards: a clamp cannot help where a buffer
    may be empty, nor a view that may not fit its storage; the x86 compile then refuses the model)."""
    stage: str
    variant: str
    accesses: int
    status: str
    seconds: float
    failures: List[str] = attrs.field(factory=list)

    def to_json(self) -> dict:
        out = {"stage": self.stage, "variant": self.variant, "accesses": self.accesses, "status": self.status}
        if self.failures:
            out["unproved"] = self.failures
        return out


@attrs.define
class Certificate:
    """Every stage's proof record, the buffers' extents and the time taken."""
    kernels: List[KernelCertificate] = attrs.field(factory=list)
    seconds: float = 0.0
    cache_hits: int = 0
    queries: int = 0

    @property
    def proved(self) -> int:
        return sum(k.status == "proved" for k in self.kernels)

    @property
    def guarded(self) -> List[KernelCertificate]:
        return [k for k in self.kernels if k.status != "proved"]

    def extend(self, other: "Certificate"):
        self.kernels += other.kernels
        self.seconds += other.seconds
        self.cache_hits += other.cache_hits
        self.queries += other.queries

    def summary(self) -> str:
        return f"{self.proved}/{len(self.kernels)} kernels proved in bounds"

    def to_json(self) -> dict:
        """The manifest's ``memory_safety`` record (see docs/memory-safety.md); the time taken (``seconds``)
        stays out of it: artifacts are reproducible byte for byte."""
        return {"summary": self.summary(), "kernels_proved": self.proved, "kernels": len(self.kernels),
                "accesses": sum(k.accesses for k in self.kernels),
                "z3_queries": self.queries, "cache_hits": self.cache_hits,
                "guarded": [k.to_json() for k in self.guarded],
                "per_kernel": [k.to_json() for k in self.kernels]}


# --- translation of index expressions to Z3 -----------------------------------------------------------------

class _Z3:
    """Index expressions of one stage as Z3 integers. Variables are named by their texpr name; a value Z3
    cannot follow (a loaded integer, a float cast to an index) is a fresh integer ranging over its dtype."""

    def __init__(self, ranges: Dict[str, Tuple[int, int]], limits=None):
        self.ranges = ranges
        self.limits = limits or {}           # symbol -> a dim it never exceeds (a run-time size's bound)
        self.side: List[z3.BoolRef] = []     # dtype ranges of fresh values, symbol ranges
        self.memo: Dict[int, z3.ExprRef] = {}
        self.syms: Dict[str, z3.ArithRef] = {}

    def sym(self, name: str) -> z3.ArithRef:
        if name not in self.syms:
            s = z3.Int(f"sym!{name}")
            lo, hi = self.ranges.get(name, (0, 2 ** 62))
            self.side += [s >= lo, s <= hi]
            self.syms[name] = s
            if name in self.limits:
                self.side.append(s <= self.dim(self.limits[name]))
        return self.syms[name]

    def dim(self, d) -> z3.ArithRef:
        if isinstance(d, SymExpr):
            return self.int(dim_index(d))
        return z3.IntVal(int(d))

    def fresh(self, e: E) -> z3.ExprRef:
        if e.dtype == DType.BOOL:
            return z3.Bool(f"fresh!{e.uid}")
        v = z3.Int(f"fresh!{e.uid}")
        if e.dtype.is_float:
            lo, hi = -(2 ** 63), 2 ** 63 - 1
        elif e.dtype.is_minifloat:   # a bit pattern held in a byte
            lo, hi = -128, 127
        else:
            lo, hi = e.dtype.int_range
        self.side += [v >= lo, v <= hi]
        return v

    def int(self, e: E) -> z3.ArithRef:
        out = self.expr(e)
        return z3.If(out, z3.IntVal(1), z3.IntVal(0)) if z3.is_bool(out) else out

    def expr(self, e: E) -> z3.ExprRef:
        if e.uid not in self.memo:
            self.memo[e.uid] = self._expr(e)
        return self.memo[e.uid]

    def _expr(self, e: E) -> z3.ExprRef:
        op = e.op
        if e.dtype.is_float and op not in ("cmp",):
            return self.fresh(e)
        if op == "const":
            return z3.BoolVal(bool(e.attr)) if e.dtype == DType.BOOL else z3.IntVal(int(e.attr))
        if op == "var":
            return z3.Int(e.attr)
        if op == "sym":
            return self.sym(e.attr)
        if op == "cmp":
            if e.args[0].dtype.is_float:
                return self.fresh(e)
            a, b = self.int(e.args[0]), self.int(e.args[1])
            return {"lt": a < b, "le": a <= b, "gt": a > b, "ge": a >= b, "eq": a == b, "ne": a != b}[e.attr]
        if op in ("and", "or", "xor") and e.dtype == DType.BOOL:
            xs = [self.expr(a) for a in e.args]
            if not all(z3.is_bool(x) for x in xs):
                return self.fresh(e)
            return z3.And(*xs) if op == "and" else z3.Or(*xs) if op == "or" else _xor(xs)
        if op == "not" and e.dtype == DType.BOOL:
            x = self.expr(e.args[0])
            return z3.Not(x) if z3.is_bool(x) else self.fresh(e)
        if op == "select":
            c, a, b = (self.expr(x) for x in e.args)
            if not z3.is_bool(c) or z3.is_bool(a) != z3.is_bool(b):
                return self.fresh(e)
            return z3.If(c, a, b)
        if e.dtype not in (DType.INT64, DType.INT32) and e.dtype != DType.BOOL:
            return self.fresh(e)
        if op in ("add", "sub", "mul"):
            a, b = self.int(e.args[0]), self.int(e.args[1])
            out = a + b if op == "add" else a - b if op == "sub" else a * b
            if e.dtype == DType.INT32:     # wraps (a tensor's int32 arithmetic): any int32 where it overflows
                out = z3.If(z3.And(out >= -(2 ** 31), out < 2 ** 31), out, self.fresh(e))
            return out
        if op in ("idiv", "imod"):       # C sdiv / srem (truncating), as the x86 and PTX code computes them
            a, b = self.int(e.args[0]), self.int(e.args[1])
            q = z3.If(a >= 0, 1, -1) * z3.If(b >= 0, 1, -1) * (_abs(a) / _abs(b))
            return q if op == "idiv" else a - b * q
        if op in ("fdiv", "fmod_i"):     # floor division / modulo
            a, b = self.int(e.args[0]), self.int(e.args[1])
            q = z3.If(b > 0, a / b, (-a) / (-b))
            return q if op == "fdiv" else a - b * q
        if op == "clamp":
            x = self.int(e.args[0])
            lo, hi = (self.dim(v) for v in e.attr)
            x = z3.If(x < lo, lo, x)       # in the generated code's order: where lo > hi (a dim of 0) that
            return z3.If(x > hi, hi, x)    # gives hi, -1, for every x
        if op == "reflect":
            x = self.int(e.args[0])
            d = self.dim(e.attr)
            x = z3.If(x < 0, -x, x)
            return z3.If(x >= d, (d - 1) * 2 - x, x)
        if op == "argscan":      # the scan's best index: 0 before its loop over [1, n), so 0 when n is 0
            v = self.fresh(e)
            self.side += [v >= 0, z3.Or(v == 0, v < self.dim(e.attr[3]))]
            return v
        if op == "cast":
            src = e.args[0].dtype
            if src in (DType.INT64, DType.INT32, DType.INT16, DType.INT8, DType.UINT8, DType.UINT16,
                       DType.UINT32, DType.BOOL) and e.dtype == DType.INT64:
                return self.int(e.args[0])
            return self.fresh(e)
        return self.fresh(e)


def _abs(x):
    return z3.If(x >= 0, x, -x)


def _xor(xs):
    out = xs[0]
    for x in xs[1:]:
        out = z3.Xor(out, x)
    return out


# --- canonical keys of obligations (the proof cache) -----------------------------------------------------

def _canon(e: E, names: Dict[str, str], memo: Dict[int, str]) -> str:
    if e.uid in memo:
        return memo[e.uid]
    if e.op == "var":
        out = names.setdefault(e.attr, f"v{len(names)}")
    elif e.op == "const":
        out = f"{e.dtype.name}:{e.attr!r}"
    elif e.op == "load":
        out = f"load[{e.dtype.name}]#{len(memo)}"     # the loaded value: a fresh unknown of its dtype
    elif e.op == "argscan":
        out = f"argscan[{e.attr[3]}]#{len(memo)}"
    elif e.op in ("reduce", "call") or e.dtype.is_float:
        out = f"{e.op}[{e.dtype.name}]#{len(memo)}"
    else:
        attr = "" if e.attr is None else repr(e.attr)
        out = f"{e.op}{attr}[{e.dtype.name}]({','.join(_canon(a, names, memo) for a in e.args)})"
    memo[e.uid] = out
    return out


def _occurring(acc: Access) -> List[str]:
    """The loop variables with a domain that the obligation's indices and conditions read (as Z3 sees them:
    not inside loaded values or reductions)."""
    names: Dict[str, str] = {}
    memo: Dict[int, str] = {}
    for e in list(acc.idx) + list(acc.conds):
        _canon(e, names, memo)
    return [v for v in names if v in acc.domains]


def _key(acc: Access, ranges) -> str:
    names: Dict[str, str] = {}
    memo: Dict[int, str] = {}
    idx = ",".join(_canon(i, names, memo) for i in acc.idx)
    conds = ",".join(_canon(c, names, memo) for c in acc.conds)
    doms = ",".join(f"{names[v]}:{acc.domains[v][0]}..{acc.domains[v][1]}"
                    for v in list(names) if v in acc.domains)
    return f"{acc.flat}|{list(acc.buf.shape)}|{idx}|{conds}|{doms}|{sorted(ranges.items())}"


# --- the prover ---------------------------------------------------------------------------------------------

class BoundsProver:
    """Proves access obligations, with a cache shared by every schedule it sees (the generic and opt-point
    kernels of one model, and any model compiled in the same process)."""

    def __init__(self, timeout_ms: int = QUERY_TIMEOUT_MS, limits=None, rlimit: int = QUERY_RLIMIT):
        """``limits``: symbol -> a dim expression it never exceeds (a run-time size, NonZero's count, is at
        most its input's element count: ``Schedule.size_limits``), assumed beside the symbols' ranges."""
        self.timeout_ms = timeout_ms
        self.rlimit = rlimit
        self.limits = dict(limits or {})
        self.cache: Dict[str, Optional[str]] = {}
        self.hits = 0
        self.queries = 0

    def check(self, acc: Access, ranges) -> Optional[str]:
        """None when ``acc`` is proved in bounds, else why not (a counterexample or ``unknown``)."""
        if not acc.flat and _intervals_inside(acc, ranges):
            self.hits += 1
            return None
        key = _key(acc, ranges) + (f"|{sorted((k, str(v)) for k, v in self.limits.items())}" if self.limits else "")
        if key in self.cache:
            self.hits += 1
            return self.cache[key]
        out = self._check(acc, ranges)
        self.cache[key] = out
        return out

    def _solve(self, tr: _Z3, acc: Access, goal) -> Tuple[str, Optional[z3.ModelRef]]:
        self.queries += 1
        s = z3.Solver()
        s.set("timeout", self.timeout_ms)
        s.set("rlimit", self.rlimit)
        # only the variables the obligation reads are bounded: a domain of another loop (a reduction or scan
        # elsewhere in the stage, an extent that may be 0) would make the query vacuous where that loop is
        # empty, though this access runs regardless; and the cache key (_key) names exactly these domains
        for name in _occurring(acc):
            lo, hi = acc.domains[name]
            v = z3.Int(name)
            s.add(v >= tr.dim(lo), v < tr.dim(hi))
        for c in acc.conds:
            s.add(tr.expr(c))
        s.add(z3.Not(goal))
        s.add(*tr.side)
        r = s.check()
        return str(r), (s.model() if r == z3.sat else None)

    def _check(self, acc: Access, ranges) -> Optional[str]:
        if not acc.flat and len(acc.idx) != len(acc.buf.shape):    # zip would check only the leading dims
            return f"{acc.kind} {acc.buf.name}{list(acc.buf.shape)}: {len(acc.idx)} indices for its " \
                   f"{len(acc.buf.shape)} dims"
        tr = _Z3(ranges, self.limits)
        shape = [tr.dim(d) for d in acc.buf.shape]
        idx = [tr.int(i) for i in acc.idx]
        if acc.flat:
            numel = tr.dim(product(acc.buf.shape))
            goal = z3.And(idx[0] >= 0, idx[0] < numel)
        else:
            goal = z3.And(*[z3.And(i >= 0, i < d) for i, d in zip(idx, shape)]) if idx else z3.BoolVal(True)
        r, model = self._solve(tr, acc, goal)
        if r == "unsat":
            return None
        if not acc.flat and len(idx) > 1 and acc.buf.pitch is None:
            # an index past one dim may still be inside the buffer's row-major storage (what the kernels
            # address): the flat offset, with the strides as symbol expressions (not so in a pitched view,
            # whose rows are apart by more than their length)
            flat = z3.IntVal(0)
            for i, d in zip(idx, shape):
                flat = flat * d + i
            numel = tr.dim(product(acc.buf.shape))
            r2, model2 = self._solve(tr, acc, z3.And(flat >= 0, flat < numel))
            if r2 == "unsat":
                return None
            r, model = (r2, model2) if r == "unknown" else (r, model)
        where = f"{acc.kind} {acc.buf.name}{list(acc.buf.shape)}[{', '.join(map(repr, acc.idx))}]"
        if model is None:
            return f"{where}: {r} (Z3 undecided within {self.rlimit:,} steps)"
        vals = [f"{d.name()}={model[d]}" for d in model.decls() if not d.name().startswith("fresh!")]
        got = [str(model.eval(i, model_completion=True)) for i in idx]
        return f"{where}: index ({', '.join(got)}) out of bounds at {', '.join(sorted(vals)[:8])}"

    def extent(self, view: Buf, limit, ranges) -> Optional[str]:
        """None when ``view``'s bytes fit in ``limit`` bytes (an int or dim expression) at every point of the
        profile (a pitched view: its span, from its root's start to past its last element)."""
        size = view.span
        key = f"extent|{size}|{limit}|{sorted(ranges.items())}"
        if key in self.cache:
            self.hits += 1
            return self.cache[key]
        try:    # enclosing intervals settle most (the arena plan sized buffers by the same bound): no Z3 query,
            # whose nonlinear products of symbols could otherwise time out on a loaded machine
            if bounds(size, ranges)[1] <= bounds(limit, ranges)[0]:
                self.hits += 1
                self.cache[key] = None
                return None
        except (ValueError, KeyError):
            pass
        self.queries += 1
        tr = _Z3(ranges, self.limits)
        s = z3.Solver()
        s.set("timeout", self.timeout_ms)
        s.set("rlimit", self.rlimit)
        s.add(z3.Not(tr.dim(size) <= tr.dim(limit)))
        s.add(*tr.side)
        r = s.check()
        out = None if r == z3.unsat else f"{view.name}: {size} bytes may exceed {limit} ({r})"
        self.cache[key] = out
        return out


# --- interval arithmetic: the cheap proof most accesses of static shapes take -------------------------------

def _intervals_inside(acc: Access, ranges) -> bool:
    """Whether interval arithmetic alone puts every index inside its (constant) dim, whatever the
    conditions: a sound over-approximation, so True is a proof; False only sends the access to Z3."""
    memo: Dict[int, Optional[Tuple[int, int]]] = {}
    if len(acc.idx) != len(acc.buf.shape):
        return False
    for i, d in zip(acc.idx, acc.buf.shape):
        if isinstance(d, SymExpr):
            return False
        r = _interval(i, acc.domains, ranges, memo)
        if r is None or r[0] < 0 or r[1] >= d:
            return False
    return True


def _interval(e: E, doms, ranges, memo) -> Optional[Tuple[int, int]]:
    if e.uid in memo:
        return memo[e.uid]
    out = None
    op = e.op
    if op == "const" and e.dtype in (DType.INT64, DType.INT32):
        out = (int(e.attr), int(e.attr))
    elif op == "var" and e.attr in doms:
        lo, hi = doms[e.attr]
        if not isinstance(lo, SymExpr) and not isinstance(hi, SymExpr) and int(hi) > int(lo):
            out = (int(lo), int(hi) - 1)
    elif op == "sym" and e.attr in ranges:
        out = tuple(ranges[e.attr])
    elif op in ("add", "mul", "idiv", "imod", "fdiv", "fmod_i", "select") and e.dtype == DType.INT64:
        xs = [_interval(a, doms, ranges, memo) for a in e.args[1:]] if op == "select" else \
            [_interval(a, doms, ranges, memo) for a in e.args]
        if all(x is not None for x in xs):
            (alo, ahi), (blo, bhi) = xs
            if op == "add":
                out = (alo + blo, ahi + bhi)
            elif op == "mul":
                c = [alo * blo, alo * bhi, ahi * blo, ahi * bhi]
                out = (min(c), max(c))
            elif op == "select":
                out = (min(alo, blo), max(ahi, bhi))
            elif blo == bhi and blo > 0:          # by a positive constant
                k = blo
                if op == "fdiv" or (op == "idiv" and alo >= 0):
                    out = (alo // k, ahi // k)
                elif op == "fmod_i" or (op == "imod" and alo >= 0):
                    out = (alo, ahi) if 0 <= alo and ahi < k else (0, k - 1)
    elif op == "clamp" and not any(isinstance(v, SymExpr) for v in e.attr):
        x = _interval(e.args[0], doms, ranges, memo)
        lo, hi = (int(v) for v in e.attr)
        if lo <= hi:
            out = (min(max(x[0], lo), hi), min(max(x[1], lo), hi)) if x is not None else (lo, hi)
    memo[e.uid] = out
    return out


# --- the obligations of a stage -----------------------------------------------------------------------------

def stage_domains(st: Stage) -> Dict[str, Tuple[object, object]]:
    """The stage's loop variables with their ranges (a region's axis: its slice)."""
    doms = {}
    for k, (v, d) in enumerate(zip(st.vars, st.buf.shape)):
        lo, hi = 0, d
        if st.region is not None and st.region[0] == k:
            lo, hi = st.region[1], st.region[2]
        doms[v.attr] = (lo, hi)
    return doms


def stage_accesses(st: Stage, families=None) -> List[Access]:
    """Every obligation of ``st``: its store, its loads, its micro-kernel family's accesses. ``families``
    (``(stage, node, domains) -> [Access]``, default the x86 micro-kernels' :func:`_family_obligations`)
    states the accesses of the target's kernels for a family node; a target that emits the node's plain
    expression returns no accesses for it (its loads are walked like any other). A hook with an ``ops``
    attribute is called for nodes of those ops instead (the PTX hook adds ``reduce``: its tensor-core
    products form their own addresses)."""
    families = families or _family_obligations
    hooked = getattr(families, "ops", _FAMILIES)     # a target's hook may state the kernels of more node kinds
    doms = stage_domains(st)
    out = [Access("store", st.buf, list(st.vars), [], doms)]
    seen = set()
    stack: List[Tuple[E, tuple]] = [(st.expr, ())]
    while stack:
        x, conds = stack.pop()
        if (x.uid, conds) in seen:
            continue
        seen.add((x.uid, conds))
        if x.op == "reduce":
            _, vs, extents = x.attr
            for v, n in zip(vs, extents):
                doms[v.attr] = (0, n)
        if x.op == "load":
            out.append(Access("load", x.attr, list(x.args), list(conds), doms, node=x))
        elif x.op == "gload":
            cond = conds + (x.args[0],)
            out.append(Access("load", x.attr, list(x.args[2:]), list(cond), doms, node=x))
            stack.append((x.args[0], conds))
            stack.extend((a, cond) for a in x.args[2:])
            continue
        elif x.op == "argscan":
            src, base, axis, n, _, _ = x.attr
            i = var("arg")
            doms[i.attr] = (0, n)
            idx = list(base)
            idx[axis] = i
            # the scan reads element 0 before its loop over [1, n) (x86/codegen.py argscan): that read
            # happens even where the axis is empty, so it is an access of its own, not one of the loop's
            first = list(base)
            first[axis] = as_index(0)
            stack.append((src(idx), conds))
            stack.append((src(first), conds))
            stack.extend((as_index(b), conds) for b in base)
        elif x.op == "sequential":
            # each assignment stores at its index over its loops and the steps; its loads are walked below
            prog = x.attr
            rows = {v.attr: a for v, a in zip(prog.row_vars, x.args)}
            doms[prog.step.attr] = (0, prog.steps)
            for a in prog.assigns():
                for v, n in zip(a.loop_vars, a.extents):
                    doms[v.attr] = (0, n)
                idx = [substitute(i, rows) for i in a.index]
                out.append(Access("store", a.buf, idx, list(conds), doms))
                stack.append((substitute(a.value, rows), conds))
                stack.extend((i, conds) for i in idx)
        if x.op in hooked:
            out.extend(families(st, x, doms))
        stack.extend((a, conds) for a in x.args)
    return out


def _loop(doms, name: str, extent) -> E:
    v = var(name)
    doms[v.attr] = (0, extent)
    return v


def _family_obligations(st: Stage, node: E, doms) -> List[Access]:
    """The accesses the x86 micro-kernels make for ``node`` (see x86/gemm.py, matmul.py, depthwise.py,
    winograd.py, pad.py), as index expressions over their own loop variables."""
    spec = node.attr
    kind = f"family:{node.op}"
    out: List[Access] = []
    d = dict(doms)
    if node.op == "contract" and isinstance(spec, Contraction):
        n, g = _loop(d, "n", spec.x.shape[0]), _loop(d, "g", spec.groups)
        if spec.amx:                     # AMX A tiles, step-major (pack_weights_amx), as x86/gemm.py's amx_tile
            # addresses them: a weight block at (g Mb + mb) mr K2s words, step s at s mr 16 words, tile i at i 256,
            # 16 rows of 16 words (one pair of bfloat16 each) 16 words apart: the flat word, times 2, plus the half
            k2s = spec.pair_rows
            mb, s_ = _loop(d, "mb", spec.m_blocks), _loop(d, "s", k2s // AMX_TILE)
            i, row, kp = _loop(d, "i", spec.mr // AMX_TILE), _loop(d, "row", AMX_TILE), _loop(d, "kp", AMX_TILE)
            word = ((g * spec.m_blocks + mb) * (spec.mr * k2s) + s_ * (spec.mr * AMX_TILE) + i * (AMX_TILE * AMX_TILE)
                    + row * AMX_TILE + kp)
            out.append(Access(kind, spec.a, [word * 2 + _loop(d, "pair", 2)], [], d, node=node, flat=True))
        elif spec.precision == "bf16":     # bfloat16 pairs along K (pack_weights_bf16)
            mb, k, r = _loop(d, "mb", spec.m_blocks), _loop(d, "k", (spec.k + 1) // 2), _loop(d, "r", spec.mr)
            out.append(Access(kind, spec.a, [g, mb, k, r, _loop(d, "pair", 2)], [], d, node=node))
        else:
            mb, k, r = _loop(d, "mb", spec.m_blocks), _loop(d, "k", spec.k), _loop(d, "r", spec.mr)
            out.append(Access(kind, spec.a, [g, mb, k, r], [], d, node=node))      # packed weight panels
        c = _loop(d, "c", spec.cin)
        ch = c * spec.groups + g if spec.interleaved else g * spec.cin + c
        os_ = [_loop(d, "o", o) for o in spec.out_spatial]
        ks = [_loop(d, "kk", kk) for kk in spec.kernel]
        pads = list(spec.pads) or [0] * len(os_)
        sp = [o * s + kk * dl - p for o, kk, s, dl, p in zip(os_, ks, spec.strides, spec.dilations, pads)]
        conds = [c_ for x, size in zip(sp, spec.x.shape[2:]) for c_ in _inside(x, size)] if spec.pads else []
        out.append(Access(kind, spec.x, [n, ch] + sp, conds, d, node=node))   # im2col panels (B)
        m = _loop(d, "m", spec.m)
        if len(st.buf.shape) == 2 + len(os_):
            out.append(_store(kind, st, [n, g * spec.m + m] + os_, d, node))   # tile stores
        else:
            out.append(Access(kind, st.buf, [n], [z3_false()], d, node=node))
    elif node.op == "contract" and isinstance(spec, MatContraction):
        mb, c = _loop(d, "mb", spec.m_blocks), _loop(d, "c", spec.cols)
        if spec.precision == "bf16":     # bfloat16 pairs along K (pack_columns_bf16)
            out.append(Access(kind, spec.w, [mb, _loop(d, "kp", (spec.k + 1) // 2), c, _loop(d, "pair", 2)], [], d,
                              node=node))
        k = _loop(d, "k", spec.k)
        if spec.precision != "bf16":
            out.append(Access(kind, spec.w, [mb, k, c], [], d, node=node))
        row = _loop(d, "row", spec.rows)
        out.append(Access(kind, spec.a, [row * spec.k + k], [], d, node=node, flat=True))
        m = _loop(d, "m", spec.m)
        # the tile's rows are stored at the output's own row stride (its last dim), x86/matmul.py
        out.append(Access(kind, st.buf, [row * st.buf.shape[-1] + m], [], d, node=node, flat=True))
    elif node.op == "window" and isinstance(spec, DepthwiseWindow):
        n, c = _loop(d, "n", spec.x.shape[0]), _loop(d, "c", spec.x.shape[1])
        os_ = [_loop(d, "o", o) for o in spec.out_spatial]
        ks = [_loop(d, "kk", kk) for kk in spec.kernel]
        if spec.w is not None:
            out.append(Access(kind, spec.w, [c, as_index(0)] + ks, [], d, node=node))
        sp = [o * s + kk * dl - p for o, kk, s, dl, p in zip(os_, ks, spec.strides, spec.dilations, spec.pads)]
        # every row-kernel load is masked to the input: rows outside skipped, columns past the row masked
        conds = [c_ for x, size in zip(sp, spec.x.shape[2:]) for c_ in _inside(x, size)]
        out.append(Access(kind, spec.x, [n, c] + sp, conds, d, node=node))
        out.append(_store(kind, st, [n, c] + os_, d, node))
    elif node.op == "wino_in" and isinstance(spec, WinogradInput):
        a, e_count = spec.tile + 2, (spec.tile + 2) ** 2
        n, c = _loop(d, "n", spec.x.shape[0]), _loop(d, "c", spec.channels)
        th, tw = _loop(d, "th", spec.tiles[0]), _loop(d, "tw", spec.tiles[1])
        p, q = _loop(d, "p", a), _loop(d, "q", a)
        y, x = th * spec.tile + p - spec.pads[0], tw * spec.tile + q - spec.pads[1]
        conds = _inside(y, spec.x.shape[2]) + _inside(x, spec.x.shape[3])   # masked to the input
        out.append(Access(kind, spec.x, [n, c, y, x], conds, d, node=node))
        e = _loop(d, "e", e_count)
        ec = c * e_count + e if spec.interleaved else e * spec.channels + c
        out.append(Access(kind, st.buf, [n, ec, th * spec.tiles[1] + tw], [], d, node=node))
    elif node.op == "wino_out" and isinstance(spec, WinogradOutput):
        a, e_count = spec.tile + 2, (spec.tile + 2) ** 2
        n, k = _loop(d, "n", spec.m.shape[0]), _loop(d, "k", spec.channels)
        e, t = _loop(d, "e", e_count), _loop(d, "t", spec.tiles[0] * spec.tiles[1])
        out.append(Access(kind, spec.m, [n, e * spec.channels + k, t], [], d, node=node))
        th, tw = _loop(d, "th", spec.tiles[0]), _loop(d, "tw", spec.tiles[1])
        r, q = _loop(d, "r", spec.tile), _loop(d, "q", spec.tile)
        y, x = th * spec.tile + r, tw * spec.tile + q
        conds = _inside(y, spec.out_spatial[0]) + _inside(x, spec.out_spatial[1])   # cropped tiles
        out.append(Access(kind, st.buf, [n, k, y, x], conds, d, node=node))
        parts = fallback_weights(node)
        if parts is not None:   # the fallback's W of one output channel, in the thread's scratch (that size)
            ext = parts[2]
            scratch = Buf("scratch (fallback W)", DType.FLOAT, ext)
            out.append(Access(kind, scratch, [_loop(d, "wc", e) for e in ext], [], d, node=node))
    elif node.op == "padwin" and isinstance(spec, PadWindow):
        # x86/pad.py runs each spatial axis over [0, begin) (fill), [begin, begin + size) (the interior: the
        # unclamped read, stored there) and [begin + size, extent) (fill), whatever the buffer's extent: a
        # negative begin or an interior past the extent stores outside the buffer, so the interior is stated
        # over its own loop variables, not over the stage's (whose extent would hide it)
        lead, sp = st.vars[:len(st.vars) - len(spec.begin)], st.vars[len(st.vars) - len(spec.begin):]
        at = [b0 + _loop(d, "j", size) for b0, size in zip(spec.begin, spec.sizes)]
        where = {v.attr: p for v, p in zip(sp, at)}
        out.append(Access(kind, st.buf, list(lead) + at, [], d, node=node))             # interior stores
        for ld in _loads(spec.interior()):       # the interior runs read unclamped
            out.append(Access(kind, ld.attr, [substitute(i, where) for i in ld.args], [], d, node=node))
        for k, b0 in enumerate(spec.begin):      # the leading fill of axis k
            if not isinstance(b0, int) or b0 > 0:
                idx = list(st.vars)
                idx[len(lead) + k] = _loop(d, "f", b0)
                out.append(Access(kind, st.buf, idx, [], d, node=node))
    elif node.op == "attention_keys" and spec is not None:
        # x86/attention.py emit_key_panels_stage: a panel whose keys are all below the key count loads its rows
        # straight from the keys' stored buffer (a vector of d per key); other panels read the plain value
        kbuf, axes, keys = spec
        B, H, nkb, D, KB = st.buf.shape
        n, h, t = _loop(d, "n", B), _loop(d, "h", H), _loop(d, "t", nkb)
        j, c = _loop(d, "j", KB), _loop(d, "c", D)
        at = (n, h, t * KB + j, c)
        whole = E("cmp", (t * KB + KB, as_index(keys)), DType.BOOL, "le")
        out.append(Access(kind, kbuf, stored_index(axes, at, as_index(0)), [whole], d,
                          node=node))
    elif node.op == "attention" and isinstance(spec, AttentionTile):
        # x86/attention.py: a unit is a block of qb query rows of one (n, h); a row past Sq loads the last row
        # (clamped) and stores nothing; whole key panels (vectors of kb keys, value rows of dvp), masked stores
        # of the dv output columns
        n, h = _loop(d, "n", spec.batch), _loop(d, "h", spec.heads)
        blk, qi = _loop(d, "blk", (spec.rows + spec.qb - 1) // spec.qb), _loop(d, "qi", spec.qb)
        row = blk * spec.qb + qi
        clamped = E("clamp", (row,), I64, (0, spec.rows - 1))
        t, k, j = _loop(d, "t", spec.key_blocks), _loop(d, "k", spec.d), _loop(d, "j", spec.kb)
        q_at = [n, h, clamped, k]
        out.append(Access(kind, spec.q, q_at if spec.q_axes is None else stored_index(spec.q_axes, q_at, as_index(0)),
                          [], d, node=node))
        if spec.k_axes is None:      # the key panels
            out.append(Access(kind, spec.kt, [n, h, t, k, j], [], d, node=node))
        else:                        # read in place: a row per key, clamped to the last key
            key = E("clamp", (t * spec.kb + j,), I64, (0, spec.keys - 1))
            at = (n, h, key, k)
            out.append(Access(kind, spec.kt, stored_index(spec.k_axes, at, as_index(0)), [], d,
                              node=node))
        c = _loop(d, "c", spec.dvp)
        if spec.v_axes is None:      # the padded copy, whole panels
            out.append(Access(kind, spec.v, [n, h, t * spec.kb + j, c], [], d, node=node))
        else:                        # read in place, keys below Sk only
            at = (n, h, t * spec.kb + j, c)
            out.append(Access(kind, spec.v, stored_index(spec.v_axes, at, as_index(0)),
                              [E("cmp", (t * spec.kb + j, as_index(spec.keys)), DType.BOOL, "lt")], d, node=node))
        lead = [x if size != 1 else as_index(0) for x, size in zip((n, h, clamped), spec.mask.shape)]
        out.append(Access(kind, spec.mask, lead + [t * spec.kb + j], [], d, node=node))
        st_idx = spec.out_index(n, h, row, _loop(d, "c", spec.dv))
        out.append(Access(kind, st.buf, st_idx, [E("cmp", (row, as_index(spec.rows)), DType.BOOL, "lt")], d,
                          node=node))
    elif (node.op, type(spec)) in (("qplanes", Int8Planes), ("pplanes", PairPlanes)):
        # x86/phase_planes.py (int8: groups of four channels; bf16: pairs): a unit is one plane (n, g, f); per grid
        # row a and 16 positions from b0 = 16 k, each channel row of the group (clamped to the last channel) is
        # one masked load of 16 * sw elements from column b0 sw + rw - pw0 (only lanes inside the row are read,
        # and none of a row of padding), and one store of the 16 positions (the last one of a row runs on into
        # the next); then the tail, whole stores ending at the plane's end at most
        (sh, sw), (ph0, pw0), (H, W) = spec.strides, spec.begin, spec.in_hw
        n, c = _loop(d, "n", spec.x.shape[0]), _loop(d, "c", spec.channels)
        rh, rw = _loop(d, "rh", spec.phases[0]), _loop(d, "rw", spec.phases[1])
        a, k, lane = _loop(d, "a", spec.grid[0]), _loop(d, "k", -(-spec.grid[1] // 16)), _loop(d, "l", 16 * sw)
        ih, iw = a * sh + rh - ph0, k * (16 * sw) + rw - pw0 + lane
        lead = [n, c, ih] if len(spec.x.shape) == 4 else [n, c]
        out.append(Access(kind, spec.x, lead + [iw], (_inside(ih, H) if len(spec.x.shape) == 4 else []) + _inside(iw, W),
                          d, node=node))
        per = 4 if node.op == "qplanes" else 2
        g, f, j, i = _loop(d, "g", spec.groups), _loop(d, "f", spec.num_phases), _loop(d, "j", 16), _loop(d, "i", per)
        out.append(_store(kind, st, [n, g, f, a * spec.grid[1] + k * 16 + j, i], d, node))
        tail = _loop(d, "q", spec.plane)
        out.append(_store(kind, st, [n, g, f, tail, i], d, node))
    elif node.op == "contract" and isinstance(spec, PlaneContraction):
        # x86/gemm_planes.py: a unit is (image, panel of nr wide positions, weight block); per tap it reads
        # every channel pair's plane at the panel's positions shifted by the tap's offset, the weight block's A
        # tiles whole; the tile's outputs are stored at (oh, ow) of its wide positions with ow < OW only
        n, g, f, i = _loop(d, "n", spec.n), _loop(d, "g", spec.groups), _loop(d, "f", spec.num_phases), _loop(d, "i", 2)
        p, off = _loop(d, "p", spec.p_blocks * spec.nr), _loop(d, "off", spec.max_shift + 1)
        out.append(Access(kind, spec.b, [n, g, f, p + off, i], [], d, node=node))
        mb, t, kb = _loop(d, "mb", spec.m_blocks), _loop(d, "t", len(spec.taps)), _loop(d, "kb", spec.k_blocks)
        r, j = _loop(d, "r", spec.mr), _loop(d, "j", CHANNEL_BLOCK // 2)
        out.append(Access(kind, spec.w, [mb, kb, t, r, j, i], [], d, node=node))
        m, oh, ow = _loop(d, "m", spec.m), _loop(d, "oh", spec.out_hw[0]), _loop(d, "ow", spec.out_hw[1])
        out.append(_store(kind, st, [n, m, oh, ow], d, node))
    elif node.op == "nhwc_rows" and isinstance(spec, ChannelsLastRows):
        # x86/gemm_nhwc.py: a unit is one grid row (image, phase, row a); each of its positions inside the input
        # copies the C channels of input position (ih, iw) (a channels-last input: whole runs of them), every other
        # element of the row is zero
        (sh, sw), (ph0, pw0), (H, W) = spec.strides, spec.begin, spec.in_hw
        n, c = _loop(d, "n", spec.x.shape[0]), _loop(d, "c", spec.channels)
        rh, rw = _loop(d, "rh", spec.phases[0]), _loop(d, "rw", spec.phases[1])
        a, j = _loop(d, "a", spec.grid[0]), _loop(d, "j", spec.grid[1])
        ih, iw = a * sh + rh - ph0, j * sw + rw - pw0
        out.append(Access(kind, spec.x, [n, c, ih, iw], _inside(ih, H) + _inside(iw, W), d, node=node))
        f, cp = _loop(d, "f", spec.phases[0] * spec.phases[1]), _loop(d, "cp", st.buf.shape[-1])
        out.append(_store(kind, st, [n, f, a * spec.grid[1] + j, cp], d, node))
    elif node.op == "contract" and isinstance(spec, ChannelsLastContraction):
        # x86/gemm_nhwc.py: a unit is (image, 32 wide positions from min(32 pb, wide - 32), block of 32 output
        # channels); per tap and step of 32 channels it reads its rows shifted by the tap's offset, whole rows of
        # channels (of a [N, Q, Cp] copy, or of a value stored channels-last, addressed flat), then each further
        # part's rows at the same positions, and the weight block's B tiles whole; it stores the outputs (oh, ow)
        # with ow < OW, the channels below M
        n, p, c = _loop(d, "n", spec.n), _loop(d, "p", spec.wide), _loop(d, "c", spec.row)
        off = _loop(d, "off", max(o for _, o in spec.taps) + 1)
        if len(spec.a.shape) == 4 and not is_channels_last(spec.a):      # the phase planes' rows
            f = _loop(d, "f", spec.a.shape[1])
            out.append(Access(kind, spec.a, [n, f, p + off, c], [], d, node=node))
        else:
            out.append(Access(kind, spec.a, [n * spec.image + (p + off) * spec.row + c], [], d, node=node, flat=True))
        for k, part in enumerate(spec.parts):     # a further operand's rows at the same positions, unshifted
            pc = _loop(d, f"pc{k}", part.cin)
            if len(part.a.shape) == 4 and not is_channels_last(part.a):
                out.append(Access(kind, part.a, [n, _loop(d, f"pf{k}", part.a.shape[1]), p, pc], [], d, node=node))
            else:
                out.append(Access(kind, part.a, [n * part.image + p * part.row + pc], [], d, node=node, flat=True))
        # the weight block mb's steps, all_steps of them (every tap's, then every part's), each 16 x 32 pairs
        mb, s_ = _loop(d, "mb", spec.m_blocks), _loop(d, "s", spec.all_steps)
        e = _loop(d, "e", 16 * NHWC_MR * 2)
        out.append(Access(kind, spec.w, [(mb * spec.all_steps + s_) * (16 * NHWC_MR * 2) + e], [], d, node=node,
                          flat=True))
        m, oh, ow = _loop(d, "m", spec.m), _loop(d, "oh", spec.out_hw[0]), _loop(d, "ow", spec.out_hw[1])
        out.append(_store(kind, st, [n, m, oh, ow], d, node))
    elif node.op == "qgemm" and isinstance(spec, Int8Contraction):
        # x86/gemm_int8.py: a unit is (image, position panel, weight block); a panel of NR wide positions (at
        # most MAX_NR) reads, per tap, every group of its plane at the panel's positions shifted by the tap's
        # offset: positions below wide + MAX_NR - 1 + the largest offset; the weight blocks and per-channel
        # constants whole; each channel row below M stores its output positions (below P) only
        n, g, f, i = _loop(d, "n", spec.n), _loop(d, "g", spec.groups), _loop(d, "f", spec.num_phases), _loop(d, "i", 4)
        p, off = _loop(d, "p", spec.wide + MAX_NR - 1), _loop(d, "off", spec.max_shift + 1)
        out.append(Access(kind, spec.b, [n, g, f, p + off, i], [], d, node=node))
        mb, t, gbk = _loop(d, "mb", spec.m_blocks), _loop(d, "t", len(spec.taps)), _loop(d, "gbk", spec.g_blocks)
        r, kb = _loop(d, "r", spec.mr), _loop(d, "kb", spec.gb * 4)
        out.append(Access(kind, spec.w, [mb, t, gbk, r, kb], [], d, node=node))
        out.append(Access(kind, spec.comp, [mb * spec.mr + r], [], d, node=node))
        out.append(Access(kind, spec.mult, [mb * spec.mr + r], [], d, node=node))
        m, q = _loop(d, "m", spec.m), _loop(d, "q", spec.p)
        out.append(Access(kind, st.buf, [(n * spec.m + m) * spec.p + q], [], d, node=node, flat=True))
    else:
        out.append(Access(kind, st.buf, [], [z3_false()], d, node=node))
    return out


def _store(kind: str, st: Stage, idx: List[E], d, node: E) -> Access:
    """A micro-kernel's store of ``st.buf[idx]``. The GEMM and row kernels store their whole output whatever
    the stage's region (a split concatenation's piece); the stage's epilogue loads were proved over the
    region only, so the store must stay inside it: checked against the region as a buffer of its own."""
    if st.region is None:
        return Access(kind, st.buf, idx, [], d, node=node)
    axis, lo, hi = st.region
    shape = list(st.buf.shape)
    shape[axis] = hi - lo
    idx = list(idx)
    idx[axis] = idx[axis] - lo
    return Access(kind, Buf(f"{st.buf.name}[region {lo}:{hi}]", st.buf.dtype, tuple(shape)), idx, [], d,
                  node=node)


def z3_false() -> E:
    """A condition standing for "this family's pattern is not expressible": never proved."""
    return E("unprovable", (), DType.BOOL)


def _inside(x: E, size) -> List[E]:
    return [E("cmp", (x, as_index(0)), DType.BOOL, "ge"), E("cmp", (x, as_index(size)), DType.BOOL, "lt")]


def _loads(e: E) -> List[E]:
    return [x for x in nodes(e) if x.op == "load"]


def _is_unprovable(acc: Access) -> bool:
    return any(c.op == "unprovable" for c in acc.conds)


# --- schedules ----------------------------------------------------------------------------------------------

def _region_limit(sched: Schedule, root: Buf):
    if root.base == WEIGHTS:
        return sched.weights_bytes - root.offset
    if root.base == ARENA:
        return sched.arena_bytes - root.offset
    return None


def prove_stage(prover: BoundsProver, sched: Schedule, st: Stage,
                families=None) -> Tuple[int, List[Tuple[Access, str]]]:
    """(number of accesses, the unproved ones with the reason) of one stage (``families``: see
    :func:`stage_accesses`)."""
    ranges = sched.ranges
    accs = stage_accesses(st, families)
    failed = []
    for acc in accs:
        why = "its micro-kernel's access pattern is not expressible here" if _is_unprovable(acc) \
            else prover.check(acc, ranges)
        if why is None:
            root = root_of(acc.buf)
            if root is not acc.buf:
                why = prover.extent(acc.buf, root.nbytes, ranges)
            if why is None:
                limit = _region_limit(sched, root)
                if limit is not None:
                    why = prover.extent(root, limit, ranges)
        if why is not None:
            failed.append((acc, why))
    return len(accs), failed


def prove_schedule(sched: Schedule, variant: str = "generic", prover: Optional[BoundsProver] = None,
                   guard: bool = True, families=None) -> Certificate:
    """Prove every stage of ``sched``; with ``guard``, stages with unproved accesses are rewritten in place
    (:func:`guard_stage`) and proved again, and recorded as ``guarded``. ``families``: the target's
    kernel access patterns (:func:`stage_accesses`; default the x86 micro-kernels')."""
    prover = prover or BoundsProver()
    cert = Certificate()
    t0 = time.perf_counter()
    h0, q0 = prover.hits, prover.queries
    for st in sched.stages:
        t = time.perf_counter()
        count, failed = prove_stage(prover, sched, st, families)
        status = "proved"
        if failed:
            status = "unproved"
            if guard:
                guard_stage(st, [a for a, _ in failed])
                _, still = prove_stage(prover, sched, st, families)
                status = "guarded" if not still else "unproved"
                failed = still or failed      # an unproved kernel: what its guards left unproved
        cert.kernels.append(KernelCertificate(st.name, variant, count, status, time.perf_counter() - t,
                                              [why for _, why in failed]))
    cert.seconds = time.perf_counter() - t0
    cert.cache_hits, cert.queries = prover.hits - h0, prover.queries - q0
    return cert


def guard_stage(st: Stage, failed: List[Access]):
    """Run-time guards for ``st``: every unproved load reads its indices clamped into its buffer (an
    out-of-bounds element reads the nearest one in bounds: no memory outside the buffer is touched; the
    value is then not what the kernel meant, which is why such a kernel is listed), and a micro-kernel
    node with an unproved access is replaced by its plain expression, whose loads are checked (and clamped)
    like any other."""
    families = {id(a.node) for a in failed if a.kind.startswith("family") and a.node is not None}
    loads = {id(a.node) for a in failed if a.kind == "load" and a.node is not None}

    def swap(x: E):
        if id(x) in families:
            return _rebuild(x.args[-1], swap)
        if x.op == "load" and (id(x) in loads or families):
            return E("load", [_clamp(i, dim) for i, dim in zip(x.args, x.attr.shape)], x.dtype, x.attr)
        if x.op == "argscan" and (loads or families):
            src, base, axis, n, better, last = x.attr
            return E("argscan", (), x.dtype,
                     (lambda idx, src=src: _rebuild(src(idx), swap), base, axis, n, better, last))
        return None

    st.expr = _rebuild(st.expr, swap)


def _clamp(i: E, d) -> E:
    return E("clamp", (i,), I64, (0, d - 1))

