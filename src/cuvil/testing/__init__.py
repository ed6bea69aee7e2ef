"""Tools for testing models and rules with Cuvil: real architectures with random weights (:mod:`.models`),
single-convolution models (:mod:`.conv_models`), Hypothesis strategies (:mod:`.strategies`), rule checks
(:mod:`.rules`), onnxruntime as oracle and error measures (:mod:`.oracles`, needs onnxruntime), fresh compiled
libraries (:mod:`.artifacts`), per-op shape inference against onnx (:mod:`.shape_inference`), errors in ULPs of float32
math over sweeps of float32 bit patterns (:mod:`.ulp`), pytest markers for tests that need a GPU or the CUDA
toolkit (:mod:`.requires`, needs pytest)."""
import importlib

from .models import (LIGHT_MODELS, light_model, light_model_path, small_cnn, strip_final_softmax,
                     with_batch, with_random_weights)


def __getattr__(name: str):
    # `strategies` on first use: it imports Hypothesis, which `cuvil zoo` (through .zoo and .models) does not need
    if name == "strategies":
        return importlib.import_module(".strategies", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = ["strategies", "LIGHT_MODELS", "light_model", "light_model_path", "small_cnn", "strip_final_softmax",
           "with_batch", "with_random_weights"]
