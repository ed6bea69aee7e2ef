"""Dynamic batching, pure: which dim of an artifact is its batch dim, and how a list of requests runs as few
calls as possible (joined along that dim, then split back per request). The Ray Serve deployment calls
:meth:`BatchRunner.run_batch` with what ``@serve.batch`` collected; nothing here knows Ray.

The batch dim is the leading dim of every input, one and the same symbol (``N`` in ``x: float[N, 3, 32, 32]``),
which appears nowhere else in the inputs and leads every output too, so that outputs split back by rows. A model
without one (static shapes, or a symbol that is not the leading dim everywhere) runs one request per call.
Requests whose other dims or dtypes differ run in separate calls; a call never holds more rows than the symbol's
profile allows (``max``), nor than ``max_rows``.
"""
from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Sequence, Union

import attrs
import numpy as np

from ..errors import CuvilError
from ..targets.model_api import Model, TensorSpec


def batch_symbol(inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec]) -> Optional[str]:
    """The symbol that is the leading dim of every input and output and appears nowhere else; None if none is."""
    if not inputs or not outputs:
        return None
    lead = {s.dims[0] if s.ndim else None for s in list(inputs) + list(outputs)}
    if len(lead) != 1:
        return None
    sym = lead.pop()
    if not isinstance(sym, str):
        return None
    if any(d == sym for s in list(inputs) + list(outputs) for d in s.dims[1:]):
        return None
    return sym


@attrs.frozen
class Failure:
    """One request's outcome when it did not run: ``status`` 400 (its inputs were refused) or 500 (the model
    failed), and the message for the client."""

    status: int
    message: str


Result = Union[Dict[str, np.ndarray], Failure]


def _text(e: BaseException) -> str:
    if isinstance(e, CuvilError):
        return e.message + (f" (next: {e.hint})" if e.hint else "")
    return f"{type(e).__name__}: {e}"


class BatchRunner:
    """Runs requests (each a dict of input arrays by name) on ``model``, joined along its batch symbol.
    ``calls`` and ``requests`` count what it did (tests and ``stats`` read them)."""

    def __init__(self, model: Model, max_rows: int = 0):
        self.model = model
        self.symbol = batch_symbol(model.inputs, model.outputs)
        prof = model.symbols.get(self.symbol) if self.symbol else None
        limit = prof.max if prof is not None else 0
        if self.symbol is not None and max_rows > 0:
            limit = min(limit, max_rows) if limit else max_rows
        self.max_rows = limit if self.symbol is not None else 1
        if self.symbol is not None and self.max_rows < 2:
            self.symbol, self.max_rows = None, 1
        self.names = [s.name for s in model.inputs]
        self.calls = 0
        self.requests = 0

    def rows(self, inputs: Mapping[str, np.ndarray]) -> int:
        """The batch rows of one request (1 for a model without a batch symbol, or a request not an array)."""
        if self.symbol is None:
            return 1
        a = inputs.get(self.names[0]) if isinstance(inputs, Mapping) else None
        return int(a.shape[0]) if isinstance(a, np.ndarray) and a.ndim else 1

    def check(self, inputs: Mapping[str, np.ndarray]) -> Optional[Failure]:
        """The artifact's own checks of one request's inputs (names, dtype, rank, dims, profile): a 400
        :class:`Failure` with its message, or None when they pass."""
        try:
            self.model.signature.prepare((), dict(inputs))
        except CuvilError as e:
            return Failure(400, _text(e))
        return None

    def _run(self, inputs: Mapping[str, np.ndarray]) -> Dict[str, np.ndarray]:
        self.calls += 1
        return self.model.run(dict(inputs))

    def run_one(self, inputs: Mapping[str, np.ndarray]) -> Result:
        self.requests += 1
        bad = self.check(inputs)
        if bad is not None:
            return bad
        try:
            return self._run(inputs)
        except Exception as e:         # the model failed on inputs its checks accepted: the server's fault
            return Failure(500, f"the model failed: {_text(e)}")

    def run_batch(self, requests: Sequence[Mapping[str, np.ndarray]]) -> List[Result]:
        """Every request's outputs (a dict by name) or its :class:`Failure`, in request order."""
        if self.symbol is None:
            return [self.run_one(r) for r in requests]
        self.requests += len(requests)
        results: List[Optional[Result]] = [None] * len(requests)
        groups: Dict[tuple, List[int]] = {}
        for k, r in enumerate(requests):
            bad = self.check(r)
            if bad is not None:
                results[k] = bad
                continue
            key = tuple((r[n].dtype.str, r[n].shape[1:]) for n in self.names)
            groups.setdefault(key, []).append(k)
        for members in groups.values():
            for chunk in self._chunks(members, requests):
                self._run_joined(chunk, requests, results)
        return results  # type: ignore[return-value]

    def _chunks(self, members: List[int], requests) -> List[List[int]]:
        chunks, cur, rows = [], [], 0
        for k in members:
            n = self.rows(requests[k])
            if cur and rows + n > self.max_rows:
                chunks.append(cur)
                cur, rows = [], 0
            cur.append(k)
            rows += n
        if cur:
            chunks.append(cur)
        return chunks

    def _run_joined(self, chunk: List[int], requests, results: list) -> None:
        if len(chunk) == 1:
            k = chunk[0]
            try:
                results[k] = self._run(requests[k])
            except Exception as e:
                results[k] = Failure(500, f"the model failed: {_text(e)}")
            return
        sizes = [self.rows(requests[k]) for k in chunk]
        joined = {n: np.concatenate([requests[k][n] for k in chunk]) for n in self.names}
        try:
            outs = self._run(joined)
            total = sum(sizes)
            for name, y in outs.items():
                if y.ndim == 0 or y.shape[0] != total:
                    raise CuvilError(f"output {name!r} has shape {list(y.shape)}, not {total} rows to split back")
        except Exception as e:
            for k in chunk:
                results[k] = Failure(500, f"the model failed: {_text(e)}")
            return
        bounds = np.cumsum(sizes)[:-1]
        parts = {name: np.split(y, bounds) for name, y in outs.items()}
        for j, k in enumerate(chunk):
            results[k] = {name: parts[name][j] for name in outs}
