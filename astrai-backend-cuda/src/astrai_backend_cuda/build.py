"""Loading the compiled kernels: the library built at install time, else a just-in-time build.

``load_kernels()`` registers ``torch.ops.astrai.*`` in this process, once:

1. AOT: ``astrai_backend_cuda/_C*.so``, built by ``pip install`` when torch with CUDA
   and nvcc were present at build time (see setup.py);
2. JIT: otherwise, or when that library does not load (built for another torch),
   ``torch.utils.cpp_extension.load`` compiles the sources with ninja for the visible device
   into a persistent cache, ``$ASTRAI_CUDA_CACHE`` or
   ``~/.cache/astrai/cuda-kernels/<torch>-cu<cuda>``; torch rebuilds only when a source
   or flag changes, so only the first use on a machine pays the compile (about a minute).
   The build runs under ``build_lock`` (``astrai.extension.api``): one builder per cache
   directory at a time, and a build killed half-way (torch's ``lock`` file left behind) holds
   up no later start.

It then registers fake (meta) implementations, so the ops trace under ``torch.compile``
(lending the rotary kernel to ``apply_rotary_emb`` is ``CudaBackend.kernels``'s).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import threading
from pathlib import Path

import torch

import astrai_backend_cuda._sources as _sources
from astrai.extension.api import KernelUnavailable, build_lock, ops

logger = logging.getLogger(__name__)

EXTENSION_NAME = "astrai_cuda_kernels"
CACHE_ENV = "ASTRAI_CUDA_CACHE"

_lock = threading.Lock()
_loaded: str | None = None  # how the kernels were loaded, once they are


def cache_dir() -> Path:
    """Where JIT builds live: ``$ASTRAI_CUDA_CACHE``, else per torch and CUDA version under ~/.cache."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    tag = f"torch{torch.__version__.split('+')[0]}-cu{torch.version.cuda or 'none'}"
    return Path.home() / ".cache" / "astrai" / "cuda-kernels" / tag


def _aot_library() -> Path | None:
    spec = importlib.util.find_spec("astrai_backend_cuda._C")
    return Path(spec.origin) if spec is not None and spec.origin else None


def _jit_build() -> None:
    from torch.utils.cpp_extension import load  # imports setuptools machinery: only when needed

    build = cache_dir()
    logger.info("building the astrai CUDA kernels in %s (first use on this machine)", build)
    with build_lock(build):  # torch's own lock file would outlive a killed builder
        load(
            name=EXTENSION_NAME,
            sources=[str(p) for p in _sources.all_sources()],
            extra_cflags=list(_sources.CXX_FLAGS),
            extra_cuda_cflags=list(_sources.NVCC_FLAGS),
            build_directory=str(build),
            is_python_module=False,
            verbose=logger.isEnabledFor(logging.DEBUG),
        )


def _register_fakes() -> None:
    """Shape-only implementations for torch.compile: every op only mutates its outputs."""
    for name in ("attn_paged_decode", "attn_paged_prefill", "rotary_emb"):
        torch.library.register_fake(f"astrai::{name}")(lambda *args, **kwargs: None)


def rotary_kernel(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """``apply_rotary_emb``'s contract on the fused kernel (freqs broadcast to x's leading shape)."""
    want = (*x.shape[:-2], *freqs.shape[-2:])
    if freqs.shape != want or not freqs.is_contiguous():
        freqs = freqs.expand(want).contiguous()
    return ops.rotary_emb(x, freqs)


def load_kernels() -> str:
    """Register ``torch.ops.astrai.*`` (once per process); returns how: ``"aot: <path>"`` or ``"jit: <dir>"``.

    Raises ``KernelUnavailable`` (with the compiler's or loader's message) when torch has
    no CUDA, or when neither a built library nor a working JIT build is at hand.
    """
    global _loaded
    with _lock:
        if _loaded is not None:
            return _loaded
        if torch.version.cuda is None:
            raise KernelUnavailable(
                f"torch {torch.__version__} is a CPU-only build: the CUDA kernels cannot load"
            )
        errors = []
        how = None
        library = _aot_library()
        if library is not None:
            try:
                torch.ops.load_library(str(library))
                how = f"aot: {library}"
            except Exception as err:  # e.g. built against another torch: fall back to a JIT build
                errors.append(f"{library}: {type(err).__name__}: {err}")
        if how is None:
            try:
                _jit_build()
                how = f"jit: {cache_dir()}"
            except Exception as err:  # compiler, linker or loader: all mean "no kernels here"
                errors.append(f"JIT build: {type(err).__name__}: {err}")
                raise KernelUnavailable(
                    "astrai CUDA kernels could not be loaded: " + "; ".join(errors)
                ) from err
        _register_fakes()
        _loaded = how
        logger.info("astrai CUDA kernels loaded (%s)", how)
        return how
