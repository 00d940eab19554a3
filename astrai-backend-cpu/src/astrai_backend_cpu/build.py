"""Building and loading the CPU kernels: a just-in-time build into a persistent cache.

``load_kernels()`` registers ``torch.ops.astrai_cpu.*`` in this process, once (lending
them to the model's fused ops is ``CpuBackend.kernels``'s, from ``astrai_backend_cpu.kernels``). The
sources are compiled by ``torch.utils.cpp_extension.load`` (ninja, the system's C++
compiler, ``-march=native``) into ``$ASTRAI_CPU_CACHE`` or
``~/.cache/astrai/cpu-kernels/<torch>-<machine>-<cpu flags hash>-<sources hash>``, so only the
first use of these sources (in this folder) on a machine pays the compile (about 20 seconds), and
two versions or copies of astrai on one machine (two virtual environments, a checkout beside an
install) keep a build each rather than rebuilding over one another. The cache is per instruction set: a build for one CPU never loads on
another. The build and load run under ``build_lock`` (``astrai.extension.api``): processes sharing a
cache (replicas on one volume) build one at a time, and a build killed half-way (its torch
``lock`` file left behind) holds up no later start.

``python -m astrai_backend_cpu`` (``main``) builds them ahead of the first start (an image build, an
install step, the test command before pytest) and says where they are; it exits 0 when they cannot
be built (the reason printed: the server then runs on torch_native), 1 with ``--strict``.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import platform
import shutil
import sys
import threading
from pathlib import Path

import torch

from astrai.extension.api import KernelUnavailable, build_lock

logger = logging.getLogger(__name__)

EXTENSION_NAME = "astrai_cpu_kernels"
CACHE_ENV = "ASTRAI_CPU_CACHE"
SOURCES = [
    Path(__file__).parent / "csrc" / name
    for name in (
        "paged_decode.cpp",
        "prefill.cpp",
        "fused.cpp",
        "argmax.cpp",
        "categorical.cpp",
        "logits_out.cpp",
        "top_p.cpp",
        "linear.cpp",
        "decode_stack.cpp",
        "quant.cpp",
        "quant_avx2.cpp",
        "quant_q8_avx2.cpp",
        "quant_q8_avx512.cpp",
        "experts.cpp",
        "lora.cpp",
        "kv_store.cpp",
        "peak.cpp",
    )
]
# -ffast-math lets the compiler vectorise the float reductions and exp; -fno-finite-math-only
# keeps infinities meaningful; -march=native: the cache is per CPU (see cache_dir).
CXX_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-fopenmp"]

_lock = threading.Lock()
_loaded: str | None = None


def _cpu_tag() -> str:
    try:
        flags = next(
            line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")
        )
    except (OSError, StopIteration):
        flags = platform.processor()
    return hashlib.sha1(flags.encode()).hexdigest()[:10]


def _sources_tag() -> str:
    # the folder too: torch's build file names each source by its path, so two checkouts of the same
    # sources sharing a build would still rebuild over one another
    digest = hashlib.sha1(" ".join([*CXX_FLAGS, str(SOURCES[0].parent.resolve())]).encode())
    for src in sorted({*SOURCES, *(SOURCES[0].parent.glob("*.h"))}):
        digest.update(src.name.encode() + b"\0" + src.read_bytes())
    return digest.hexdigest()[:10]


def cache_dir() -> Path:
    """Where builds live: ``$ASTRAI_CPU_CACHE``, else per torch version, CPU and sources under ~/.cache."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    tag = f"torch{torch.__version__.split('+')[0]}-{platform.machine()}-{_cpu_tag()}-{_sources_tag()}"
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
            raise KernelUnavailable(
                f"no C++ compiler ({compiler!r} is not on PATH) to build the astrai CPU kernels"
            )
        build = cache_dir()
        try:
            from torch.utils.cpp_extension import load  # imports setuptools machinery: only when needed

            logger.info("loading the astrai CPU kernels from %s (built on first use)", build)
            with build_lock(build):  # torch's own lock file would outlive a killed builder
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
            raise KernelUnavailable(
                f"astrai CPU kernels could not be built or loaded: {type(err).__name__}: {err}"
            ) from err
        _loaded = str(build)
        return _loaded


def paged_decode(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    starts: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``torch.ops.astrai_cpu.paged_decode`` (loading the kernels first): see ``csrc/paged_decode.cpp``.

    ``q [B, Hq, D]``; ``k_buffer``/``v_buffer [size, Hkv, D]`` of one layer, in q's dtype or int8
    with its float32 ``k_scale``/``v_scale [size, Hkv]`` (``astrai.kvcache.quant``);
    ``req_to_token`` int32; ``rows``/``seq_lens [B]`` int64; ``starts [B]`` int64, the first
    position each request attends (a sliding window; None: 0) -> ``[B, Hq, D]`` in ``q``'s dtype.
    """
    load_kernels()
    return torch.ops.astrai_cpu.paged_decode(
        q, k_buffer, v_buffer, req_to_token, rows, seq_lens, scale, starts, k_scale, v_scale
    )


def main(argv: list[str] | None = None) -> int:
    """Build (or find) this machine's kernels and print where they are; see the module doc."""
    parser = argparse.ArgumentParser(prog="python -m astrai_backend_cpu", description=main.__doc__)
    parser.add_argument("--strict", action="store_true", help="exit 1 when the kernels cannot be built")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        print(f"astrai CPU kernels in {load_kernels()}")
    except KernelUnavailable as err:
        print(f"astrai CPU kernels unavailable: {err}", file=sys.stderr)
        return 1 if args.strict else 0
    return 0
