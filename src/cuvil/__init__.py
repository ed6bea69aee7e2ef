"""Cuvil: a compiler-as-a-library from ONNX inference graphs to self-contained native artifacts."""
from .errors import (CuvilError, GraphError, InvalidAttributeError, ModelLoadError, ShapeError, UnsupportedDomainError,
                     UnsupportedOpError, UnsupportedTypeError)
from .artifact import Model, load
from .pipeline import Pipeline
from .signing import keygen, sign, verify_artifact
from .version import __version__


__all__ = ["Pipeline", "load", "Model", "CuvilError", "GraphError", "InvalidAttributeError", "ModelLoadError",
           "ShapeError", "UnsupportedDomainError", "UnsupportedOpError", "UnsupportedTypeError", "__version__", "keygen", "sign", "verify_artifact"]
