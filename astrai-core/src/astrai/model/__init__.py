"""Models on real weights: architectures, loaders, tokenizer and chat template."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

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
    "WEIGHTS",
]

logger = logging.getLogger(__name__)

def default_dtype(device: str | torch.device) -> torch.dtype:
    """bfloat16 on CUDA, and on CPUs with native bf16 matmul (AVX512-BF16 or AMX); else float32."""
    if torch.device(device).type == "cuda":
        return torch.bfloat16
    native_bf16 = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return torch.bfloat16 if native_bf16 else torch.float32


@contextlib.contextmanager
def _zero_init() -> Iterator[None]:
    """``nn.Linear`` and ``nn.Embedding`` start from zeros instead of torch's random init while
    this is active (one thread at a time): a loader that overwrites every parameter skips ~1 s
    of random numbers on the default model. Other modules keep their own init."""
    def zero(module: nn.Module) -> None:
        with torch.no_grad():
            for p in module.parameters(recurse=False):
                p.zero_()

    with _INIT_LOCK:
        saved = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
        nn.Linear.reset_parameters = nn.Embedding.reset_parameters = zero
        try:
            yield
        finally:
            nn.Linear.reset_parameters, nn.Embedding.reset_parameters = saved


_INIT_LOCK = threading.Lock()


def build_model(
    config: ModelConfig, dtype: torch.dtype, device: str | torch.device = "cpu", random_init: bool = True
) -> LlamaForCausalLM:
    """Build the architecture named by ``config.architecture`` with uninitialised-but-finite weights.

    The class comes from the ``astrai.models`` entry point of that name (built-ins:
    ``llama``, ``qwen2``). Parameters take ``dtype``; the RoPE table stays float32
    whatever the dtype. ``random_init=False``: linears and embeddings start at zero (for a
    caller that loads every parameter next). Raises ModelNotFound for an architecture nobody provides.
    """
    cls = get_architecture(config.architecture).model_class
    with contextlib.nullcontext() if random_init else _zero_init():
        model = cls(config).to(device)
    for p in model.parameters():  # parameters only: buffers (the RoPE table) stay float32
        p.data = p.data.to(dtype)
    return model.eval()


#: ``load_model``'s ``weights``: "gguf" keeps a GGUF file's quantized blocks (astrai.model.quant),
#: "dense" (``load_model``'s default) dequantizes them into ``dtype`` at load; "auto" (``astrai
#: serve``'s default) is "gguf" where the quantized kernels run and the activations are bfloat16,
#: else "dense" (float32 asks for the file's values in exact float32 GEMMs: dense holds them).
WEIGHTS = ("auto", "gguf", "dense")


def quantized_kernels(device: str | torch.device, dtype: torch.dtype) -> str | None:
    """``None`` when GGUF weights can stay quantized on ``device`` in ``dtype``, else why not."""
    from astrai.extension.backend.policy import load_backends
    from astrai.extension.fused import kernel_for

    if torch.device(device).type != "cpu":
        return f"the quantized kernels run on the CPU, not {torch.device(device).type} (use --weights dense)"
    if dtype not in (torch.bfloat16, torch.float32):
        return f"the quantized kernels take bfloat16 or float32 activations, not {str(dtype).removeprefix('torch.')}"
    load_backends()  # installs the backends' fused kernels (an engine does this anyway)
    with torch.no_grad():
        if kernel_for("quant_linear", torch.empty(0)) is None:
            return "no quant_linear kernel is installed (astrai-backend-cpu on a CPU with AVX512-BF16)"
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
    return why_not is None and dtype == torch.bfloat16  # auto


def load_model(
    name_or_path: str | None = None,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    weights: str = "dense",
) -> tuple[LlamaForCausalLM, Tokenizer]:
    """Load a model and its tokenizer from a name, a ``.gguf`` file or an HF checkpoint folder.

    ``None`` or ``"smollm2-135m"`` is the default model. ``dtype`` defaults to
    :func:`default_dtype` for ``device``. ``weights`` (``WEIGHTS``) says whether a GGUF file's
    quantized weights stay quantized; "gguf" where the kernels cannot run raises ValueError.
    Raises ``ModelNotFound`` (with the install command for the default model) when the weights
    are missing.
    """
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHTS)}, not {weights!r}")
    dtype = dtype or default_dtype(device)
    if torch.device(device).type == "cpu":  # keep the caller's thread free of OpenMP teams
        return run_off_thread(_load, name_or_path, dtype, device, weights)
    return _load(name_or_path, dtype, device, weights)


def read_checkpoint(
    name_or_path: str | None, dtype: torch.dtype, quantized: bool = False
) -> tuple[ModelConfig, dict[str, torch.Tensor], str, Path]:
    """A checkpoint's configuration and weights in astrai's layout (unfused), its kind ("gguf" or
    "hf") and path; raises ModelNotFound. The tokenizer's end-of-sequence ids are not merged yet
    (``load_tokenizer`` does that). ``quantized``: a GGUF file's quantized weights that
    ``astrai.model.quant`` keeps come back as its ``QuantWeight``s."""
    from astrai.model.gguf_loader import load_gguf
    from astrai.model.hf_loader import load_hf
    from astrai.model.resolve import resolve_model

    kind, path = resolve_model(name_or_path)
    config, weights = load_gguf(path, dtype, quantized) if kind == "gguf" else load_hf(path, dtype)
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


def _release_heap() -> None:
    """Hand the C heap's free memory back to the system (glibc's ``malloc_trim``; elsewhere nothing)."""
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _load(
    name_or_path: str | None, dtype: torch.dtype, device: str | torch.device, weights_mode: str = "dense"
) -> tuple[LlamaForCausalLM, Tokenizer]:
    from astrai.model.quant import QuantizedLinear, install_quantized

    start = time.perf_counter()
    quantized = keeps_quantized(weights_mode, device, dtype)
    config, weights, kind, _path = read_checkpoint(name_or_path, dtype, quantized)
    tokenizer = load_tokenizer(name_or_path, config)
    model = build_model(config, dtype, device, random_init=False)  # load_weights sets every parameter
    if quantized:
        weights = install_quantized(model, weights, dtype)
    model.load_weights({k: v.to(device) for k, v in weights.items()})
    model.fuse_projections()
    if prepack_supported(device, dtype):  # after the weights are final: packing copies them
        prepack_linears(model)
    _release_heap()  # the loader's transient copies (float32 tensors, the unfused and unquantized weights)
    n_quant = sum(isinstance(m, QuantizedLinear) for m in model.modules())
    logger.info("loaded %s (%s, %s%s) in %.2f s", config.name, kind, dtype,
                f", {n_quant} quantized linears" if n_quant else "", time.perf_counter() - start)  # fmt: skip
    return model, tokenizer
