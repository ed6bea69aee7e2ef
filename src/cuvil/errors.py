"""The typed errors of Cuvil's public interface. Each message is one line that names what failed."""
from __future__ import annotations


class CuvilError(Exception):
    """Base of every error Cuvil raises on purpose."""


class ModelLoadError(CuvilError):
    """The file or bytes are not a readable ONNX model."""


class UnsupportedOpError(CuvilError):
    """An op (or one of its attribute values) has no Cuvil implementation."""

    def __init__(self, op: str, node: str = "", opset: int | None = None, detail: str = "", domain: str = ""):
        self.op, self.node, self.opset, self.domain = op, node, opset, domain
        where = f" (node {node!r}" + (f", opset {opset}" if opset is not None else "") + ")" if node or opset else ""
        qual = f"{domain}::{op}" if domain else op
        super().__init__(f"unsupported op {qual}{where}" + (f": {detail}" if detail else ""))


class UnsupportedDomainError(CuvilError):
    """A node or opset import uses an operator domain other than the default ONNX one."""


class ShapeError(CuvilError):
    """Shapes or dtypes that do not fit an op, or that contradict what the model declares."""


class GraphError(CuvilError):
    """A graph whose structure breaks the IR's invariants: a cycle, a value used before it is defined, a
    node removed while still used, two outputs of one name."""


class InvalidAttributeError(ShapeError):
    """A node attribute of the wrong type, or a required attribute that is missing (a ShapeError too, so code
    that catches "this node does not fit its op" keeps catching it)."""


class UnsupportedTypeError(CuvilError):
    """An element type Cuvil does not know (ONNX data_type 0, an unassigned code) or does not support there."""


class DeclaredShapeWarning(UserWarning):
    """A value's shape as the model declares it (a graph output, a value_info) contradicts the shape Cuvil infers
    from the inputs; Cuvil goes on with the inferred one, as onnxruntime does (exporters write stale
    declarations: ddddocr's CRNN declares its output [1, '?'], it is [W', 1, 8210])."""
