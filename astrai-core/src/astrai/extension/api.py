"""What an attention backend plugin imports from astrai: this module, and nothing else.

astrai-backend-cpu, astrai-backend-cuda and astrai-backend-flash import from here alone (and
from their own modules); every other module of astrai is internal and may move. The names, by
what a backend does with them:

- implement: ``AttentionBackend`` (the ABC, whose docstrings are the contract), ``KVCache`` (the
  step it attends; a quantized pool's rounding: ``quantize_kv``/``dequantize_kv``), ``Kernel``/``RotaryKernel``/``OPS`` (the fused kernels it may lend the model,
  ``AttentionBackend.kernels``);
- build on: ``TorchNativeBackend`` with its step plan (``NativePlan``, ``plan_step``) to extend,
  ``rotate_torch`` (the rotary formula a kernel falls back to), ``ops`` (the compiled CUDA ops'
  wrappers), ``build_lock`` (one compiler per kernel cache), and the model's ``PackedLinear`` and
  ``QuantizedLinear``, the layers a ``decoder_layers`` kernel runs on;
- fail: ``AstraiError``, ``BackendUnavailable``, ``KernelUnavailable``, ``PluginError``;
- test: ``BackendRegistry`` (the selection policy over in-memory classes), ``attn_backend`` and
  ``ATTN_BACKEND`` (a strict choice), ``check_backend_class`` (what loading checks).

A module of its own rather than ``astrai.extension`` itself: that package is the spec's policy
API, what inference code calls (``attention``, ``apply_rotary_emb``, ``attn_backend``), and the
model imports it; re-exporting the model's layers from it would make importing either package
import the other half-initialised. Nothing in astrai-core imports this module.
"""

from __future__ import annotations

from astrai.errors import AstraiError, BackendUnavailable, KernelUnavailable, PluginError
from astrai.extension import ops
from astrai.extension.backend.base import OPS, AttentionBackend, Kernel, RotaryKernel, check_backend_class
from astrai.extension.backend.policy import BackendRegistry
from astrai.extension.backend.rotary import rotate_torch
from astrai.extension.backend.selection import ATTN_BACKEND, attn_backend
from astrai.extension.backend.torch_native import NativePlan, TorchNativeBackend, plan_step
from astrai.extension.build_lock import build_lock
from astrai.kvcache.cache import KVCache
from astrai.kvcache.quant import dequantize as dequantize_kv
from astrai.kvcache.quant import quantize as quantize_kv
from astrai.model.cpu_linear import PackedLinear
from astrai.model.quant import QuantizedLinear

__all__ = [
    "ATTN_BACKEND",
    "AstraiError",
    "AttentionBackend",
    "BackendRegistry",
    "BackendUnavailable",
    "KVCache",
    "Kernel",
    "KernelUnavailable",
    "NativePlan",
    "OPS",
    "PackedLinear",
    "PluginError",
    "QuantizedLinear",
    "RotaryKernel",
    "TorchNativeBackend",
    "attn_backend",
    "build_lock",
    "check_backend_class",
    "dequantize_kv",
    "ops",
    "plan_step",
    "quantize_kv",
    "rotate_torch",
]
