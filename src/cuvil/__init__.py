"""Cuvil: a compiler-as-a-library from ONNX inference graphs to self-contained native artifacts."""
from .errors import (CuvilError, GraphError, InvalidAttributeError, ModelLoadError, ShapeError, UnsupportedDomainError,
                     UnsupportedOpError, UnsupportedTypeError)
from .pipeline import Pipeline
from .version import __version__


def load(path, num_threads: int = 0, fallback=None, **gpu):
    """Open a compiled ``libNAME.so`` (ctypes; any process, no recompilation) or a GPU bundle ``NAME.cuvil/``
    (``fallback="libNAME.so"``: load that instead, with a warning, where the bundle cannot run)."""
    from .artifact import load as _load
    return _load(path, num_threads=num_threads, fallback=fallback, **gpu)


__all__ = ["Pipeline", "load", "CuvilError", "GraphError", "InvalidAttributeError", "ModelLoadError", "ShapeError",
           "UnsupportedDomainError", "UnsupportedOpError", "UnsupportedTypeError", "__version__"]
