"""LoRA adapters served beside their base model: many adapters (and the base) in one batch.

``adapter`` reads PEFT folders and llama.cpp's GGUF LoRA files, ``layers`` applies the adapters of
a step's rows to the model's projections, ``manager`` loads, evicts and unloads them at run time.
"""

from astrai.lora.adapter import LoraAdapter, read_adapter, resolve_adapter
from astrai.lora.layers import (
    LoraLinear,
    LoraSet,
    install_lora,
    lora_dtype,
    lora_reference,
    plain_a,
    plain_b,
)
from astrai.lora.manager import Adapter, LoraManager

__all__ = [
    "Adapter",
    "LoraAdapter",
    "LoraLinear",
    "LoraManager",
    "LoraSet",
    "install_lora",
    "lora_dtype",
    "lora_reference",
    "plain_a",
    "plain_b",
    "read_adapter",
    "resolve_adapter",
]
