"""Model architectures: the ``astrai.models`` entry-point group's values.

An :class:`Architecture` says which ``nn.Module`` class builds a model and how a
checkpoint's tensor names map onto that module's parameter names. The built-in
``llama`` and ``qwen2`` are registered in astrai-core's ``pyproject.toml`` like any
third-party architecture would be; the loaders look an architecture up by the
checkpoint's GGUF ``general.architecture`` or HF ``model_type``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from astrai.errors import ModelNotFound, PluginError

if TYPE_CHECKING:
    from torch import nn

    from astrai.plugins import LoadedPlugins

__all__ = ["Architecture", "LLAMA", "QWEN2", "get_architecture"]

_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


@dataclass(frozen=True)
class Architecture:
    """One architecture: its model class and its weight-name mapping.

    ``model_class(config: ModelConfig)`` builds the model (parameters on CPU in the
    default dtype); the instance must offer ``load_weights(state_dict)`` taking HF
    parameter names and ``fuse_projections()``, and the forward of ``LlamaForCausalLM``.
    A class may offer ``parameter_shapes(config)`` (a static method: HF name -> shape, as
    ``LlamaForCausalLM``'s): the loaders then check a checkpoint's tensors against it before
    anything is allocated (``astrai.model.checks``).
    Weight names: HF checkpoints already use the parameter names; a GGUF tensor
    ``token_embd.weight`` maps through ``gguf_top`` and ``blk.{i}.attn_q.weight``
    through ``gguf_block`` (see :meth:`hf_name`).
    """

    name: str  # GGUF general.architecture / HF model_type; the entry-point name
    model_class: type[nn.Module]
    gguf_top: Mapping[str, str]  # llama.cpp top-level tensor prefix -> HF module path
    gguf_block: Mapping[str, str]  # llama.cpp per-block tensor kind -> HF module path inside a layer
    # llama.cpp's converter permutes q/k rows to interleaved-pair RoPE only for "norm"-RoPE
    # architectures (llama); NEOX-RoPE ones (qwen2) are stored in HF layout.
    gguf_rope_interleaved: bool = True
    attention_bias: bool = False  # q/k/v bias when config.json does not say

    def hf_name(self, gguf_name: str) -> str | None:
        """HF parameter name for a llama.cpp tensor name; None when there is none."""
        top, _, suffix = gguf_name.rpartition(".")
        if top in self.gguf_top:
            return f"{self.gguf_top[top]}.{suffix}"
        m = _BLOCK_RE.fullmatch(gguf_name)
        if m and m.group(2) in self.gguf_block:
            return f"model.layers.{m.group(1)}.{self.gguf_block[m.group(2)]}.{m.group(3)}"
        return None


def _llama_class() -> type[nn.Module]:
    from astrai.model.llama import LlamaForCausalLM

    return LlamaForCausalLM


_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

LLAMA = Architecture("llama", _llama_class(), _TOP, _BLOCK, gguf_rope_interleaved=True)
"""Llama 2/3, SmolLM2."""
QWEN2 = Architecture("qwen2", _llama_class(), _TOP, _BLOCK, gguf_rope_interleaved=False, attention_bias=True)
"""Qwen2 / Qwen2.5: Llama with q/k/v biases and NEOX RoPE in GGUF."""


def get_architecture(name: str | None, where: str = "") -> Architecture:
    """The installed architecture called ``name`` (an ``astrai.models`` entry point).

    Raises the plugin's ``PluginError`` when that entry point failed to load, and
    ``ModelNotFound`` naming the installed ones when nothing is called ``name``;
    ``where`` (a path) prefixes the message.
    """
    loaded = load_architectures()
    if name in loaded.failures:
        failure = loaded.failures[name]
        raise failure.as_error() from failure.error
    if name in loaded.classes:
        return loaded.classes[name]
    known = sorted(loaded.classes)
    raise ModelNotFound(
        f"{where + ': ' if where else ''}architecture {name!r} is not supported; misspelled or not "
        f"installed? Installed: {', '.join(known) or 'none'}"
    )


MODELS = "astrai.models"
"""The entry-point group of ``Architecture`` objects; the name is the architecture's."""


def check_architecture(name: str, plugin: object, origin: str) -> Architecture:
    """Validate an ``astrai.models`` plugin: an ``Architecture`` named ``name``. Raises PluginError."""
    if not isinstance(plugin, Architecture):
        raise PluginError(f"{origin}: {plugin!r} is not an astrai.model.architecture.Architecture")
    if plugin.name != name:
        raise PluginError(f"{origin}: architecture is named {plugin.name!r} but its entry point is {name!r}")
    return plugin


def load_architectures() -> LoadedPlugins:
    """Every installed ``astrai.models`` architecture (validated; failures kept)."""
    from astrai.plugins import load_plugins

    return load_plugins(MODELS, check_architecture)
