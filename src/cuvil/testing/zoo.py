"""The models ``cuvil zoo NAME -o OUT`` writes: onnx's light architectures with seeded random weights, and
a BERT-style encoder block with symbolic batch and sequence length (the README's dynamic-shape example)."""
from __future__ import annotations

from typing import Dict

import onnx

from ..errors import CuvilError
from .bert_block import bert_block
from .models import LIGHT_MODELS, light_model

#: name -> what it is (one line, printed after writing it).
ZOO: Dict[str, str] = {
    **{name: f"light {name} with seeded random weights" for name in LIGHT_MODELS},
    "bert-block": "a BERT-style encoder block, x[B, S, 64] and attention_mask[B, S] -> y[B, S, 64], seeded random weights",
}


def zoo_model(name: str, seed: int = 0, softmax: bool = False) -> onnx.ModelProto:
    """The zoo model ``name``; ``softmax`` keeps a light model's final Softmax (default: logits)."""
    if name not in ZOO:
        raise CuvilError(f"unknown zoo model {name!r}", hint=f"choose one of: {', '.join(ZOO)}")
    if name == "bert-block":
        return bert_block(seed=seed)
    return light_model(name, seed=seed, logits=not softmax)
