"""The precision policy: which node computes in which number format, and why every other stays float32.

:func:`plan_precision` bounds every tensor (:mod:`.ranges`), then for each node and each format asks whether
everything the node would hold in that format fits it (:mod:`.formats`): its float inputs (weights by their
actual values), the values it computes inside (LayerNormalization's variance) and its outputs; for int8 its
inputs, whose scale comes from their range. A value whose interval is too wide for fp16 is searched for in the
declared input box (:mod:`.search`): a witness that really exceeds the format is a counterexample and the
node is *refused*; none found leaves it *unknown* (the interval may be loose), and unknown stays float32 too.

Modes (``--precision``): ``fp32`` narrows nothing; ``bf16``/``fp16``/``int8`` narrow every node the target runs
in that format (``Target.precision_ops``) and whose ranges are safe in it; ``auto`` picks per node the
narrowest safe format the target runs. Safe means *certified* (from declared input ranges) for fp16 and for
``auto``; an explicit bf16 or int8 also takes ranges measured on calibration data (bf16 cannot overflow where
float32 does not come within a factor of two of it; int8 saturates instead of producing inf), and the reason
says "measured". So ``auto`` never makes a value non-finite that float32 computes finite.
"""
from __future__ import annotations

from collections import Counter, defaultdict
from typing import Dict, FrozenSet, List, Mapping, Optional, Sequence, Tuple

import attrs
import numpy as np

from ..errors import CuvilError
from ..ir.graph import Graph, Node
from .formats import FORMATS, PRECISIONS, Format
from .heads import kept_fp32
from .inputs import calibration_ranges, declared_ranges
from .interval import CERTIFIED, MEASURED, Interval
from .ranges import analyze, internal_ranges, is_float
from .relative import CONTRACTIONS, MAGNITUDE_OPS, RELATIVE, relative_reason
from .search import Searcher, Witness
from ..kernels.bf16_storage import bf16_storage, bf16_storage_reason

SAFE, REFUSED, UNKNOWN = "safe", "refused", "unknown"

#: Ops that compute nothing a format could change (they move or pick values): never narrowed, not reported.
MOVES = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose", "Identity", "Dropout", "Cast",
                   "CastLike", "Expand", "Tile", "Slice", "Gather", "GatherElements", "GatherND", "Concat",
                   "Split", "Shape", "Size", "Constant", "ConstantOfShape", "DepthToSpace", "SpaceToDepth"})


@attrs.frozen
class Verdict:
    """Whether a node may compute in one format: ``status`` safe/refused/unknown, ``detail`` the proof or what
    failed, ``witness`` the counterexample (refused) or the largest value found (unknown)."""
    status: str
    detail: str
    origin: str = CERTIFIED
    witness: Optional[Witness] = None
    #: how the verdict was reached: "interval", "interval + Z3 (local)", "search", "Z3 + run", "constant",
    #: "calibration (measured)"
    method: str = "interval"

    def to_json(self) -> dict:
        out = {"status": self.status, "method": self.method, "detail": self.detail, "origin": self.origin}
        if self.witness is not None:
            out["witness"] = self.witness.describe()
        return out


@attrs.define
class NodePlan:
    name: str
    op: str
    format: str            # "" float32, else the narrowed format
    reason: str
    range: Optional[Interval]
    verdicts: Dict[str, Verdict]
    #: what the narrowing rests on: "range" (certified or, where stated, measured), "relative to float32"
    #: (bf16 only, :mod:`.relative`), "" when float32
    certificate: str = ""
    #: fp8: per input (the node's order), the exponent ``e`` of its power-of-two scale (:meth:`Format.exponent`);
    #: None for an input that is not narrowed (not float, or absent)
    scales: Tuple[Optional[int], ...] = ()

    def to_json(self) -> dict:
        out = {"op": self.op, "format": self.format or "fp32", "reason": self.reason,
               "verdicts": {f: f"{v.status} ({v.method})" for f, v in self.verdicts.items()}}
        if self.certificate:
            out["certificate"] = self.certificate
        if self.scales:
            out["scale_exponents"] = list(self.scales)
        if self.range is not None:
            out["range"] = [_jnum(self.range.min), _jnum(self.range.max)]
            out["origin"] = self.range.origin
        return out


@attrs.define
class PrecisionPlan:
    mode: str
    target: str
    target_ops: Dict[str, FrozenSet[str]]
    inputs: Dict[str, Interval]
    nodes: List[NodePlan]
    ranges: Dict[str, Interval]               # value name -> interval
    search: str                               # what the counterexample search did
    evaluations: int = 0
    #: values a backend with bf16 convolution kernels keeps as bfloat16 between them (:mod:`cuvil.kernels.bf16_storage`)
    bf16_stored: Dict[str, str] = attrs.field(factory=dict)
    #: of those, the values on a residual (skip) path (read by bf16 convolutions and by ``Add`` / ``Sum``):
    #: name -> reason; an explicit ``--precision bf16`` rounds them to bfloat16 (a new rounding) where their
    #: certified range is finite in bf16 (:func:`residual_storage`)
    bf16_residual: Dict[str, str] = attrs.field(factory=dict)
    #: residual-path values an explicit bf16 request leaves float32: name -> why (range not certified finite)
    residual_fp32: Dict[str, str] = attrs.field(factory=dict)

    def formats(self) -> Dict[str, str]:
        return {n.name: n.format for n in self.nodes if n.format}

    def table(self) -> Dict[str, Dict[str, Counter]]:
        """op type -> format -> Counter(safe/refused/unknown): the overflow paths per layer type."""
        t: Dict[str, Dict[str, Counter]] = defaultdict(lambda: {f: Counter() for f in ("fp16", "bf16", "fp8", "int8")})
        for n in self.nodes:
            for f, v in n.verdicts.items():
                t[n.op][f][v.status] += 1
        return dict(sorted(t.items()))

    def manifest(self) -> dict:
        """The manifest's ``precision`` entry: the mode, the input ranges and per node its format and reason."""
        counts = Counter(n.format or "fp32" for n in self.nodes)
        relative = sum(1 for n in self.nodes if n.certificate == RELATIVE)
        return {"mode": self.mode, **({"relative_to_float32": relative} if relative else {}),
                "target_ops": {f: sorted(ops) for f, ops in sorted(self.target_ops.items())},
                "inputs": {k: {"range": [_jnum(v.min), _jnum(v.max)], "origin": v.origin}
                           for k, v in self.inputs.items()},
                "counts": dict(sorted(counts.items())),
                **({"bf16_residual": dict(self.bf16_residual)} if self.bf16_residual else {}),
                **({"residual_fp32": dict(self.residual_fp32)} if self.residual_fp32 else {}),
                "search": self.search,
                "nodes": {n.name: n.to_json() for n in self.nodes}}


def _jnum(x: float):
    return x if np.isfinite(x) else ("inf" if x > 0 else "-inf" if x < 0 else "nan")


def check_mode(mode: Optional[str]) -> str:
    mode = mode or "fp32"
    if mode not in PRECISIONS:
        raise CuvilError(f"unknown precision {mode!r}; the precisions are {', '.join(PRECISIONS)}",
                         hint="--precision auto picks the narrowest format proved safe per node")
    return mode


def input_intervals(graph: Graph, input_ranges=None, calibration=None) -> Dict[str, Interval]:
    """Declared ranges (certified) over measured ones (calibration data: a path or ``{name: array}``)."""
    from .inputs import load_calibration
    names = [v.name for v in graph.inputs]
    out: Dict[str, Interval] = {}
    if calibration is not None:
        data = load_calibration(str(calibration), names) if isinstance(calibration, (str, bytes)) or hasattr(
            calibration, "__fspath__") else dict(calibration)
        out.update(calibration_ranges(data))
    out.update(declared_ranges(input_ranges, names))
    return out


def plan_precision(graph: Graph, mode: str = "auto", *, input_ranges=None, calibration=None,
                   target_ops: Optional[Mapping[str, FrozenSet[str]]] = None, target: str = "",
                   search_budget: int = 24, int_ranges: Optional[Mapping[str, Tuple[int, int]]] = None,
                   seed: int = 0, z3_rlimit: int = 2_000_000, stores_bf16: bool = True,
                   keep_fp32: Optional[Sequence[str]] = None,
                   transformed: Optional[Mapping[str, float]] = None) -> PrecisionPlan:
    """The precision of every node of ``graph`` (optimised, shapes bound) under ``mode``; see the module doc.
    ``target_ops`` (format -> ops, from ``Target.precision_ops``) limits what is narrowed, not what is
    reported. ``search_budget``: model evaluations the counterexample search may spend (0: none);
    ``z3_rlimit``: Z3's resource limit per local check of a value too wide for fp16 or bf16 (0: no Z3 step).
    ``stores_bf16`` (the target's :func:`~cuvil.targets.base.stores_bf16`; the GPU's is False): values between
    bf16 convolutions are planned as stored in bfloat16 (:attr:`PrecisionPlan.bf16_stored`). ``keep_fp32``: node
    names or op types kept float32 whatever their ranges; None (default): the model's output layers
    (:mod:`.heads`). ``transformed`` (the target's :func:`~cuvil.targets.base.transformed_rounding`): node name ->
    the unit roundoff its inputs' rounding is bounded by where the target computes it in bf16 in another form
    (x86's Winograd F(2x2), which rounds transformed operands: its error is bounded as if its inputs were rounded
    by that much); the ranges after narrowing are re-bounded with it, and its input is not planned as stored in
    bfloat16 (the transform reads it in float32)."""
    transformed = dict(transformed or {})
    mode = check_mode(mode)
    asked = kept_fp32(graph, mode, keep_fp32)
    target_ops = {f: frozenset(o) for f, o in (target_ops or {}).items()}
    inputs = input_intervals(graph, input_ranges, calibration)
    int_ranges = dict(int_ranges or {})
    for v in graph.inputs:   # integer inputs (token ids, masks) searched over their declared ranges
        if not is_float(v) and v.name in inputs and v.name not in int_ranges and inputs[v.name].bounded:
            int_ranges[v.name] = (int(np.ceil(inputs[v.name].min)), int(np.floor(inputs[v.name].max)))
    r = analyze(graph, inputs)
    names = {id(v): v.name for v in graph.values()}
    ranges = {names[k]: iv for k, iv in r.items() if k in names}

    nodes = [n for n in graph.nodes if n.op not in MOVES and any(is_float(o) for o in n.outputs)]
    # the values each node would hold narrowed: (key, node, value or None, internal name, interval)
    held: Dict[str, List[Tuple[str, Node, object, str, Interval, bool]]] = {}
    for n in nodes:
        items = []
        for v in n.inputs:
            if is_float(v) and id(v) in r:
                items.append((v.name, v.producer or n, v, "", r[id(v)], True))
        for k, iv in internal_ranges(graph, n, r).items():
            items.append((f"{n.name}:{k}", n, None, k, iv, False))
        for o in n.outputs:
            if is_float(o) and id(o) in r:
                items.append((o.name, n, o, "", r[id(o)], False))
        held[n.name] = items

    # the search, for every non-constant value too wide for fp16 (the tightest float format)
    fp16 = FORMATS["fp16"]
    goals, seen = [], set()
    for items in held.values():
        for key, prod, v, internal, iv, _ in items:
            if key in seen or (v is not None and getattr(v, "is_const", False)) or fp16.check(iv) is None:
                continue
            if v is not None and v.producer is None:
                continue   # a graph input: its range is the box itself
            seen.add(key)
            goals.append((key, prod, v, internal))
    witnesses: Dict[str, Witness] = {}
    searcher = None
    proved, z3_notes = _z3_step(graph, goals, r, inputs, int_ranges, seed, witnesses) if z3_rlimit else ({}, {})
    goals = [g for g in goals if (g[0], "fp16") not in proved]
    if not goals:
        search = "not needed: every range fits fp16"
    elif search_budget <= 0:
        search = ("not run (refused and unknown nodes both stay float32; `cuvil precision report` searches for "
                  "counterexamples)")
    else:
        searcher = Searcher(graph, inputs, int_ranges, seed)
        why = searcher.runnable
        if why:
            search = f"not run: {why}"
        else:
            for key, w in searcher.run(goals, search_budget).items():
                if key not in witnesses or _mag(w.value) > _mag(witnesses[key].value):
                    witnesses[key] = w
            search = f"{searcher.evaluations} model evaluations over the input box, {len(goals)} values searched"
            if searcher.error:
                search += f"; stopped: {searcher.error}: is every declared range valid for the model?"

    out = []
    for n in nodes:
        verdicts = {name: _verdict(fmt, held[n.name], witnesses, proved, z3_notes) for name, fmt in FORMATS.items()}
        fmt, reason, cert = ("", asked[n.name], "") if n.name in asked and mode != "fp32" else \
            _choose(n, mode, verdicts, target_ops, target, transformed.get(n.name))
        rng = next((iv for k, p, v, i, iv, is_in in held[n.name] if not is_in and not i), None)
        out.append(NodePlan(n.name, n.op, fmt, reason, rng, verdicts, cert))
    _recheck_narrowed(graph, inputs, r, out, mode, transformed)
    for p, n in zip(out, nodes):
        if p.format == "fp8":
            p.scales = tuple(FORMATS["fp8"].exponent(r[id(v)]) if is_float(v) and id(v) in r else None
                             for v in n.inputs)
    convs = stores_bf16 and "Conv" in target_ops.get("bf16", ())
    # (a convolution computed in transformed form reads its input in float32: no reader of the bfloat16 copy)
    stores = {n.name: "" if n.name in transformed else n.format for n in out}
    stored = bf16_storage(graph, stores) if convs else {}
    residual, kept = residual_storage(graph, stores, ranges) if convs and mode == "bf16" else ({}, {})
    stored.update(residual)
    return PrecisionPlan(mode, target, target_ops, inputs, out, ranges, search,
                         searcher.evaluations if searcher else 0, stored, residual, kept)


def residual_storage(graph: Graph, formats: Mapping[str, str], ranges: Mapping[str, Interval]
                     ) -> Tuple[Dict[str, str], Dict[str, str]]:
    """Under an explicit ``--precision bf16``: the values on a residual (skip) path, read by bf16 convolutions
    and by ``Add`` / ``Sum`` (a ResNet block's output), that are stored as bfloat16, with the reason, and
    those kept float32, with why. Unlike the values read only by bf16 convolutions this *is* a new rounding
    (the Add adds the rounded value: at most 2^-8 relative, :mod:`.relative`), so it is taken only where the
    value's range is certified (from declared input ranges, not measured) and finite in bf16 with the
    policy's margin; ``auto`` and fp16 never do it."""
    bf16 = FORMATS["bf16"]
    stored, kept = {}, {}
    for n in graph.nodes:
        for v in n.outputs:
            if v is None:
                continue
            why = bf16_storage_reason(graph, v, lambda u: formats.get(u.name, ""), residual=True)
            if why is None or "residual" not in why:
                continue
            iv = ranges.get(v.name)
            bad = bf16.check(iv) or (None if iv.origin == CERTIFIED else f"range {iv.text()} only measured")
            if bad is None:
                stored[v.name] = f"{why}; --precision bf16 and its range {iv.text()} certified finite in bf16"
            else:
                kept[v.name] = ("on a residual path but kept float32: " + bad)[:240]
    return stored, kept


def _mag(x: float) -> float:
    return float("inf") if not np.isfinite(x) else abs(x)


def _z3_step(graph, goals, r, inputs, int_ranges, seed, witnesses):
    """Z3 on the elementwise cone of every value too wide for fp16 or bf16 (:mod:`.z3local`): ``unsat`` proves
    it within the format's limit; a ``sat`` over the graph inputs alone is confirmed by running the model on it
    (then it is a witness like the search's). Returns ({(key, format) proved}, {(key, format): note})."""
    from .z3local import ELEMENTWISE, local_check
    proved, notes = {}, {}
    searcher = None
    for key, prod, v, internal in goals:
        if internal:
            if not internal.startswith("(x - mean)^2"):
                continue
        elif v is None or v.producer is None or v.producer.op not in ELEMENTWISE:
            continue
        for fname in ("fp16", "bf16"):
            fmt = FORMATS[fname]
            iv = r.get(id(v)) if v is not None else None
            if iv is not None and fmt.check(iv) is None:
                continue
            res = local_check(graph, v, r, inputs, fmt.limit, internal=internal, node=prod)
            notes[(key, fname)] = res.detail
            if res.status == "unsat":
                proved[(key, fname)] = res.detail
            elif res.status == "sat" and res.inputs:
                if searcher is None:
                    searcher = Searcher(graph, inputs, int_ranges, seed)
                if searcher.runnable:
                    continue
                feeds = searcher.point_from(res.inputs)
                found = searcher.measure([(key, prod, v, internal)], searcher.evaluate(feeds)).get(key)
                if found is not None and (key not in witnesses or _mag(found) > _mag(witnesses[key].value)):
                    witnesses[key] = Witness(found, prod.name, internal or f"output {v.name}", feeds, "Z3 + run")
    return proved, notes


def _verdict(fmt: Format, items, witnesses: Mapping[str, Witness], proved=None, z3_notes=None) -> Verdict:
    proved, z3_notes = proved or {}, z3_notes or {}
    origin = MEASURED if any(iv.origin == MEASURED for *_, iv, _ in items) else CERTIFIED
    used_z3 = False
    for key, prod, v, internal, iv, is_input in items:
        if fmt.scaled and not is_input:
            continue   # int8 / fp8 kernels accumulate in int32 / float32 and write float32: only what they read is narrow
        why = fmt.check(iv)
        if why is None:
            continue
        if (key, fmt.name) in proved and origin == CERTIFIED:
            used_z3 = True
            continue
        what = f"{'internal ' + internal if internal else ('input ' if is_input else 'output ') + key}"
        w = witnesses.get(key)
        method = w.method if w is not None else "interval"
        if v is not None and getattr(v, "is_const", False) and iv.lo.size:   # its values are the proof
            extreme = iv.min if abs(iv.min) >= abs(iv.max) else iv.max
            w, method = Witness(extreme, prod.name, f"every input: constant {key}", {}), "constant"
        elif v is not None and v.producer is None and iv.bounded:             # a graph input: the box's edge
            extreme = iv.min if abs(iv.min) >= abs(iv.max) else iv.max
            w, method = Witness(extreme, prod.name, f"the declared range of input {key} (its edge)", {}), \
                "declared range"
        if w is not None and (not np.isfinite(w.value) or abs(w.value) > fmt.max_finite):
            return Verdict(REFUSED, f"{what}: counterexample ({method}): {w.describe()}"
                           + (f" (beyond {fmt.name}'s {fmt.max_finite:.6g})" if np.isfinite(w.value) else
                              " (not finite in float32 either: the model computes it so)"), origin, w, method)
        if w is not None and abs(w.value) > fmt.limit:
            return Verdict(REFUSED, f"{what}: {w.describe()} ({method}), within {fmt.name} but past its margin "
                           f"±{fmt.limit:.6g}", origin, w, method)
        found = f"; the search's largest |value| was {abs(w.value):.4g}" if w is not None else ""
        note = z3_notes.get((key, fmt.name))
        return Verdict(UNKNOWN, f"{what}: {why}{found}{'; ' + note if note else ''} (unknown: the interval may be "
                       "too loose)", origin, w, "interval" + (" + Z3 (local)" if note else "")
                       + (" + search" if w is not None else ""))
    affine = any(iv.method == "affine" for *_, iv, _ in items)
    method = "calibration (measured)" if origin == MEASURED else "interval" + (" + affine" if affine else "") + (
        " + Z3 (local)" if used_z3 else "")
    bound = max((iv.max_abs for *_, iv, is_in in items), default=0.0)
    if fmt.scaled:
        scales = ", ".join((f"{key} scale {fmt.scale(iv):.4g}" if fmt.name == "int8" else
                            f"{key} scale 2^{fmt.exponent(iv)}") for key, p, v, i, iv, is_in in items
                           if is_in and not getattr(v, "is_const", False))
        return Verdict(SAFE, f"every input bounded ({scales or 'constants only'}: nothing saturates)"
                       + (" on calibration data (measured, not certified)" if origin == MEASURED else " (certified)"),
                       origin, None, method)
    if used_z3:
        return Verdict(SAFE, f"every value it holds is within ±{fmt.limit:.6g} (certified: intervals, and Z3 on "
                       "the elementwise cones the intervals over-approximate)", origin, None, method)
    return Verdict(SAFE, f"every value it holds is within ±{bound:.6g}" + (" on calibration data (measured, not "
                   "certified)" if origin == MEASURED else " (certified)"), origin, None, method)


def auto_order(target_ops) -> List[str]:
    """The formats ``auto`` tries, narrowest first; formats of one width in the target's order of preference
    (the order of its ``precision_ops``: the GPU's fp16 before bf16, x86's bf16 kernels, which compute faster
    there, before its float16 weight panels), then the format table's order."""
    pref = {f: i for i, f in enumerate(target_ops)}
    return [f.name for f in sorted(FORMATS.values(), key=lambda f: (f.bits, pref.get(f.name, len(pref)), f.order))
            if f.auto]


def _choose(n: Node, mode: str, verdicts: Dict[str, Verdict], target_ops, target: str,
            unit: Optional[float] = None) -> Tuple[str, str, str]:
    """(format or "", reason, certificate) for node ``n``; ``unit``: its bf16 rounding's bound where the target
    computes it in transformed form (``plan_precision``'s ``transformed``)."""
    if mode == "fp32":
        return "", "--precision fp32", ""
    wanted = auto_order(target_ops) if mode == "auto" else [mode]
    reasons, missing = [], []
    for f in wanted:
        if n.op not in target_ops.get(f, ()):
            missing.append(f)
            continue
        v = verdicts[f]
        if v.status == UNKNOWN and mode == "bf16" and n.op in CONTRACTIONS:
            try:   # an explicit bf16 request: the relative certificate (.relative) covers a contraction
                return f, relative_reason(n.op, v.detail, unit), RELATIVE
            except RuntimeError as e:
                reasons.append(f"{f} {v.status}: {v.detail}; {e}")
                continue
        if v.status != SAFE:
            reasons.append(f"{f} {v.status}: {v.detail}")
            continue
        if v.origin == MEASURED and (mode == "auto" or f == "fp16"):
            reasons.append(f"{f}: safe only on measured ranges ({'auto' if mode == 'auto' else 'fp16'} needs "
                           "certified ones: declare --input-range)")
            continue
        return f, f"{f} {v.detail}", "range"
    if missing:
        reasons.append(f"no {'/'.join(missing)} kernel for {n.op} on {target or 'this target'}")
    return "", "; ".join(reasons) if reasons else "no narrower format", ""


def apply_precision(graph: Graph, plan: PrecisionPlan) -> Graph:
    """A copy of ``graph`` with each node's ``precision`` set as ``plan`` decided, and ``storage`` "bf16" on
    the residual-path values the plan rounds to bfloat16 (:attr:`PrecisionPlan.bf16_residual`)."""
    g = graph.clone()
    fmts = plan.formats()
    scales = {p.name: p.scales for p in plan.nodes if p.format and p.scales}
    for n in g.nodes:
        n.precision = fmts.get(n.name, "")
        n.precision_scales = scales.get(n.name, ())
        for v in n.outputs:
            if v is not None:
                v.storage = "bf16" if v.name in plan.bf16_residual else ""
    return g


def reconcile(entry: dict, graph: Graph, why: str) -> dict:
    """The manifest ``precision`` ``entry`` made true of ``graph``, a target's own rewrite of the graph the
    policy saw (x86 fuses attention's MatMuls into a FusedAttention kernel that computes float32): a node the
    policy narrowed that no longer exists narrowed in ``graph`` is recorded as float32, with ``why`` and the
    format the policy had allowed (``policy_format``) and the certificate it rested on (``policy_certificate``;
    ``relative_to_float32`` then counts only the nodes still narrowed on it). A copy; ``entry`` is not changed."""
    narrowed = {x for n in graph.nodes if n.precision for x in (n.name,) + tuple(n.fused_from)}
    nodes = {}
    for name, rec in entry.get("nodes", {}).items():
        if rec.get("format", "fp32") != "fp32" and name not in narrowed:
            rec = {**rec, "format": "fp32", "policy_format": rec["format"],
                   "reason": f"computed in float32: {why} (the policy allowed {rec['format']}: {rec['reason']})"}
            if "certificate" in rec:
                rec["policy_certificate"] = rec.pop("certificate")
        nodes[name] = rec
    return _with_nodes(entry, nodes)


def computed_as(entry: dict, notes: Dict[str, str]) -> dict:
    """The manifest ``precision`` ``entry`` with ``computed_as`` set on the records of the nodes in ``notes``
    (name: how a target's rewrite computes the narrowed node, e.g. x86's bf16 Winograd, which rounds the
    transformed operands rather than the node's own). A copy."""
    nodes = {name: ({**rec, "computed_as": notes[name]} if name in notes else rec)
             for name, rec in entry.get("nodes", {}).items()}
    return {**entry, "nodes": nodes}


def merge_reconciled(entry: dict, parts: Sequence[Tuple[str, dict]]) -> dict:
    """The manifest ``precision`` ``entry`` with every node that one of ``parts`` ((label, entry) pairs: the same
    plan :func:`reconcile`-d by separate builds, a GPU profile bundle's buckets) records as float32 recorded so,
    the label added to its reason: a node is narrowed in the whole artifact only where every build narrowed it."""
    nodes = dict(entry.get("nodes", {}))
    for label, part in parts:
        for name, rec in part.get("nodes", {}).items():
            if rec.get("format", "fp32") == "fp32" and nodes.get(name, {}).get("format", "fp32") != "fp32":
                nodes[name] = {**rec, "reason": f"{rec.get('reason', '')} ({label})"}
    return _with_nodes(entry, nodes)


def _with_nodes(entry: dict, nodes: dict) -> dict:
    """``entry`` with these node records, its counts and ``relative_to_float32`` recomputed."""
    counts = Counter(r.get("format", "fp32") for r in nodes.values())
    out = {k: v for k, v in entry.items() if k != "relative_to_float32"}
    relative = sum(1 for r in nodes.values() if r.get("certificate") == RELATIVE)
    return {**out, **({"relative_to_float32": relative} if relative else {}), "nodes": nodes,
            "counts": dict(sorted(counts.items()))}


def residual_opted_out(entry: dict, why: str) -> dict:
    """The manifest ``precision`` ``entry`` with its ``bf16_residual`` values moved to ``residual_fp32`` (a
    target told to keep the skip path float32 whatever the plan says, ``why``). A copy."""
    if not entry.get("bf16_residual"):
        return entry
    kept = {**entry.get("residual_fp32", {}), **{k: f"kept float32: {why} (the plan allowed bf16: {v})"
                                                 for k, v in entry["bf16_residual"].items()}}
    return {**{k: v for k, v in entry.items() if k != "bf16_residual"}, "residual_fp32": kept}


#: Unit roundoff of the formats a narrowed contraction rounds its inputs to.
_UNIT = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11, "fp8": 2.0 ** -4}


def _recheck_narrowed(graph: Graph, inputs, r, plans: List[NodePlan], mode: str = "auto",
                      transformed: Optional[Mapping[str, float]] = None) -> None:
    """The ranges above are float32's; a narrowed node computes a little differently (its inputs rounded), and a
    value downstream may then leave its range: a divisor certified in [0.1, 0.5] can round to 0. Re-bound the
    graph with every narrowed node widened by its rounding; where a range that was bounded is no longer (or a
    narrowed node's own values no longer fit), the narrowed nodes upstream of it go back to float32."""
    by_name = {p.name: p for p in plans}
    nodes = {n.name: n for n in graph.nodes}
    transformed = transformed or {}
    for _ in range(len(plans) + 1):
        narrowed = {p.name: (_UNIT[p.format] if p.format != "fp8" else (_UNIT["fp8"], _fp8_pad(graph, nodes[p.name], r)))
                    for p in plans if p.format in _UNIT}
        narrowed.update({k: max(u, narrowed[k]) for k, u in transformed.items()
                         if k in narrowed and by_name[k].format == "bf16"})
        if not narrowed:
            return
        r2 = analyze(graph, inputs, narrowed)
        bad = [n for n in graph.nodes for o in n.outputs
               if id(o) in r and id(o) in r2 and r[id(o)].bounded and not r2[id(o)].bounded]
        fits = lambda n, rr, o: FORMATS[by_name[n.name].format].check(rr[id(o)]) is None
        outgrown = [n for n in graph.nodes if n.name in narrowed and any(   # (a Z3 proof stands for the interval)
            fits(n, r, o) and not fits(n, r2, o) for o in n.outputs if id(o) in r2 and id(o) in r)]
        if mode == "bf16":
            # an explicit bf16 request: where the widened bounds only outgrow float32's magnitude (ops that pass
            # magnitudes on: no divisor, root, log or exponential), the relative certificate covers it
            bad = [n for n in bad if n.op not in MAGNITUDE_OPS]
            for n in outgrown:
                p = by_name[n.name]
                if n.op in CONTRACTIONS and p.format == "bf16" and p.certificate != RELATIVE:
                    try:
                        p.certificate = RELATIVE
                        p.reason = relative_reason(n.op, "its rounding, added to its inputs' ranges, takes its "
                                                   "bounds past ±1.7e38", transformed.get(n.name))
                    except RuntimeError:
                        p.certificate = "range"
                        bad.append(n)
                elif p.certificate != RELATIVE:
                    bad.append(n)
        else:
            bad += outgrown
        if not bad:
            return
        for n in _ancestors(bad):
            p = by_name.get(n.name)
            if p is not None and p.name in narrowed:
                p.format, p.certificate, p.reason = "", "", (f"{p.format} safe for its own values, but its rounding makes a value "
                                          f"downstream ({bad[0].name}) leave its float32 range: kept float32")


def _fp8_pad(graph: Graph, n: Node, r) -> float:
    """The absolute part of a fp8 product's rounding, beside the relative ``2^-4`` the recheck adds anyway: below
    ``2^-6`` (scaled) E4M3 is subnormal, each rounding off by up to ``eta = 2^-10·2^e`` absolutely (a value can
    round to 0). Over K terms ``|a'b' - ab| <= K ((1 + u)(eta_a·max|b| + eta_b·max|a|) + eta_a·eta_b)``, times
    Gemm's |alpha|; inf where the operands or K are not bounded."""
    from .ranges import _contracted
    e = FORMATS["fp8"].exponent
    ins = [r.get(id(v)) if v is not None else None for v in n.inputs[:2]]
    k = _contracted(graph, n)
    if k < 0 or any(iv is None or not iv.bounded for iv in ins):
        return float("inf")
    ea, eb = (e(iv) for iv in ins)
    eta_a, eta_b = 2.0 ** (ea - 10), 2.0 ** (eb - 10)
    amax, bmax = ins[0].max_abs, ins[1].max_abs
    alpha = abs(float(n.attrs.get("alpha", 1.0))) if n.op == "Gemm" else 1.0
    return alpha * k * ((1 + _UNIT["fp8"]) * (eta_a * bmax + eta_b * amax) + eta_a * eta_b)


def _ancestors(nodes) -> List[Node]:
    seen, stack, out = set(), list(nodes), []
    while stack:
        n = stack.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        out.append(n)
        stack.extend(v.producer for v in n.inputs if v is not None and v.producer is not None)
    return out
