"""Tools for testing models and rules with Cuvil: real architectures with random weights, oracles."""
from . import strategies
from .models import (LIGHT_MODELS, light_model, light_model_path, small_cnn, strip_final_softmax,
                     with_batch, with_random_weights)

__all__ = ["strategies", "LIGHT_MODELS", "light_model", "light_model_path", "small_cnn", "strip_final_softmax",
           "with_batch", "with_random_weights"]
