"""CpuBackend: its decode kernel against a dense float64 reference, mixed steps, and the engine."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_attention_torch_native import make_step, reference, run_and_check

from astrai.errors import KernelUnavailable
from astrai_backend_cpu import build, paged_decode
from astrai_backend_cpu.backend import CpuBackend

pytestmark = pytest.mark.usefixtures("cpu_kernels")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("head_dim", [16, 64, 128, 256])
@pytest.mark.parametrize("group", [1, 3, 4], ids=["mha", "gqa3", "gqa4"])
def test_decode_rows_match_the_reference(dtype, head_dim, group):
    # lengths around the kernel's 128-position work items (1, 127..129, 300), scattered slots
    prefix = [0, 126, 127, 128, 299, 40, 7]
    kv = run_and_check(
        [1] * 7, prefix, 2, group, head_dim, dtype, seed=head_dim + group, layers=(0, 1), backend=CpuBackend()
    )
    assert kv.plan["cpu"].tok_rows is None  # a pure decode step: every row on the kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_mixed_step_decodes_on_the_kernel_the_rest_on_prefill_attention_or_torch_native(dtype):
    q_lens, prefix = [1, 23, 1, 70, 1, 1, 5, 1], [30, 0, 200, 9, 0, 61, 4, 7]
    kv = run_and_check(q_lens, prefix, 2, 3, 64, dtype, seed=10, layers=(0, 1), backend=CpuBackend())
    plan = kv.plan["cpu"]
    assert plan.tok_rows.tolist() == [0, 24, 95, 96, 102]
    assert plan.rows.tolist() == kv.req_pool_indices[[0, 2, 4, 5, 7]].tolist()
    if dtype == torch.bfloat16 and torch.ops.astrai_cpu.has_prefill_attention():
        # every other request, fresh or after cached positions: (row, first token row, rows, prefix)
        assert plan.native is None
        assert [c.tolist() for c in plan.chunks] == [
            kv.req_pool_indices[[1, 3, 6]].tolist(),
            [1, 25, 97],
            [23, 70, 5],
            [0, 9, 4],
        ]
    else:
        assert plan.chunks is None
        assert plan.native.fresh == ((1, 23),) and plan.native.prefill is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("window", [1, 50, 128, 200, 5000])
def test_windowed_decode_rows_match_the_reference(dtype, window):
    """A sliding window (of one position, inside the kernel's 128-position work items, across them,
    wider than every request): paged_decode from each request's first position in it."""
    prefix = [0, 126, 127, 128, 299, 40, 7]
    kv = run_and_check(
        [1] * 7, prefix, 2, 3, 64, dtype, seed=window, layers=(0, 1), backend=CpuBackend(), window=window
    )
    assert kv.plan["cpu"].tok_rows is None  # every row on the kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(("window", "softcap"), [(1, 0.0), (16, 0.0), (100, 0.0), (0, 2.0), (16, 2.0)])
def test_windowed_and_softcapped_mixed_steps_match_the_reference(dtype, window, softcap):
    """Decode rows on paged_decode (a window's first positions), the others on prefill_attention
    (AVX512-BF16 builds: it takes the window) or torch_native's windowed plans; soft-capped layers as
    torch_native."""
    q_lens, prefix = [1, 23, 1, 70, 1, 1, 5, 1], [30, 0, 200, 9, 0, 61, 4, 7]
    run_and_check(
        q_lens,
        prefix,
        2,
        3,
        64,
        dtype,
        seed=window + 10,
        layers=(0, 1),
        backend=CpuBackend(),
        window=window,
        softcap=softcap,
    )


def test_a_window_start_is_a_table_row_that_starts_there():
    """paged_decode from ``starts[b]`` is, bit for bit, the same request with its table row cut
    there: work items are counted from the first position attended."""
    gen = torch.Generator().manual_seed(6)
    kv, _ = make_step([1] * 4, [700, 5, 129, 300], 3, 64, torch.bfloat16, gen)
    q = torch.randn(4, 9, 64, generator=gen).bfloat16()
    starts = (kv.seq_lens - 200).clamp(min=0)
    args = (kv.k_buffer[0], kv.v_buffer[0])
    windowed = paged_decode(q, *args, kv.req_to_token, kv.req_pool_indices, kv.seq_lens, 0.125, starts)
    for b in range(4):
        row, s = int(kv.req_pool_indices[b]), int(starts[b])
        cut = kv.req_to_token[row : row + 1, s:].contiguous()
        alone = paged_decode(q[b : b + 1], *args, cut, torch.tensor([0]), kv.seq_lens[b : b + 1] - s, 0.125)
        assert torch.equal(alone[0], windowed[b])


def test_prefill_only_step_is_torch_native():
    kv = run_and_check([12, 30], [0, 9], 1, 3, 64, torch.float32, seed=3, backend=CpuBackend())
    assert kv.plan["cpu"].native.decode is None


def test_without_host_facts():
    gen = torch.Generator().manual_seed(9)
    kv, slots = make_step([7, 1, 12], [4, 5, 9], 2, 64, torch.float32, gen)
    kv = dataclasses.replace(kv, q_lens_host=(), seq_lens_host=())
    q = torch.randn(20, 2, 64, generator=gen)
    k, v = torch.randn(20, 2, 64, generator=gen), torch.randn(20, 2, 64, generator=gen)
    k_old, v_old = kv.k_buffer[0].clone(), kv.v_buffer[0].clone()
    out = CpuBackend().forward(q, k, v, 0, kv, 0.125)
    want = reference(q, k, v, k_old, v_old, slots, [7, 1, 12], [4, 5, 9], 0.125)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_a_request_gets_the_same_bits_alone_and_in_any_batch(dtype):
    # work items depend on each request's own length only: no batch-dependent reduction order
    gen = torch.Generator().manual_seed(4)
    kv, _ = make_step([1] * 6, [700, 5, 129, 300, 64, 1000], 3, 64, dtype, gen)
    q = torch.randn(6, 9, 64, generator=gen).to(dtype)
    args = (kv.k_buffer[0], kv.v_buffer[0], kv.req_to_token)
    batch = paged_decode(q, *args, kv.req_pool_indices, kv.seq_lens, 0.125)
    for i in range(6):
        alone = paged_decode(
            q[i : i + 1], *args, kv.req_pool_indices[i : i + 1], kv.seq_lens[i : i + 1], 0.125
        )
        assert torch.equal(alone[0], batch[i])


def test_kernel_rejects_bad_arguments():
    q = torch.randn(2, 4, 64)
    pool = torch.randn(10, 2, 64)
    table = torch.zeros(2, 8, dtype=torch.int32)
    rows, lens = torch.tensor([0, 1]), torch.tensor([3, 4])
    with pytest.raises(RuntimeError, match="must be int8 with its scales, or in q.s dtype"):
        paged_decode(q, pool.bfloat16(), pool.bfloat16(), table, rows, lens, 0.125)
    with pytest.raises(RuntimeError, match="int32"):
        paged_decode(q, pool, pool, table.long(), rows, lens, 0.125)
    with pytest.raises(RuntimeError, match="multiple of Hkv"):
        paged_decode(torch.randn(2, 3, 64), pool, pool, table, rows, lens, 0.125)


def test_capabilities():
    backend = CpuBackend()
    assert CpuBackend.is_available() == (True, "")
    assert backend.supports(torch.zeros(1, 2, 64), None) is None
    assert backend.supports(torch.zeros(1, 2, 64, dtype=torch.float64), None).startswith(
        "dtype torch.float64"
    )
    assert backend.priority < 100  # preferred over torch_native on the CPU


def test_unavailable_without_a_compiler(monkeypatch):
    monkeypatch.setattr(build, "_loaded", None)
    monkeypatch.setenv("CXX", "astrai-no-such-compiler")
    with pytest.raises(KernelUnavailable, match="no C\\+\\+ compiler"):
        build.load_kernels()
    ok, reason = CpuBackend.is_available()
    assert not ok and "astrai-no-such-compiler" in reason


def test_python_m_builds_ahead_and_says_where_or_why_not(monkeypatch, capsys):
    """``python -m astrai_backend_cpu`` (the test command runs it before pytest): the build's folder
    and exit 0; without a compiler the reason and exit 0 (serving falls back), or 1 with --strict."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "astrai_backend_cpu"], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0 and done.stdout == f"astrai CPU kernels in {build.load_kernels()}\n", (
        done.stderr
    )
    monkeypatch.setattr(build, "_loaded", None)
    monkeypatch.setenv("CXX", "astrai-no-such-compiler")
    assert build.main([]) == 0
    assert build.main(["--strict"]) == 1
    err = capsys.readouterr().err
    assert err.count("astrai CPU kernels unavailable: no C++ compiler ('astrai-no-such-compiler'") == 2


def test_the_wheel_ships_every_source_and_header():
    """The kernels compile on the user's machine from the installed package: a file under csrc/
    that package-data misses would leave them unbuildable (and the backend silently unavailable)."""
    import ast
    import fnmatch
    import re
    from pathlib import Path

    root = Path(__file__).parents[2] / "astrai-backend-cpu"
    # [tool.setuptools.package-data]'s line (tomllib is 3.11+; the project supports 3.10)
    line = re.search(r"^astrai_backend_cpu = (\[.*\])$", (root / "pyproject.toml").read_text(), re.M)
    globs = ast.literal_eval(line.group(1))
    package = root / "src" / "astrai_backend_cpu"
    shipped = {
        p
        for p in package.rglob("*")
        if p.is_file() and any(fnmatch.fnmatch(str(p.relative_to(package)), g) for g in globs)
    }
    csrc = {p for p in (package / "csrc").iterdir() if p.is_file()}
    assert csrc and csrc <= shipped, sorted(str(p.name) for p in csrc - shipped)
    assert set(build.SOURCES) <= csrc
