"""ONNX in and out: load (with external data), import into the canonical IR, export back."""
from .onnx_export import export_model
from .onnx_import import import_model, load_model

__all__ = ["load_model", "import_model", "export_model"]
