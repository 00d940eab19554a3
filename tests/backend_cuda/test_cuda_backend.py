"""CudaBackend as users get it: found through its entry point, honest about what it cannot run.

On a machine without CUDA it reports itself unavailable (with the reason), automatic
selection falls back to torch_native and explicit selection raises. The distribution
installs without CUDA, and every kernel compiles with nvcc (warnings as errors).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from cuda_steps import clone_step, make_step

from astrai.errors import BackendUnavailable, KernelUnavailable
from astrai.extension import attn_backend
from astrai.extension.backend.base import ATTENTION_BACKENDS
from astrai.extension.backend.policy import (
    BackendRegistry,
    attention,
    load_attention_backends,
    reset_registry,
)
from astrai.extension.backend.torch_native import TorchNativeBackend
from astrai.kvcache import KVConfig, PagePool
from astrai.plugins import distribution_of
from astrai_backend_cuda import load_kernels
from astrai_backend_cuda.backend import CudaBackend
from astrai_backend_cuda.plan import DECODE_MAX_SPLITS, PREFILL_Q_TILE

DISTRIBUTION = Path(__file__).parents[2] / "astrai-backend-cuda"
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")


@pytest.fixture
def fresh_registry():
    """The process registry discovered anew for the test, and forgotten after it."""
    reset_registry()
    yield
    reset_registry()


def test_discovered_through_its_entry_point():
    loaded = load_attention_backends()
    assert loaded.classes["cuda"] is CudaBackend and "cuda" not in loaded.failures
    assert distribution_of(ATTENTION_BACKENDS, "cuda", "astrai_backend_cuda.backend:CudaBackend").startswith(
        "astrai-backend-cuda "
    )
    registry = BackendRegistry.discover()
    names = [name for name, _, _ in registry.available_backends()]
    assert names.index("cuda") < names.index("torch_native")  # cuda first in automatic selection


def test_prepare_fills_the_prefill_tile_maps_of_a_bound_step():
    """The tile maps are the CUDA kernels' alone: bind_tasks leaves them unset, prepare fills them."""
    pool = PagePool(1, 4, 2, 64, KVConfig(max_batch_size=4, max_seq_len=300, page_size=4, n_tokens=1024))
    rows = [pool.task_alloc() for _ in range(3)]
    q_lens, seq_lens = [150, 1, 64], [150, 9, 70]
    for row, s in zip(rows, seq_lens, strict=True):
        pool.extend(row, s)
    kv = pool.bind_tasks(rows, q_lens, seq_lens)
    assert kv.q_tile_to_batch is None and kv.decode_o_part is None
    CudaBackend().prepare(torch.empty(0, 4, 64), kv)
    tiles = [(b, t // PREFILL_Q_TILE) for b, q in enumerate(q_lens) for t in range(0, q, PREFILL_Q_TILE)]
    assert kv.q_tile_to_batch.dtype == torch.int32 and kv.q_tile_to_index.dtype == torch.int32
    assert list(zip(kv.q_tile_to_batch.tolist(), kv.q_tile_to_index.tolist(), strict=True)) == tiles
    assert kv.decode_o_part is None  # a prefill step needs no split-K scratch


def test_decode_scratch_is_allocated_once_per_pool_and_sliced_per_step():
    pool = PagePool(1, 4, 2, 64, KVConfig(max_batch_size=4, max_seq_len=8), torch.bfloat16)
    rows = [pool.task_alloc() for _ in range(3)]
    for row in rows:
        pool.extend(row, 2)
    backend, q = CudaBackend(), torch.empty(0, 4, 64, dtype=torch.bfloat16)
    first = backend._decode_scratch(q, pool.bind_tasks(rows, [1, 1, 1], [2, 2, 2]))
    second = backend._decode_scratch(q, pool.bind_tasks(rows[:2], [1, 1], [2, 2]))
    assert all(a is b for a, b in zip(first, second, strict=True))
    o_part, ml_part, out = first
    assert o_part.shape == (4, 4, DECODE_MAX_SPLITS, 64) and o_part.dtype == torch.float32
    assert (
        ml_part.shape == (4, 4, DECODE_MAX_SPLITS) and out.shape == (4, 4, 64) and out.dtype == torch.bfloat16
    )


@no_cuda
def test_unavailable_without_cuda_says_why():
    assert CudaBackend.is_available() == (False, "no CUDA device (torch.cuda.is_available() is False)")


@pytest.mark.skipif(torch.version.cuda is not None, reason="torch has CUDA here")
def test_kernels_do_not_load_on_cpu_torch():
    with pytest.raises(KernelUnavailable, match="CPU-only build"):
        load_kernels()


@pytest.mark.parametrize(
    ("dtype", "head_dim", "n_heads", "n_kv", "reason"),
    [
        (torch.float32, 64, 4, 2, "dtype torch.float32"),
        (torch.bfloat16, 80, 4, 2, "head_dim 80 not supported (64, 128)"),
        (torch.float16, 128, 34, 2, "34 query heads over 2 KV heads not supported (at most 16 per KV head)"),
        (torch.bfloat16, 64, 4, 2, "device cpu"),
    ],
    ids=["dtype", "head-dim", "group", "device"],
)
def test_supports_names_what_it_cannot_run(dtype, head_dim, n_heads, n_kv, reason):
    kv, q, _, _ = make_step([1], [3], n_heads, n_kv, head_dim, dtype, seed=0)
    assert reason in CudaBackend().supports(q, kv)


@no_cuda
def test_policy_falls_back_or_raises(fresh_registry, monkeypatch):
    kv, q, k, v = make_step([1, 4], [5, 0], 4, 2, 64, torch.bfloat16, seed=1, poison_free=False)
    automatic = attention(q, k, v, 0, clone_step(kv), 0.125)
    torch.testing.assert_close(automatic, TorchNativeBackend().forward(q, k, v, 0, clone_step(kv), 0.125))
    with (
        attn_backend("cuda"),
        pytest.raises(BackendUnavailable, match=r"'cuda' .*unavailable: no CUDA device"),
    ):
        attention(q, k, v, 0, kv, 0.125)
    monkeypatch.setenv("ASTR_BACKEND", "cuda")
    with pytest.raises(BackendUnavailable, match=r"ASTR_BACKEND=cuda.*unavailable: no CUDA device"):
        attention(q, k, v, 0, kv, 0.125)


@pytest.mark.skipif(
    torch.version.cuda is not None, reason="torch has CUDA here: the wheel may build the extension"
)
def test_installs_without_cuda_as_pure_python(tmp_path):
    """The wheel of a machine without CUDA: the kernel sources as package data, no compiled library."""
    source = tmp_path / "src"  # a copy: building in place would leave build/ in the checkout
    shutil.copytree(DISTRIBUTION, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "-q",
        "-w",
        str(tmp_path),
        str(source),
    ]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    (wheel,) = tmp_path.glob("astrai_backend_cuda-*.whl")
    assert wheel.name.endswith("-py3-none-any.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for name in (
        "decode.cu",
        "prefill.cu",
        "rotary.cu",
        "common.cuh",
        "ptx.cuh",
        "kernels.h",
        "bindings.cpp",
    ):
        assert f"astrai_backend_cuda/csrc/{name}" in names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert (
        "cuda = astrai_backend_cuda.backend:CudaBackend" in zipfile.ZipFile(wheel).read(entry_points).decode()
    )


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_every_kernel_compiles_with_nvcc_warnings_as_errors():
    proc = subprocess.run(
        [sys.executable, "-m", "astrai_backend_cuda.compile_check"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in ("decode.cu", "prefill.cu", "rotary.cu", "bindings.cpp"):
        assert f"ok   {name}" in proc.stdout
