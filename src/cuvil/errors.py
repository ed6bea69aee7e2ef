"""The typed errors of Cuvil's public interface. Each message is one line that names what failed, in the
user's spelling (names as the model writes them), with at most a few lines of detail and the next step that
works."""
from __future__ import annotations

import copy
from typing import Iterable, Optional

#: The most detail lines an error shows; the rest are summarised as "... N more".
MAX_DETAIL_LINES = 6
#: Detail lines longer than this are cut (an expression of 4 kB helps nobody).
MAX_DETAIL_CHARS = 240


class CuvilError(Exception):
    """Base of every error Cuvil raises on purpose.

    ``CuvilError(message, hint=..., details=[...])``: ``message`` is one line naming the problem; ``hint`` the
    next step that works (``"give --input-shape x=1x3x640x640"``); ``details`` a few supporting lines (shown
    truncated). ``str(e)`` is the message followed by the details and the hint, one per line, so a Python user
    sees all three; the CLI prints them as ``cuvil: error: MESSAGE`` then indented lines.
    """

    #: The next step of every error of this class that gives none of its own.
    default_hint: Optional[str] = None

    def __init__(self, message: str = "", *args, hint: Optional[str] = None, details: Iterable[str] = ()):
        super().__init__(message, *args)
        self.message = str(message)
        self.hint = hint if hint is not None else self.default_hint
        self.details = [str(d) for d in details]

    def with_context(self, prefix: str) -> "CuvilError":
        """The same error (same class, hint and details) with ``prefix`` before its message: ``node 'y' (Einsum):
        missing required attribute 'equation'``."""
        out = copy.copy(self)
        out.message = f"{prefix}{self.message}"
        out.args = (out.message,)
        out.details = list(self.details)
        return out

    def detail_lines(self) -> list:
        """The details as shown: at most MAX_DETAIL_LINES, each cut to MAX_DETAIL_CHARS."""
        lines = [_cut(d) for d in self.details[:MAX_DETAIL_LINES]]
        if len(self.details) > MAX_DETAIL_LINES:
            lines.append(f"... {len(self.details) - MAX_DETAIL_LINES} more")
        return lines

    def __str__(self) -> str:
        text = self.message if not self.args[1:] else super().__str__()
        extra = [f"  {d}" for d in self.detail_lines()] + ([f"  next: {self.hint}"] if self.hint else [])
        return "\n".join([text] + extra)


def _cut(line: str) -> str:
    return line if len(line) <= MAX_DETAIL_CHARS else line[:MAX_DETAIL_CHARS - 3] + "..."


#: What to do about a model that breaks the ONNX spec: see every problem onnx finds, then export it again.
CHECK_MODEL_HINT = ("run onnx's checker on it (python -c \"import onnx; onnx.checker.check_model('MODEL.onnx', "
                    "full_check=True)\") and export the model again")


class ModelLoadError(CuvilError):
    """The file or bytes are not a readable ONNX model."""

    default_hint = CHECK_MODEL_HINT


#: What to do about an op Cuvil lacks: see what it supports, and get the model without the op.
UNSUPPORTED_OP_HINT = ("`cuvil ops` lists the ops Cuvil supports on each target; export the model without this op "
                       "(ONNX's own ops, another opset or exporter option), or replace it in the ONNX file")
#: What to do about an element type Cuvil lacks.
UNSUPPORTED_TYPE_HINT = ("export the model with float32/float16/int64 tensors there (a Cast in the exporter), or "
                         "replace the type in the ONNX file")


class UnsupportedOpError(CuvilError):
    """An op (or one of its attribute values) has no Cuvil implementation. ``op``, ``node``, ``opset``,
    ``domain`` name the first such node; ``nodes`` lists every one where an import collected them all
    (:func:`cuvil.frontend.survey.unsupported_nodes`), and the message then names every op."""

    default_hint = UNSUPPORTED_OP_HINT

    def __init__(self, op: str, node: str = "", opset: int | None = None, detail: str = "", domain: str = "", *,
                 message: Optional[str] = None, hint: Optional[str] = None,
                 details: Iterable[str] = (), nodes: Iterable = ()):
        self.op, self.node, self.opset, self.domain = op, node, opset, domain
        self.nodes = list(nodes)
        if message is None:
            where = f" (node {node!r}" + (f", opset {opset}" if opset is not None else "") + ")" if node or opset else ""
            qual = f"{domain}::{op}" if domain else op
            message = f"unsupported op {qual}{where}" + (f": {detail}" if detail else "")
        super().__init__(message, hint=hint, details=details)


class UnsupportedDomainError(CuvilError):
    """A node or opset import uses an operator domain other than the default ONNX one."""

    default_hint = UNSUPPORTED_OP_HINT


class ShapeError(CuvilError):
    """Shapes or dtypes that do not fit an op, or that contradict what the model declares."""


class GraphError(CuvilError):
    """A graph whose structure breaks the IR's invariants: a cycle, a value used before it is defined, a
    node removed while still used, two outputs of one name."""


class InvalidAttributeError(ShapeError):
    """A node attribute of the wrong type, or a required attribute that is missing (a ShapeError too, so code
    that catches "this node does not fit its op" keeps catching it)."""

    default_hint = CHECK_MODEL_HINT


class UnsupportedTypeError(CuvilError):
    """An element type Cuvil does not know (ONNX data_type 0, an unassigned code) or does not support there."""

    default_hint = UNSUPPORTED_TYPE_HINT


class DeclaredShapeWarning(UserWarning):
    """A value's shape as the model declares it (a graph output, a value_info) contradicts the shape Cuvil infers
    from the inputs; Cuvil goes on with the inferred one, as onnxruntime does (exporters write stale
    declarations: ddddocr's CRNN declares its output [1, '?'], it is [W', 1, 8210])."""
