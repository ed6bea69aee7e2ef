"""The rewrite engine: applies proved rules to a fixpoint with a worklist, highest benefit first.

Each application replaces the uses of the matched root by the built replacement, after checking that the
replacement has exactly the root's type (dtype and shape, symbols included). The code passes (folding,
CSE, DCE) run in the same loop, so a rule's constant sub-expressions fold before the next round.
"""
from __future__ import annotations

from collections import Counter, deque
from typing import Callable, Dict, List, Optional, Sequence

import attrs

from ..dsl.ast import Rule
from ..dsl.compiler import Bindings, BuildError, build, match
from ..errors import CuvilError
from ..ir.graph import Graph, Node
from .cse import eliminate_common_subexpressions
from .dce import eliminate_dead_code
from .fold import fold_constants
from .select import fold_constant_selects
from ..ir.lifting import drop_default_attrs
from .shape_prop import propagate_shapes

MAX_ROUNDS = 16
Accept = Callable[[Rule, Bindings], bool]


class NonTerminationError(CuvilError):
    """A rule set kept rewriting past the iteration cap (typically a rule and its inverse)."""


@attrs.define
class RewriteReport:
    rounds: int = 0
    counts: Dict[str, int] = attrs.field(factory=dict)      # per pass: "rules", "fold", "cse", "dce"
    applied: Counter = attrs.field(factory=Counter)         # per rule name
    verdicts: Dict[str, str] = attrs.field(factory=dict)     # rule name -> obligation proved ("exact"/"real")
    proofs: Dict[str, dict] = attrs.field(factory=dict)      # rule name -> verdict, what it covers, dtypes

    def add(self, name: str, n: int) -> None:
        self.counts[name] = self.counts.get(name, 0) + n


def _cap(g: Graph) -> int:
    return max(10_000, 50 * len(g.nodes))


#: the ops whose ``precision`` the policy sets (its narrowed contractions); a narrowed one rounds its first two
#: operands to the format
NARROWED_OPS = frozenset({"Conv", "MatMul", "Gemm"})
#: contractions over transformed operands (an ``on x86`` rule's WinogradConv F(2x2), which the target accepts for
#: a bf16 convolution only where its kernels take it: cuvil.targets.x86.choose). In bf16 they round the transformed
#: input (V = Bt d B, sums of at most 4 inputs) and weights (U = G g Gt, at most 2.25 times the largest weight) and
#: sum in float32: not the rounding the policy certified for the convolution, so the target states its bound
#: (cuvil.targets.base.transformed_rounding, X86Target.transformed_rounding) and the policy re-bounds the
#: narrowed ranges with it; a tile whose values are not finite is computed again directly (the kernel's fallback)
TRANSFORMED_OPS = frozenset({"WinogradConv"})
#: ops that only move elements: rounding before or after them gives the same values
_MOVES = frozenset({"Concat", "Slice"})


def carry_precision(b: Bindings, created: List[Node]) -> None:
    """After a rule that runs once the precision policy has narrowed nodes (an ``on x86`` rule): where every
    contraction the pattern matched computes in bf16 (float32's exponent: a longer float32 sum of the same exact
    products needs no new range), a contraction of the replacement whose rounded operands are those
    contractions' operands, or moves of them (Concat, Slice: rules/conv_sum.rule's one convolution over two
    inputs' channels), computes in bf16 too and records the matched ones' names (``Node.fused_from``). It rounds
    the same values the same way and sums in float32, so the certificates the policy gave the matched nodes cover
    it. A Winograd F(2x2) convolution over the matched one's input (:data:`TRANSFORMED_OPS`) computes in bf16 too,
    on the bound its target states for that form. Anywhere else (another format or none, an operand the
    replacement computes, such as a sum of weights) the replacement stays float32."""
    narrowed = [n for n in b.nodes if n.op in NARROWED_OPS]
    formats = {n.precision for n in narrowed}
    if formats != {"bf16"}:
        return       # (fp8's per-input scales, fp16's ranges of longer sums: not carried)
    operands = {id(v) for n in narrowed for v in n.inputs[:2] if v is not None}
    made = {id(o): c for c in created for o in c.outputs}

    def moved(v) -> bool:
        if id(v) in operands:
            return True
        c = made.get(id(v))
        return c is not None and c.op in _MOVES and moved(c.inputs[0]) and (
            c.op == "Slice" or all(x is not None and moved(x) for x in c.inputs))
    for c in created:
        if (c.op in NARROWED_OPS and all(v is not None and moved(v) for v in c.inputs[:2])) or (
                c.op in TRANSFORMED_OPS and int(c.attrs.get("tile", 4)) == 2 and c.inputs[0] is not None
                and moved(c.inputs[0])):
            c.precision = "bf16"
            c.fused_from = tuple(sorted(x for n in narrowed for x in (n.fused_from or (n.name,))))


def apply_rules(g: Graph, rules: Sequence[Rule], report: RewriteReport, accept: Optional[Accept] = None) -> int:
    """One worklist pass of ``rules`` over ``g``; returns the number of rewrites. ``accept(rule, bindings)``
    (a target's cost model) may decline a match: legality is the rule's, profitability the target's."""
    by_op: Dict[str, List[Rule]] = {}
    for r in sorted(rules, key=lambda r: -r.benefit):  # stable: file order breaks ties
        by_op.setdefault(r.lhs.op, []).append(r)
    work = deque(n for n in g.nodes if n.op in by_op)
    alive = set(map(id, g.nodes))
    count, cap = 0, _cap(g)
    recent: Counter = Counter()
    while work:
        n = work.popleft()
        if id(n) not in alive or not n.outputs:
            continue
        root = n.outputs[0]
        if not root.uses and root not in g.outputs:
            continue
        for r in by_op.get(n.op, ()):
            b = match(r, root, g)
            if b is None or (accept is not None and not accept(r, b)):
                continue
            created: List[Node] = []
            try:
                new = build(r, b, g, created)
                ok = new.type == root.type and new is not root
            except BuildError:
                ok = False
            if not ok:
                if created:
                    g.remove_nodes(created)
                continue
            for c in created:
                drop_default_attrs(c)  # replacements stay in canonical form
                c.guard = n.guard      # they compute what the matched root did, for the same readers
            carry_precision(b, created)
            users = g.consumers(root)
            g.replace_all_uses(root, new)
            if new.producer is not None and new.producer in created:
                new.name, root.name = root.name, new.name  # the rewritten value keeps the model's name
            alive.update(map(id, created))
            report.applied[r.name] += 1
            recent[r.name] += 1
            count += 1
            if count > cap:
                top = ", ".join(f"{name} ({k} times)" for name, k in recent.most_common(3))
                raise NonTerminationError(
                    f"the rules do not terminate: {count} rewrites without reaching a fixpoint; still firing: "
                    f"{top}. Is one rule the inverse of another?")
            work.extend(c for c in created if c.op in by_op)
            work.extend(c for c in users if c.op in by_op)
            break
    if count:
        g.toposort()
    return count


def rewrite(g: Graph, rules: Sequence[Rule], report: RewriteReport | None = None, *, phase: str = "graph",
            accept: Optional[Accept] = None) -> RewriteReport:
    """Rules of ``phase`` and code passes to a joint fixpoint, then shape propagation and verification."""
    report = report or RewriteReport()
    graph_rules = [r for r in rules if r.on == phase]
    g.toposort()
    for _ in range(MAX_ROUNDS):
        report.rounds += 1
        changed = 0
        n = apply_rules(g, graph_rules, report, accept) if graph_rules else 0
        report.add("rules", n)
        changed += n
        for name, fn in (("fold", fold_constants), ("select", fold_constant_selects),
                         ("cse", eliminate_common_subexpressions), ("dce", eliminate_dead_code)):
            k = fn(g)
            report.add(name, k)
            changed += k
        # Folding re-infers only the nodes it lifts constants into: types further down (a Shape of a Pad whose
        # pads were just folded) are refreshed here, and a refresh that settles a shape folds on another round.
        if not changed and not propagate_shapes(g):
            break  # types are fresh: the refresh just ran and changed nothing
    else:
        propagate_shapes(g)
    g.verify()
    return report
