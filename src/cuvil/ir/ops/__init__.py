"""Importing this package registers every op family with the registry (one module per family)."""
from importlib import import_module

FAMILIES = ("elementwise", "activation", "conv", "pool", "norm", "matmul", "reduce", "softmax", "shape",
            "indexing", "cast", "resize", "misc", "quant", "winograd", "control", "recurrent", "spectral",
            "attention")

for _f in FAMILIES:
    import_module(f"{__name__}.{_f}")
