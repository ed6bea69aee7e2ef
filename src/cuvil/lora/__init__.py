"""LoRA adapters: read PEFT directories and .onnx_adapter files, map their modules to an ONNX graph's weights,
and merge them at compile time (W + sum of weight * scale * B @ A, correctly rounded)."""
from .adapter import Adapter, LoraModule, read_adapter
from .mapping import LoraTarget, load_lora_map, map_adapter

__all__ = ["Adapter", "LoraModule", "read_adapter", "LoraTarget", "map_adapter", "load_lora_map"]
