"""Models on real weights: architectures, loaders, tokenizer and chat template."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from astrai.cpu_tuning import run_off_thread
from astrai.model.architecture import Architecture, get_architecture
from astrai.model.config import ModelConfig
from astrai.model.cpu_linear import prepack_linears, prepack_supported
from astrai.model.llama import LlamaForCausalLM
from astrai.model.tokenizer import IncrementalDecoder, Tokenizer

__all__ = [
    "Architecture",
    "IncrementalDecoder",
    "LlamaForCausalLM",
    "ModelConfig",
    "Tokenizer",
    "build_model",
    "default_dtype",
    "load_model",
    "load_tokenizer",
    "read_checkpoint",
    "read_config",
]

logger = logging.getLogger(__name__)

def default_dtype(device: str | torch.device) -> torch.dtype:
    """bfloat16 on CUDA, and on CPUs with native bf16 matmul (AVX512-BF16 or AMX); else float32."""
    if torch.device(device).type == "cuda":
        return torch.bfloat16
    native_bf16 = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return torch.bfloat16 if native_bf16 else torch.float32


def build_model(config: ModelConfig, dtype: torch.dtype, device: str | torch.device = "cpu") -> LlamaForCausalLM:
    """Build the architecture named by ``config.architecture`` with uninitialised-but-finite weights.

    The class comes from the ``astrai.models`` entry point of that name (built-ins:
    ``llama``, ``qwen2``). Parameters take ``dtype``; the RoPE table stays float32
    whatever the dtype. Raises ModelNotFound for an architecture nobody provides.
    """
    model = get_architecture(config.architecture).model_class(config).to(device)
    for p in model.parameters():  # parameters only: buffers (the RoPE table) stay float32
        p.data = p.data.to(dtype)
    return model.eval()


def load_model(
    name_or_path: str | None = None,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
) -> tuple[LlamaForCausalLM, Tokenizer]:
    """Load a model and its tokenizer from a name, a ``.gguf`` file or an HF checkpoint folder.

    ``None`` or ``"smollm2-135m"`` is the default model. ``dtype`` defaults to
    :func:`default_dtype` for ``device``. Raises ``ModelNotFound`` (with the
    install command for the default model) when the weights are missing.
    """
    dtype = dtype or default_dtype(device)
    if torch.device(device).type == "cpu":  # keep the caller's thread free of OpenMP teams
        return run_off_thread(_load, name_or_path, dtype, device)
    return _load(name_or_path, dtype, device)


def read_checkpoint(name_or_path: str | None, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor], str, Path]:
    """A checkpoint's configuration and weights in astrai's layout (unfused), its kind ("gguf" or
    "hf") and path; raises ModelNotFound. The tokenizer's end-of-sequence ids are not merged yet
    (``load_tokenizer`` does that)."""
    from astrai.model.gguf_loader import load_gguf
    from astrai.model.hf_loader import load_hf
    from astrai.model.resolve import resolve_model

    kind, path = resolve_model(name_or_path)
    config, weights = load_gguf(path, dtype) if kind == "gguf" else load_hf(path, dtype)
    config.name = config.name or name_or_path or Path(path).stem
    return config, weights, kind, Path(path)


def read_config(name_or_path: str | None) -> ModelConfig:
    """A checkpoint's configuration alone (GGUF metadata or ``config.json``), without its weights."""
    from astrai.model.gguf_loader import gguf_config, open_gguf
    from astrai.model.hf_loader import _read_json, hf_config
    from astrai.model.resolve import resolve_model

    kind, path = resolve_model(name_or_path)
    if kind == "gguf":
        config = gguf_config(open_gguf(path), Path(path))
    else:
        config = hf_config(Path(path), _read_json(Path(path) / "config.json"))
    config.name = config.name or name_or_path or Path(path).stem
    return config


def load_tokenizer(name_or_path: str | None, config: ModelConfig) -> Tokenizer:
    """The tokenizer of a checkpoint; ``config.eos_token_ids`` gains the tokenizer's end ids."""
    from astrai.model.resolve import resolve_model

    kind, path = resolve_model(name_or_path)
    tokenizer = Tokenizer.from_gguf(path) if kind == "gguf" else Tokenizer.from_pretrained(path)
    config.eos_token_ids = sorted(set(config.eos_token_ids) | set(tokenizer.eos_token_ids))
    return tokenizer


def _load(
    name_or_path: str | None, dtype: torch.dtype, device: str | torch.device
) -> tuple[LlamaForCausalLM, Tokenizer]:
    start = time.perf_counter()
    config, weights, kind, _path = read_checkpoint(name_or_path, dtype)
    tokenizer = load_tokenizer(name_or_path, config)
    model = build_model(config, dtype, device)
    model.load_weights({k: v.to(device) for k, v in weights.items()})
    model.fuse_projections()
    if prepack_supported(device, dtype):  # after the weights are final: packing copies them
        prepack_linears(model)
    logger.info("loaded %s (%s, %s) in %.2f s", config.name, kind, dtype, time.perf_counter() - start)
    return model, tokenizer
