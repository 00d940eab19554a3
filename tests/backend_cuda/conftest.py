"""Fixtures of the CUDA backend tests: the kernels on the CPU emulator, and on a GPU when there is one."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch


@pytest.fixture(scope="session")
def emulator(tmp_path_factory):
    """The kernel sources built with g++ for the CPU emulator (cuda_emu); skips without g++."""
    import cuda_emu

    if shutil.which("g++") is None:
        pytest.skip("no g++ to build the CPU emulator of the kernels")
    try:
        lib = cuda_emu.build(tmp_path_factory.mktemp("astrai-emu"))
    except subprocess.CalledProcessError as err:
        pytest.fail(f"the kernels do not build for the CPU emulator:\n{err.stderr}")
    return cuda_emu.Emulator(lib)


@pytest.fixture(params=["emulator", "gpu"])
def kernels(request):
    """``(implementation of the three ops, device)``: the emulator on CPU, or the real ops on CUDA."""
    if request.param == "emulator":
        return request.getfixturevalue("emulator"), "cpu"
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the compiled kernels run only on a GPU")
    from astrai.extension import ops
    from astrai_backend_cuda import load_kernels

    load_kernels()
    return ops, "cuda"
