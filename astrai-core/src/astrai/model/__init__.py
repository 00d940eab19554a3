"""Models on real weights: architectures, loaders, tokenizer and chat template.

Loading reads a checkpoint's header first (``open_checkpoint``: configuration and tensor table,
checked against each other), checks the memory it will take (``astrai.model.budget``), and only
then reads the weights: a malformed or oversized checkpoint is refused before anything is allocated.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from pathlib import Path

import torch

from astrai.cpu_tuning import run_off_thread
from astrai.malloc import trim_heap
from astrai.model.architecture import Architecture, get_architecture
from astrai.model.checkpoint import Checkpoint, open_checkpoint, read_weights
from astrai.model.config import ModelConfig
from astrai.model.cpu_linear import prepack_linears, prepack_supported
from astrai.model.detokenizer import IncrementalDecoder
from astrai.model.layers import meta_parameters
from astrai.model.llama import LlamaForCausalLM
from astrai.model.tokenizer import Tokenizer

__all__ = [
    "Architecture",
    "Checkpoint",
    "IncrementalDecoder",
    "LlamaForCausalLM",
    "ModelConfig",
    "Tokenizer",
    "build_model",
    "default_dtype",
    "load_model",
    "load_tokenizer",
    "open_checkpoint",
    "read_checkpoint",
    "read_config",
    "served_config",
    "WEIGHTS",
]

logger = logging.getLogger(__name__)


def default_dtype(device: str | torch.device) -> torch.dtype:
    """bfloat16 on CUDA, and on CPUs with native bf16 matmul (AVX512-BF16 or AMX); else float32."""
    if torch.device(device).type == "cuda":
        return torch.bfloat16
    native_bf16 = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return torch.bfloat16 if native_bf16 else torch.float32


def served_config(config: ModelConfig, max_seq_len: int | None) -> ModelConfig:
    """``config`` for a model that serves at most ``max_seq_len`` positions: a copy whose
    ``max_position_embeddings`` (which sizes the rotary table) is capped at it; ``config`` itself
    when there is nothing to cap."""
    if max_seq_len is None or max_seq_len >= config.max_position_embeddings:
        return config
    return dataclasses.replace(config, max_position_embeddings=max_seq_len)


def build_model(
    config: ModelConfig,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    random_init: bool = True,
    max_seq_len: int | None = None,
) -> LlamaForCausalLM:
    """Build the architecture named by ``config.architecture`` with uninitialised-but-finite weights.

    The class comes from the ``astrai.models`` entry point of that name (built-ins:
    ``llama``, ``qwen2``). Parameters take ``dtype``; the RoPE table stays float32
    whatever the dtype. ``random_init=False``: the parameters are on the meta device, taking no
    memory, for a caller that loads every one next (``load_weights`` materialises them on the
    checkpoint's tensors' device). ``max_seq_len``: the longest context the model
    will serve; the model's config (``max_position_embeddings``) and its rotary table are
    capped at it, so a checkpoint's huge context length costs nothing it does not serve.
    Raises ModelNotFound for an architecture nobody provides.
    """
    config = served_config(config, max_seq_len)
    cls = get_architecture(config.architecture).model_class
    if random_init:
        model = cls(config).to(device)
    else:
        with meta_parameters():
            model = cls(config)
        for module in model.modules():  # the buffers (RoPE tables) are real
            for name, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[name] = buffer.to(device)
    for p in model.parameters():  # parameters only: buffers (the RoPE table) stay float32
        p.data = p.data.to(dtype)
    return model.eval()


#: ``load_model``'s ``weights``: "gguf" keeps a GGUF file's quantized blocks (astrai.model.quant),
#: "dense" (``load_model``'s default) dequantizes them into ``dtype`` at load; "auto" (``astrai
#: serve``'s default) is "gguf" where a quantized kernel runs in ``dtype`` (bf16 and float32 on
#: AVX512-BF16 CPUs, float32 on AVX2 ones: the dequantized model's float32 products, up to the
#: order of the sums), else "dense".
WEIGHTS = ("auto", "gguf", "dense")


def quantized_kernels(device: str | torch.device, dtype: torch.dtype) -> str | None:
    """``None`` when GGUF weights can stay quantized on ``device`` in ``dtype``, else why not."""
    from astrai.extension.backend.policy import load_backends
    from astrai.extension.fused import kernel_for

    if torch.device(device).type != "cpu":
        return f"the quantized kernels run on the CPU, not {torch.device(device).type} (use --weights dense)"
    if dtype not in (torch.bfloat16, torch.float32):
        return (
            "the quantized kernels take bfloat16 or float32 activations, "
            f"not {str(dtype).removeprefix('torch.')}"
        )
    load_backends()  # installs the backends' fused kernels (an engine does this anyway)
    with torch.no_grad():
        kernel = kernel_for("quant_linear", torch.empty(0))
    if kernel is None:
        return "no quant_linear kernel is installed (astrai-backend-cpu on a CPU with AVX512-BF16 or AVX2)"
    dtypes = getattr(kernel, "dtypes", (torch.bfloat16, torch.float32))
    if dtype not in dtypes:
        names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        return f"this CPU's quant_linear kernel takes {names} activations, not {str(dtype).removeprefix('torch.')}"
    return None


def keeps_quantized(weights: str, device: str | torch.device, dtype: torch.dtype) -> bool:
    """Whether ``weights`` (``WEIGHTS``) keeps a GGUF file's quantized blocks on ``device`` in
    ``dtype``; "gguf" where the kernels cannot run raises ValueError saying why."""
    if weights == "dense":
        return False
    why_not = quantized_kernels(device, dtype)
    if weights == "gguf":
        if why_not is not None:
            raise ValueError(f"--weights gguf: {why_not}")
        return True
    return why_not is None  # auto


def load_model(
    name_or_path: str | Checkpoint | None = None,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    weights: str = "dense",
    max_seq_len: int | None = None,
    reserve: Mapping[str, int] | None = None,
) -> tuple[LlamaForCausalLM, Tokenizer]:
    """Load a model and its tokenizer from a name, a ``.gguf`` file, an HF checkpoint folder or
    an opened ``Checkpoint``.

    ``None`` or ``"smollm2-135m"`` is the default model. ``dtype`` defaults to
    :func:`default_dtype` for ``device``. ``weights`` (``WEIGHTS``) says whether a GGUF file's
    quantized weights stay quantized; "gguf" where the kernels cannot run raises ValueError.
    ``max_seq_len``: the longest context the model will serve (see ``build_model``); ``reserve``:
    what the caller allocates next (what for -> bytes, an engine's KV pool), counted in the memory
    check. Raises ``ModelNotFound`` (with the install command for the default model) when the
    weights are missing, ``ModelFormatError`` for a malformed checkpoint and ``InsufficientMemory``
    when it would not fit (``astrai.model.budget``), both before anything is allocated.
    """
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHTS)}, not {weights!r}")
    dtype = dtype or default_dtype(device)
    args = (name_or_path, dtype, device, weights, max_seq_len, reserve)
    if torch.device(device).type == "cpu":  # keep the caller's thread free of OpenMP teams
        return run_off_thread(_load, *args)
    return _load(*args)


def read_checkpoint(
    name_or_path: str | Checkpoint | None, dtype: torch.dtype, quantized: bool = False
) -> tuple[ModelConfig, dict[str, torch.Tensor], str, Path]:
    """A checkpoint's configuration and weights in astrai's layout (unfused), its kind ("gguf" or
    "hf") and path; raises ModelNotFound or ModelFormatError (see ``open_checkpoint``). The
    tokenizer's end-of-sequence ids are not merged yet (``load_tokenizer`` does that).
    ``quantized``: a GGUF file's quantized weights that ``astrai.model.quant`` keeps come back
    as its ``QuantWeight``s."""
    ckpt = name_or_path if isinstance(name_or_path, Checkpoint) else open_checkpoint(name_or_path)
    return ckpt.config, read_weights(ckpt, dtype, quantized), ckpt.kind, ckpt.path


def read_config(name_or_path: str | None) -> ModelConfig:
    """A checkpoint's configuration alone (GGUF metadata or ``config.json``, checked against the
    tensor table), without its weights."""
    return open_checkpoint(name_or_path).config


def load_tokenizer(name_or_path: str | Checkpoint | None, config: ModelConfig) -> Tokenizer:
    """The tokenizer of a checkpoint (an opened ``Checkpoint``: its GGUF metadata is not parsed
    again); ``config.eos_token_ids`` gains the tokenizer's end ids."""
    from astrai.model.resolve import resolve_model

    if isinstance(name_or_path, Checkpoint):
        kind, path, reader = name_or_path.kind, name_or_path.path, name_or_path.reader
    else:
        (kind, path), reader = resolve_model(name_or_path), None
    tokenizer = Tokenizer.from_gguf(path, reader) if kind == "gguf" else Tokenizer.from_pretrained(path)
    config.eos_token_ids = sorted(set(config.eos_token_ids) | set(tokenizer.eos_token_ids))
    return tokenizer


def _load(
    source: str | Checkpoint | None,
    dtype: torch.dtype,
    device: str | torch.device,
    weights_mode: str,
    max_seq_len: int | None,
    reserve: Mapping[str, int] | None,
) -> tuple[LlamaForCausalLM, Tokenizer]:
    from astrai.model.budget import require_memory
    from astrai.model.quant import QuantizedLinear, install_quantized

    start = time.perf_counter()
    ckpt = source if isinstance(source, Checkpoint) else open_checkpoint(source)  # checked: nothing read yet
    quantized = keeps_quantized(weights_mode, device, dtype)
    config = served_config(ckpt.config, max_seq_len)
    kept = ckpt.stays_quantized if quantized else lambda name, info: False
    require_memory(ckpt.path, config, ckpt.tensors, dtype, device, kept, reserve)
    weights, kind = read_weights(ckpt, dtype, quantized), ckpt.kind
    tokenizer = load_tokenizer(ckpt, config)
    model = build_model(config, dtype, device, random_init=False)  # load_weights sets every parameter
    if quantized:
        weights = install_quantized(model, weights, dtype)
    model.load_weights({k: v.to(device) for k, v in weights.items()})
    del weights  # copied in: freed now, so that the trim below returns them (tensors under 32 MiB are heap)
    model.fuse_projections()
    if prepack_supported(device, dtype):  # after the weights are final: packing copies them
        prepack_linears(model)
    trim_heap()  # the loader's transient copies (float32 tensors, the unfused and unquantized weights)
    n_quant = sum(isinstance(m, QuantizedLinear) for m in model.modules())
    logger.info(
        "loaded %s (%s, %s%s) in %.2f s",
        config.name,
        kind,
        dtype,
        f", {n_quant} quantized linears" if n_quant else "",
        time.perf_counter() - start,
    )
    return model, tokenizer
