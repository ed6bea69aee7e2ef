"""The search for a counterexample: an input inside the declared box for which a value reaches a magnitude its
interval only suggests (fp16 overflow, a non-finite value).

Intervals over-approximate: a range past 65504 may be a real overflow or only the analysis' looseness. The
search runs the model (the ONNX reference evaluator, every intermediate value kept) on inputs chosen to drive
the flagged values to their extremes: the box's corners (all low, all high, alternating, random sign
patterns), random points, then a hill climb from the best one per goal that flips blocks of coordinates to the
opposite corner. A value found is a witness of a real computation in float32, so ``|v| > 65504`` there means
float16 cannot hold it: the input is a counterexample (:class:`Witness`), reproducible by running the model.
"""
from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import attrs
import numpy as np

from ..ir.graph import Graph, Node, Value
from .interval import Interval
from .ranges import internal_values, is_float

#: A goal: the key of the value searched (a value name, or ``"node:internal"``), with the node computing it.
Goal = Tuple[str, Node, Optional[Value], str]


@attrs.frozen(eq=False)
class Witness:
    """The largest magnitude found for one value: ``value`` (signed, float32 computation) at ``node``
    (``where``: the output or internal value), reached for ``inputs``."""
    value: float
    node: str
    where: str
    inputs: Mapping[str, np.ndarray]
    method: str = "search"

    def describe(self, limit: int = 4) -> str:
        if not self.inputs:
            return f"{self.where} holds {self.value:.6g}, read by {self.node}"
        parts = []
        for k, a in self.inputs.items():
            a = np.asarray(a)
            flat = a.ravel()
            shown = ", ".join(f"{x:.4g}" for x in flat[:limit]) + (", ..." if flat.size > limit else "")
            parts.append(f"{k}{list(a.shape)}=[{shown}]")
        return f"input {'; '.join(parts)} gives {self.value:.6g} at {self.node} ({self.where})"


def static_shape(v: Value) -> Optional[Tuple[int, ...]]:
    shape = v.type.shape
    if shape is None or not all(isinstance(d, (int, np.integer)) for d in shape):
        return None
    return tuple(int(d) for d in shape)


class Searcher:
    """Evaluates ``graph`` on points of the box and keeps, per goal, the input giving the largest |value|."""

    def __init__(self, graph: Graph, box: Mapping[str, Interval], int_ranges: Mapping[str, Tuple[int, int]] = None,
                 seed: int = 0):
        from ..frontend.onnx_export import export_model
        from ..reference import reference_evaluator
        self.graph = graph
        self.box = box
        self.int_ranges = dict(int_ranges or {})
        self.rng = np.random.default_rng(seed)
        self.shapes = {v.name: static_shape(v) for v in graph.inputs}
        self.evaluator = reference_evaluator(export_model(graph))
        self.out_names = {id(v): name for v, name in zip(graph.outputs, graph.output_names)}
        self.evaluations = 0
        self.error = ""   # why the search stopped early

    @property
    def runnable(self) -> Optional[str]:
        """None when the search can run, else why not."""
        for v in self.graph.inputs:
            if self.shapes[v.name] is None:
                return f"input {v.name} has symbolic dims (fix them: --input-shape)"
            if is_float(v) and v.name not in self.box:
                return f"input {v.name} has no declared range to search"
        return None

    # --- points of the box -------------------------------------------------------------------------------
    def _point(self, kind: str) -> Dict[str, np.ndarray]:
        feeds = {}
        for v in self.graph.inputs:
            shape = self.shapes[v.name]
            if not is_float(v):
                lo, hi = self.int_ranges.get(v.name, (0, 0))
                feeds[v.name] = self.rng.integers(lo, hi + 1, size=shape).astype(np.int64)
                continue
            iv = self.box[v.name]
            lo = np.broadcast_to(iv.lo, shape)
            hi = np.broadcast_to(iv.hi, shape)
            if kind == "lo":
                x = lo
            elif kind == "hi":
                x = hi
            elif kind == "alternate":
                x = np.where((np.indices(shape).sum(0) % 2) == 0, lo, hi)
            elif kind == "corner":
                x = np.where(self.rng.random(shape) < 0.5, lo, hi)
            else:
                x = lo + (hi - lo) * self.rng.random(shape)
            feeds[v.name] = np.ascontiguousarray(x, dtype=np.float32)
        return feeds

    def point_from(self, values: Mapping[str, float]) -> Dict[str, np.ndarray]:
        """A full input from one value per input (a Z3 model): each input filled with it (clipped to the box)."""
        feeds = self._point("lo")
        for name, x in values.items():
            if name in feeds and name in self.box:
                iv = self.box[name]
                feeds[name] = np.full(feeds[name].shape, np.clip(x, iv.min, iv.max), np.float32)
        return feeds

    def _flip(self, feeds: Dict[str, np.ndarray], frac: float) -> Dict[str, np.ndarray]:
        out = dict(feeds)
        for v in self.graph.inputs:
            if not is_float(v):
                continue
            iv, x = self.box[v.name], feeds[v.name]
            lo, hi = np.broadcast_to(iv.lo, x.shape), np.broadcast_to(iv.hi, x.shape)
            mask = self.rng.random(x.shape) < frac
            other = np.where(np.abs(x - lo) < np.abs(x - hi), hi, lo)
            out[v.name] = np.where(mask, other, x).astype(np.float32)
        return out

    # --- evaluation ------------------------------------------------------------------------------------------
    def evaluate(self, feeds: Mapping[str, np.ndarray]) -> Dict[str, np.ndarray]:
        self.evaluations += 1
        with np.errstate(all="ignore"):
            return self.evaluator.run(None, dict(feeds), intermediate=True)

    def measure(self, goals: Sequence[Goal], values: Mapping[str, np.ndarray]) -> Dict[str, float]:
        """Signed value of largest magnitude per goal (inf/nan when reached)."""
        out = {}
        for key, node, value, internal in goals:
            if internal:
                ins = [self._lookup(values, v) for v in node.inputs[:1]]
                if ins[0] is None:
                    continue
                with np.errstate(all="ignore"):
                    arr = internal_values(node, ins).get(internal)
            else:
                arr = self._lookup(values, value)
            if arr is None or not np.asarray(arr).size:
                continue
            a = np.asarray(arr, dtype=np.float64).ravel()
            if np.isnan(a).any():
                out[key] = float("nan")
                continue
            i = int(np.argmax(np.abs(a)))
            out[key] = float(a[i])
        return out

    def _lookup(self, values, v: Value):
        if v is None:
            return None
        if v.is_const:
            return v.const
        got = values.get(v.name)
        if got is None:
            got = values.get(self.out_names.get(id(v), ""))
        return got

    def run(self, goals: Sequence[Goal], budget: int = 24) -> Dict[str, Witness]:
        """The best witness per goal within ``budget`` evaluations of the model."""
        best: Dict[str, Tuple[float, Dict[str, np.ndarray]]] = {}

        def score(x: float) -> float:
            return float("inf") if not np.isfinite(x) else abs(x)

        def consider(feeds):
            if self.error:
                return
            try:
                values = self.evaluate(feeds)
            except Exception as e:   # the model refuses a point of the declared box (an id past the vocabulary)
                self.error = f"the model failed on a point of the declared box ({type(e).__name__}: {e})"
                return
            found = self.measure(goals, values)
            for key, val in found.items():
                if key not in best or score(val) > score(best[key][0]):
                    best[key] = (val, feeds)

        kinds = ["hi", "lo", "alternate", "corner", "uniform"]
        n_start = min(budget, max(len(kinds), budget // 2))
        for i in range(n_start):
            consider(self._point(kinds[i] if i < len(kinds) else ("corner" if i % 2 else "uniform")))
        # hill climb on the goals, in turn, from their best point
        keys = [g[0] for g in goals if g[0] in best]
        for i in range(budget - n_start):
            if not keys:
                break
            key = keys[i % len(keys)]
            if not np.isfinite(best[key][0]):
                continue
            consider(self._flip(best[key][1], 0.05 if i % 2 else 0.25))
        by_key = {g[0]: g for g in goals}
        return {key: Witness(val, by_key[key][1].name, by_key[key][3] or f"output {by_key[key][2].name}", feeds)
                for key, (val, feeds) in best.items()}
