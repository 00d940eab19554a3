"""Building and loading the CPU kernels: a just-in-time build into a persistent cache.

``load_kernels()`` registers ``torch.ops.astrai_cpu.*`` in this process, once. The
sources are compiled by ``torch.utils.cpp_extension.load`` (ninja, the system's C++
compiler, ``-march=native``) into ``$ASTRAI_CPU_CACHE`` or
``~/.cache/astrai/cpu-kernels/<torch>-<machine>-<cpu flags hash>``; torch rebuilds only
when a source or a flag changes, so only the first use on a machine pays the compile
(about 20 seconds). The cache is per instruction set: a build for one CPU never loads on
another.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import threading
from pathlib import Path

import torch

from astrai.errors import KernelUnavailable
from astrai.extension.backend.rotary import _rotate_torch
from astrai.extension.fused import register_kernel

logger = logging.getLogger(__name__)

EXTENSION_NAME = "astrai_cpu_kernels"
CACHE_ENV = "ASTRAI_CPU_CACHE"
SOURCES = [Path(__file__).parent / "csrc" / name for name in ("paged_decode.cpp", "prefill.cpp", "fused.cpp", "linear.cpp", "decode_stack.cpp")]
# -ffast-math lets the compiler vectorise the float reductions and exp; -fno-finite-math-only
# keeps infinities meaningful; -march=native: the cache is per CPU (see cache_dir).
CXX_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-fopenmp"]

_lock = threading.Lock()
_loaded: str | None = None


def _cpu_tag() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor()
    return hashlib.sha1(flags.encode()).hexdigest()[:10]


def cache_dir() -> Path:
    """Where builds live: ``$ASTRAI_CPU_CACHE``, else per torch version and CPU under ~/.cache."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    tag = f"torch{torch.__version__.split('+')[0]}-{platform.machine()}-{_cpu_tag()}"
    return Path.home() / ".cache" / "astrai" / "cpu-kernels" / tag


def load_kernels() -> str:
    """Register ``torch.ops.astrai_cpu.*`` (once per process); returns the build directory.

    Raises ``KernelUnavailable`` with the reason (no C++ compiler, no ninja, a compiler or
    loader error) when the kernels cannot be built or loaded.
    """
    global _loaded
    with _lock:
        if _loaded is not None:
            return _loaded
        compiler = os.environ.get("CXX", "c++")
        if shutil.which(compiler) is None:
            raise KernelUnavailable(f"no C++ compiler ({compiler!r} is not on PATH) to build the astrai CPU kernels")
        build = cache_dir()
        try:
            from torch.utils.cpp_extension import load  # imports setuptools machinery: only when needed

            build.mkdir(parents=True, exist_ok=True)
            logger.info("loading the astrai CPU kernels from %s (built on first use)", build)
            load(
                name=EXTENSION_NAME,
                sources=[str(p) for p in SOURCES],
                extra_cflags=CXX_FLAGS,
                extra_ldflags=["-fopenmp"],
                build_directory=str(build),
                is_python_module=False,
                verbose=logger.isEnabledFor(logging.DEBUG),
            )
        except Exception as err:  # compiler, ninja, linker or loader: all mean "no kernels here"
            raise KernelUnavailable(f"astrai CPU kernels could not be built or loaded: {type(err).__name__}: {err}") from err
        _register_fused()
        _loaded = str(build)
        return _loaded


def rotary_kernel(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """``apply_rotary_emb``'s contract on ``astrai_cpu::rotary`` (``[..., heads, D]`` with contiguous heads)."""
    heads, dim = x.shape[-2:]
    if x.stride(-1) != 1 or x.stride(-2) != dim or freqs.shape[:-2] != x.shape[:-2] or x.dim() < 3:
        return _rotate_torch(x, freqs)  # broadcasting or exotic strides: the torch path
    rows = x.reshape(-1, heads, dim)  # a view for the model's [1, T, H, D] slices of the fused QKV
    out = torch.ops.astrai_cpu.rotary(rows, freqs.reshape(-1, dim // 2, 2).float().contiguous())
    return out.view(x.shape)


class LinearKernel:
    """``astrai.extension.fused``'s ``linear`` on ``astrai_cpu::linear_pack``/``linear_packed`` (bf16 rows).

    ``max_rows``: any number where the CPU has no AMX (the kernel matches oneDNN from 256 rows
    and beats it below); with AMX, oneDNN's tile GEMMs should win on prefill-sized inputs, so
    inputs over 64 rows go to oneDNN there (a threshold not measured on an AMX machine).
    """

    def __init__(self) -> None:
        self.max_rows: int | None = 64 if torch.cpu._is_amx_tile_supported() else None

    def pack(self, weight: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The ``[N, K]`` weight in 16-row tiles by pairs of k, and ``N``."""
        return torch.ops.astrai_cpu.linear_pack(weight.contiguous()), weight.shape[0]

    def __call__(self, x: torch.Tensor, packed: tuple[torch.Tensor, int], bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.astrai_cpu.linear_packed(x, packed[0], packed[1], bias)


def _register_fused() -> None:
    """Install the fused CPU kernels into ``astrai.extension.fused`` (rotary: bf16 only, by its dispatch rule)."""
    ops = torch.ops.astrai_cpu
    register_kernel("rotary", rotary_kernel, "cpu")
    register_kernel("rms_norm", lambda x, w, eps: ops.rms_norm(x.contiguous(), w.to(x.dtype), eps), "cpu")
    register_kernel(
        "add_rms_norm", lambda x, r, w, eps: ops.add_rms_norm(x.contiguous(), r.contiguous(), w.to(x.dtype), eps), "cpu"
    )
    if ops.has_linear_packed():  # the compiler targeted AVX512-BF16: small-batch GEMMs at the read bandwidth
        from astrai_backend_cpu.stack import DecoderLayersKernel

        linear = LinearKernel()
        register_kernel("linear", linear, "cpu")
        register_kernel("decoder_layers", DecoderLayersKernel(linear), "cpu")  # on the same packed weights


def paged_decode(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``torch.ops.astrai_cpu.paged_decode`` (loading the kernels first): see ``csrc/paged_decode.cpp``.

    ``q [B, Hq, D]``; ``k_buffer``/``v_buffer [size, Hkv, D]`` of one layer; ``req_to_token``
    int32; ``rows``/``seq_lens [B]`` int64 -> ``[B, Hq, D]`` in ``q``'s dtype.
    """
    load_kernels()
    return torch.ops.astrai_cpu.paged_decode(q, k_buffer, v_buffer, req_to_token, rows, seq_lens, scale)
