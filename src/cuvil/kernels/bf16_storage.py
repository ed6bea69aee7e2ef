"""Which float32 activations may be *stored* as bfloat16 without narrowing anything new: a value whose every
reader is a convolution narrowed to bf16 that takes it as its input (never its weights or bias).

Such a reader rounds its input to bfloat16 (nearest even) before its first product, so storing the rounded
value instead changes no result: the certificate is the readers' own (each was narrowed on a range or on
the relative certificate of :mod:`cuvil.precision.relative`), and nothing new can overflow (the stored values are the ones
the readers compute with). The x86 backend then keeps such values in bfloat16 between its bf16
convolutions (``X86Tuning.bf16_storage``; half the bytes, pair panels packed without rounding) and lists
them in the manifest's ``bf16_activations``; ``cuvil precision report`` counts them.

A reader may also be a move (a ``Concat`` or ``Slice``, :data:`MOVES`) of its elements into a value that may be
stored so, or a ``MaxPool`` (its ``Indices`` output unused) whose own output may be stored so (a ResNet's
stem: Conv -> MaxPool -> bf16 Convs). Round-to-nearest-even is monotone (``a <= b`` implies
``rne(a) <= rne(b)``), keeps ``-inf`` (the pool's padding) exact, and maps NaN to NaN and nothing else to NaN;
so over any window ``max(rne(x_i)) == rne(max(x_i))``, the pool's NaN-skipping max included (the same
positions are NaN; a NaN result stays a NaN): pooling the stored bfloat16 values gives the value the pool's
readers would round its float32 output to. The one difference in bits is a zero's sign (a negative value
too small for bfloat16 rounds to -0, which ties with +0 in the window); a bf16 convolution cannot see it (its
products of a zero are zeros, its sums start at +0, and +0 + -0 is +0). Indices could differ (rounding can
tie two maxima), hence unused. tests/test_bf16_max_pool.py checks the identity on every bfloat16 boundary.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional

from ..ir.dtype import DType
from ..ir.graph import Graph, Node, Value

#: the op whose bf16 kernels read a bfloat16 input (the x86 convolution micro-kernels)
READERS = frozenset({"Conv"})
#: ops that commute with rounding to bfloat16 (monotone, NaN-preserving): a value read only by them may be
#: stored as bfloat16 when their outputs may (the module's docstring proves it for MaxPool)
ROUNDING_COMMUTES = frozenset({"MaxPool"})
#: data movement: each output element is an element of the data input(s), so rounding before or after moving
#: gives the same bits; a value moved only into values that may be stored as bfloat16 may be too (a sum of two 1x1
#: convolutions as one over the concatenation of their inputs: rules/conv_sum.rule)
MOVES = {"Concat": None, "Slice": 0}      # op -> its one data input (None: every input)


def bf16_storage_reason(g: Graph, v: Value, format_of: Callable[[Node], str] = lambda n: n.precision,
                        residual: bool = False) -> Optional[str]:
    """Why ``v`` may be stored as bfloat16 (every reader a bf16 Conv taking it as its input, ``format_of``
    giving a node's format), or None (a graph output, no readers, another reader, not float32).

    ``residual`` (an explicit choice, ``X86Tuning(bf16_residual=True)``; never by default): readers may also
    be ``Add`` / ``Sum`` nodes (a ResNet's skip path), as OpenVINO's bf16 does, when at least one bf16 Conv reads it.
    That *is* a new narrowing: the Add then adds the bf16-rounded value, off by at most 2^-8 relative
    (:mod:`cuvil.precision.relative`'s lemma: finite for every float32 |x| <= 0x1.fep127); the reason says so."""
    if v.dtype != DType.FLOAT or any(o is v for o in g.outputs):
        return None
    users = g.consumers(v)
    if not users:
        return None
    convs, adds, pools, moves, after_residual = [], [], [], [], False
    for u in users:
        if u.op in READERS and format_of(u) == "bf16" and u.inputs[0] is v and not any(x is v for x in u.inputs[1:]):
            convs.append(u.name)
        elif residual and u.op in ("Add", "Sum"):
            adds.append(u.name)
        elif u.op in ROUNDING_COMMUTES and u.inputs[0] is v and _single_output(g, u) and \
                (after := bf16_storage_reason(g, u.outputs[0], format_of, residual)) is not None:
            pools.append(u.name)
            after_residual = after_residual or "residual" in after
        elif u.op in MOVES and (MOVES[u.op] is None or u.inputs[MOVES[u.op]] is v
                                and not any(x is v for j, x in enumerate(u.inputs) if j != MOVES[u.op])) and \
                (after := bf16_storage_reason(g, u.outputs[0], format_of, residual)) is not None:
            moves.append(u.name)
            after_residual = after_residual or "residual" in after
        else:
            return None
    parts = []
    if convs:
        parts.append("bf16 convolution(s) " + ", ".join(sorted(set(convs))))
    if pools:
        parts.append("max pool(s) " + ", ".join(sorted(set(pools))) + ", whose output is stored as bfloat16 (max commutes with "
                     "rounding to nearest even: the same bits" + ("; on a residual path" if after_residual else "") + ")")
    if moves:
        parts.append("moves " + ", ".join(sorted(set(moves))) + " of its elements into values stored as bfloat16 (the "
                     "same bits, rounded before or after the move" + ("; on a residual path" if after_residual else "") + ")")
    if not parts:
        return None
    why = "read only by " + " and ".join(parts)
    if adds:
        why += (" and rounded to bf16 for the residual Add(s) " + ", ".join(sorted(set(adds)))
                + " (relative to float32: at most 2^-8)")
    return why


def _single_output(g: Graph, n: Node) -> bool:
    """``n``'s outputs past the first are absent or unread (a MaxPool's Indices)."""
    return all(o is None or not g.consumers(o) and not any(o is y for y in g.outputs) for o in n.outputs[1:])


def bf16_storage(g: Graph, formats: Dict[str, str]) -> Dict[str, str]:
    """Every value of ``g`` that may be stored as bfloat16 under the node formats ``formats`` (node name ->
    format), with the reason."""
    out = {}
    for n in g.nodes:
        for v in n.outputs:
            if v is not None:
                why = bf16_storage_reason(g, v, lambda u: formats.get(u.name, ""))
                if why is not None:
                    out[v.name] = why
    return out
