"""Optional ahead-of-time build of the CUDA kernels (everything else is in pyproject.toml).

The extension ``astrai_backend_cuda._C`` is built when torch with CUDA and nvcc are
importable at build time, i.e. ``pip install --no-build-isolation astrai-backend-cuda``
in an environment that has them (``ASTRAI_CUDA_AOT=0`` skips it, ``=1`` makes a failure
to find them an error). Otherwise the wheel is pure Python and the kernels are compiled
just in time on first use (``astrai_backend_cuda.build``), so the install always succeeds.
Architectures follow ``TORCH_CUDA_ARCH_LIST`` (default here: 8.0 and 9.0).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from setuptools import setup


def _sources():
    path = Path(__file__).parent / "src" / "astrai_backend_cuda" / "_sources.py"
    spec = importlib.util.spec_from_file_location("_astrai_cuda_sources", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _extensions() -> dict:
    mode = os.environ.get("ASTRAI_CUDA_AOT", "auto")
    if mode == "0":
        return {}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except ImportError:
        torch = CUDA_HOME = None
    if torch is None or torch.version.cuda is None or CUDA_HOME is None:
        if mode == "1":
            raise RuntimeError("ASTRAI_CUDA_AOT=1 needs torch with CUDA and nvcc at build time")
        return {}
    src = _sources()
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", ";".join(f"{a[0]}.{a[1:]}" for a in src.CI_ARCHS))
    root = Path(__file__).parent
    ext = CUDAExtension(
        "astrai_backend_cuda._C",
        [str(p.relative_to(root)) for p in src.all_sources()],
        extra_compile_args={"cxx": list(src.CXX_FLAGS), "nvcc": list(src.NVCC_FLAGS)},
    )
    return {"ext_modules": [ext], "cmdclass": {"build_ext": BuildExtension}}


setup(**_extensions())
