"""Model architectures: the ``astrai.models`` entry-point group's values.

An :class:`Architecture` says which ``nn.Module`` class builds a model and how a
checkpoint's tensor names map onto that module's parameter names. The built-ins (``llama``,
``qwen2``, ``qwen3``, ``mistral``, ``ministral``, ``gemma2``, ``gemma3``, ``phi3``; ``qwen3_moe`` and
``mixtral`` in their family modules) are registered in
astrai-core's ``pyproject.toml`` like any third-party architecture would be; the loaders look an
architecture up by the checkpoint's GGUF ``general.architecture`` or HF ``model_type``.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from astrai.errors import ModelNotFound, PluginError

if TYPE_CHECKING:
    from torch import nn

    from astrai.model.config import ModelConfig
    from astrai.plugins import LoadedPlugins

__all__ = [
    "Architecture",
    "GEMMA2",
    "GEMMA3",
    "LLAMA",
    "MINISTRAL",
    "MISTRAL",
    "PHI3",
    "QWEN2",
    "QWEN3",
    "get_architecture",
]

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
    aliases: tuple[str, ...] = ()  # other names it answers to (HF's ``gemma3_text``); entry points too
    # what llama.cpp adds to every ``*norm.weight`` it writes (Gemma's (1 + weight) norms: 1.0)
    gguf_norm_offset: float = 0.0
    # the checkpoint's fused projections -> the model's projections they hold, top rows first, and
    # their row counts (Phi-3's qkv_proj and gate_up_proj; the loaders cut them apart)
    fused_parts: Callable[[ModelConfig], Mapping[str, Sequence[tuple[str, int]]]] | None = None
    # GGUF metadata the common reader does not know: ``gguf_config(key, config)`` completes the
    # config, ``key(name, default)`` reading ``{arch}.{name}``
    gguf_config: Callable[[Callable[[str, Any], Any], ModelConfig], None] | None = None
    # a checkpoint's tensor names -> the model's, where they differ: (regex, replacement) pairs in
    # order (Mixtral's ``block_sparse_moe.experts.{e}.w1`` is ``mlp.experts.{e}.gate_proj``)
    hf_renames: tuple[tuple[str, str], ...] = ()

    def checkpoint_name(self, name: str) -> str:
        """The model's parameter name for an HF checkpoint's tensor ``name``."""
        for pattern, replacement in self.hf_renames:
            name = re.sub(pattern, replacement, name)
        return name

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


_TOP = GGUF_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_QK_NORM = GGUF_QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_BLOCK = GGUF_BLOCK = {  # (GGUF_*: the tables a family module outside this one builds on)
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
"""Llama 2/3.x, SmolLM2 (and Mistral's GGUF files, which llama.cpp writes as ``llama``)."""
QWEN2 = Architecture("qwen2", _llama_class(), _TOP, _BLOCK, gguf_rope_interleaved=False, attention_bias=True)
"""Qwen2 / Qwen2.5: Llama with q/k/v biases and NEOX RoPE in GGUF."""
MISTRAL = Architecture("mistral", _llama_class(), _TOP, _BLOCK, gguf_rope_interleaved=True)
"""Mistral: the Llama layout, every layer in one sliding window where the config sets one."""
MINISTRAL = Architecture("ministral", _llama_class(), _TOP, _BLOCK, gguf_rope_interleaved=True)
"""Ministral: Mistral whose ``layer_types`` say which layers slide."""


def _qwen3_class() -> type[nn.Module]:
    from astrai.model.qwen3 import Qwen3ForCausalLM

    return Qwen3ForCausalLM


QWEN3 = Architecture("qwen3", _qwen3_class(), _TOP, _BLOCK | _QK_NORM, gguf_rope_interleaved=False)
"""Qwen3 (dense): Llama without biases, q/k norms before RoPE."""

_GEMMA_BLOCK = {
    **{k: v for k, v in _BLOCK.items() if k != "ffn_norm"},
    **_QK_NORM,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


def _gemma_gguf(pattern: int, qk_norm: bool) -> Callable[[Callable[[str, Any], Any], ModelConfig], None]:
    """What llama.cpp's Gemma loader fixes in code: the GeGLU, the softmax scale, which layers slide
    (every ``pattern``-th is global, or the file's ``attention.sliding_window_pattern``) and, for
    Gemma 3, the local layers' RoPE base (``rope.freq_base_swa``, 10,000)."""

    def complete(key: Callable[[str, Any], Any], config: ModelConfig) -> None:
        config.hidden_act = "gelu_pytorch_tanh"
        layers = config.num_hidden_layers
        wide = layers == 62  # Gemma 3 27B scales by hidden / heads, as llama.cpp's loader does
        config.query_pre_attn_scalar = (
            config.hidden_size / config.num_attention_heads if wide else config.head_dim
        )
        config.attn_logit_softcapping = key("attn_logit_softcapping", None)
        config.final_logit_softcapping = key("final_logit_softcapping", None)
        if not config.sliding_window:
            return
        every = key("attention.sliding_window_pattern", pattern)
        if isinstance(every, list):
            slides = [bool(b) for b in every]
        else:
            slides = [every == 0 or i % every < every - 1 for i in range(layers)]
        config.layer_types = ["sliding_attention" if s else "full_attention" for s in slides]
        if qk_norm:
            config.local_rope_theta = float(key("rope.freq_base_swa", 10000.0))

    return complete


def _gemma_class(name: str) -> type[nn.Module]:
    from astrai.model.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM

    return {"gemma2": Gemma2ForCausalLM, "gemma3": Gemma3ForCausalLM}[name]


GEMMA2 = Architecture(
    "gemma2",
    _gemma_class("gemma2"),
    _TOP,
    _GEMMA_BLOCK,
    gguf_rope_interleaved=False,
    gguf_norm_offset=1.0,
    gguf_config=_gemma_gguf(2, qk_norm=False),
)
"""Gemma 2: sandwich norms, GeGLU, alternating local and global layers, soft-capped scores and logits."""
GEMMA3 = Architecture(
    "gemma3",
    _gemma_class("gemma3"),
    _TOP,
    _GEMMA_BLOCK,
    gguf_rope_interleaved=False,
    aliases=("gemma3_text",),
    gguf_norm_offset=1.0,
    gguf_config=_gemma_gguf(6, qk_norm=True),
)
"""Gemma 3 (text): Gemma 2's layout with q/k norms, five local layers to a global one, two RoPE bases."""


def _phi3_gguf(key: Callable[[str, Any], Any], config: ModelConfig) -> None:
    """Phi-3's GGUF gives the rotated dims (``rope.dimension_count``), not the head dim."""
    rotated = key("rope.dimension_count", None)
    if rotated and key("attention.key_length", None) is None:
        config.head_dim = config.hidden_size // config.num_attention_heads
        config.rotary_dim = int(rotated) if int(rotated) < config.head_dim else None


def _phi3_class() -> type[nn.Module]:
    from astrai.model.phi3 import Phi3ForCausalLM

    return Phi3ForCausalLM


def _phi3_parts(config: ModelConfig) -> Mapping[str, Sequence[tuple[str, int]]]:
    from astrai.model.phi3 import phi3_parts

    return phi3_parts(config)


PHI3 = Architecture(
    "phi3",
    _phi3_class(),
    _TOP,
    {
        **{k: v for k, v in _BLOCK.items() if k not in ("attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up")},
        "attn_qkv": "self_attn.qkv_proj",
        "ffn_up": "mlp.gate_up_proj",
    },
    gguf_rope_interleaved=False,
    fused_parts=_phi3_parts,
    gguf_config=_phi3_gguf,
)
"""Phi-3 / Phi-4-mini: Llama stored fused, partial rotary, LongRoPE."""


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
    for arch in loaded.classes.values():
        if name in arch.aliases:
            return arch
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
    if name != plugin.name and name not in plugin.aliases:
        raise PluginError(f"{origin}: architecture is named {plugin.name!r} but its entry point is {name!r}")
    return plugin


def load_architectures() -> LoadedPlugins:
    """Every installed ``astrai.models`` architecture (validated; failures kept).

    Discovered once per process and kept while ``astrai.plugins.installed_state`` stays the
    same (a distribution installed, removed or put on ``sys.path`` discovers them again): one
    model load asks ``get_architecture`` half a dozen times (tensor table, configuration,
    checks, weights, build), each discovery a scan of every installed distribution."""
    from astrai.plugins import installed_state

    return _discover(installed_state())


@functools.lru_cache(maxsize=1)
def _discover(_state: tuple[tuple[str, int | None], ...]) -> LoadedPlugins:
    """On a thread of its own: a failure keeps its exception, whose traceback's frames reach up the
    stack that discovered it (``f_back``), and the cache keeps the failure. On the caller's thread
    that stack was a model loader's, its state dict with it (gemma3-270m's 640 MiB embedding)."""
    from astrai.cpu_tuning import run_off_thread
    from astrai.plugins import load_plugins

    return run_off_thread(load_plugins, MODELS, check_architecture)
