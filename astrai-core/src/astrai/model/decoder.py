"""``DecoderLM``: a decoder-only causal LM over astrai's paged KV cache, whatever its family.

The forward takes one flattened ragged batch (see ``KVCache``): prefill chunks and decode tokens of
many requests in a single call, with attention routed through the ``astrai.extension`` policy API so
any backend can run it. A family (``astrai.model.llama``, ``qwen3``, ``gemma``, ``phi3``) subclasses
it and says how one layer is built (``make_layer``); everything else (embeddings, the RoPE tables,
the final norm and head, loading, fusing, the parameter shapes a checkpoint is checked against) is
here once. Parameter names are HF's.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from astrai.extension import RotaryEmbedding, bind_step
from astrai.extension.fused import kernel_for
from astrai.model.layers import RMSNorm, zero_init
from astrai.model.stack import DecoderStack, describe

if TYPE_CHECKING:
    from astrai.kvcache import KVCache
    from astrai.model.config import ModelConfig


class DecoderBody(nn.Module):
    """``model.*`` in HF naming: embeddings, layers, final norm."""

    def __init__(self, config: ModelConfig, layers: list[nn.Module], norm: type[RMSNorm]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = norm(config.hidden_size, config.rms_norm_eps)


class DecoderLM(nn.Module):
    """A causal LM whose parameter names match HF checkpoints.

    Q/K projection rows are in llama.cpp's interleaved RoPE layout (the loaders see to it),
    matching ``apply_rotary_emb``'s complex-pair convention. A subclass sets ``norm`` (the
    final norm's class), ``embed_scale`` (Gemma multiplies the embeddings by sqrt(hidden)) and
    ``make_layer``.
    """

    norm: ClassVar[type[RMSNorm]] = RMSNorm
    scales_embeddings: ClassVar[bool] = False  # embeddings times sqrt(hidden_size), rounded to the dtype

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        layers = [self.make_layer(config, i) for i in range(config.num_hidden_layers)]
        self.model = DecoderBody(config, layers, self.norm)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        rotary_dim = config.rotary_dim or config.head_dim
        max_len = config.max_position_embeddings
        self.rotary = RotaryEmbedding(rotary_dim, max_len, config.rope_theta, config.rope_scaling)
        if config.local_rope_theta is not None:  # the sliding-window layers' own table
            self.rotary_local = RotaryEmbedding(
                rotary_dim, max_len, config.local_rope_theta, config.local_rope_scaling
            )
        windows = config.windows
        self.attention_features = frozenset(
            ["window"] * any(windows) + ["softcap"] * bool(config.attn_logit_softcapping)
        )

    def make_layer(self, config: ModelConfig, layer_id: int) -> nn.Module:
        """Layer ``layer_id``: a module ``layer(x, freqs, kv_cache) -> x`` with ``self_attn.window``."""
        raise NotImplementedError

    @classmethod
    def parameter_shapes(cls, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every parameter ``cls(config)`` has (HF names, unfused; no tied
        ``lm_head.weight``), from a model built on the meta device (nothing allocated): what the
        loaders check a checkpoint against first."""
        small = dataclasses.replace(config, max_position_embeddings=1)  # a 1-row rotary table: a buffer
        with torch.device("meta"), zero_init():
            model = cls(small)
        return {name: tuple(p.shape) for name, p in model.named_parameters()}

    def _freqs(self, positions: torch.Tensor) -> dict[bool, torch.Tensor]:
        """The step's RoPE rows, by "is a local layer" (one table unless the local layers have their own)."""
        freqs = self.rotary(positions.unsqueeze(0))
        local = self.rotary_local(positions.unsqueeze(0)) if hasattr(self, "rotary_local") else freqs
        return {False: freqs, True: local}

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Run one ragged step.

        ``input_ids``/``positions``: ``[T]`` int64, flattened request after request
        (the layout of ``kv_cache``). ``logits_indices``: ``[B]`` int64 rows of ``T``
        whose next-token logits are wanted; the LM head runs on those rows only.
        Returns ``[B, vocab]`` float32. Writes this step's K/V into the pool.
        """
        config = self.config
        x = self.model.embed_tokens(input_ids)
        if self.scales_embeddings:  # HF rounds the scale to the dtype first
            x = x * torch.tensor(config.hidden_size**0.5, dtype=x.dtype)
        if kv_cache.backend is None:  # a direct call (no ModelRunner bound the step): resolve it once
            kv_cache.features = self.attention_features | kv_cache.features  # (a quantized pool's)
            bind_step(kv_cache, x.new_empty((0, config.num_attention_heads, config.head_dim)))
        freqs = self._freqs(positions)
        out = self.run_stack(x, freqs, kv_cache)
        if out is None:
            for layer in self.model.layers:
                x = layer(x, freqs[bool(layer.self_attn.window)], kv_cache)
        else:
            x = out
        x = self.model.norm(x.index_select(0, logits_indices))
        logits = self.lm_head(x).float()
        cap = config.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap else logits

    def run_stack(
        self, x: torch.Tensor, freqs: dict[bool, torch.Tensor], kv_cache: KVCache
    ) -> torch.Tensor | None:
        """The decoder layers on a backend's whole-stack kernel (``decoder_layers``), or None (then
        ``forward`` runs them one by one): ``freqs`` is ``_freqs``'s, by "is a local layer"."""
        stack = kernel_for("decoder_layers", x)  # a plugin's whole-stack kernel (astrai.extension.fused)
        if stack is None:
            return None
        lora = getattr(self, "lora", None)
        if lora is not None and lora.rows is not None and not getattr(stack, "lora", False):
            return (
                None  # adapter rows, on a kernel that does not take them: the layers' LoRA wrappers run them
            )
        return stack(self, x, [freqs[False], freqs[True]], kv_cache)

    def decoder_stack(self) -> DecoderStack | None:
        """The decoder layers as a whole-stack kernel may run them in place of ``forward``'s loop
        (``astrai.model.stack.describe``: ``None`` unless that computes exactly what they do), with the
        model's own projections (not a step's LoRA wrappers)."""
        lora = getattr(self, "lora", None)
        if lora is None:
            return describe(self)
        with lora.unwrapped():
            return describe(self)

    def stack_lora(self) -> tuple[torch.Tensor, int, list, list, list] | None:
        """The step's LoRA rows for a whole-stack kernel that takes them (``decoder_layers`` with
        ``lora = True``): ``None`` without adapter rows, else ``astrai.lora.LoraSet.stacked``'s
        ``(rows, version, a, b, spans)``, the projections in ``decoder_stack().linears``'s order."""
        lora = getattr(self, "lora", None)
        if lora is None or lora.rows is None:
            return None
        return lora.stacked(self.model.layers)

    def fuse_projections(self) -> None:
        """Merge q/k/v and gate/up projections for inference; call once weights are final.

        Afterwards the state dict holds ``qkv_proj``/``gate_up_proj`` instead of the HF
        names, so ``load_weights`` must come first.
        """
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy a loader's state dict in; raises ``ValueError`` on missing or unexpected names. A
        parameter on the meta device (``build_model(random_init=False)``) becomes a copy of its
        tensor, in the parameter's dtype, on the tensor's device."""
        own = dict(self.named_parameters(remove_duplicate=True))
        if self.config.tie_word_embeddings:
            own.pop("lm_head.weight", None)
            state_dict = {k: v for k, v in state_dict.items() if k != "lm_head.weight"}
        missing = sorted(set(own) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(own))
        if missing or unexpected:
            raise ValueError(
                f"weights do not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
            )
        with torch.no_grad():
            for name, param in own.items():
                src = state_dict[name]
                if src.shape != param.shape:
                    raise ValueError(
                        f"{name}: checkpoint shape {tuple(src.shape)} != model {tuple(param.shape)}"
                    )
                if param.is_meta:
                    owner, _, leaf = name.rpartition(".")
                    value = torch.empty(src.shape, dtype=param.dtype, device=src.device)
                    value.copy_(src)
                    module = self.get_submodule(owner)
                    module._parameters[leaf] = nn.Parameter(value, requires_grad=param.requires_grad)
                else:
                    param.copy_(src)
        head = getattr(self.lm_head, "weight", None)
        if self.config.tie_word_embeddings and head is not None and head.is_meta:
            self.lm_head.weight = self.model.embed_tokens.weight
