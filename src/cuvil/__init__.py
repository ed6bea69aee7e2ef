"""Cuvil: a compiler-as-a-library from ONNX inference graphs to self-contained native artifacts."""
from .errors import CuvilError, ModelLoadError, ShapeError, UnsupportedDomainError, UnsupportedOpError
from .pipeline import Pipeline

__version__ = "0.1.0"

__all__ = ["Pipeline", "CuvilError", "ModelLoadError", "ShapeError", "UnsupportedDomainError",
           "UnsupportedOpError", "__version__"]
