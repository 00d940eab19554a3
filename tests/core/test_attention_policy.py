"""Backend selection: automatic fallback, strict explicit choices, env override, plugin discovery."""

from __future__ import annotations

import inspect
import logging
import sys
import textwrap
import threading

import pytest
import torch

from astrai.errors import BackendUnavailable, KernelUnavailable, PluginError
from astrai.extension import ATTN_BACKEND, AttentionBackend, attention, attn_backend, available_backends, ops
from astrai.extension.backend.base import check_backend_class
from astrai.extension.backend.policy import BackendRegistry, get_registry, requested_backend, reset_registry
from astrai.kvcache.cache import KVCache
from astrai.plugins import PluginFailure


@pytest.fixture(autouse=True)
def no_env(monkeypatch):
    monkeypatch.delenv("ASTR_BACKEND", raising=False)


def fake(name, priority, available=(True, ""), reject=None):
    """A backend class whose output is filled with its priority; `reject(q)` -> reason or None."""

    class Fake(AttentionBackend):
        instances = 0

        def __init__(self):
            type(self).instances += 1

        @classmethod
        def is_available(cls):
            return available

        def supports(self, q, kv_cache):
            return reject(q) if reject else None

        def forward(self, q, k, v, layer_id, kv_cache, scale):
            return torch.full_like(q, float(priority))

    Fake.name, Fake.priority = name, priority
    return Fake


def f32_unsupported(q):
    return f"dtype {q.dtype} not supported" if q.dtype == torch.float32 else None


def make_registry(**failures):
    return BackendRegistry(
        [
            fake("torch_native", 100),
            fake("cuda", 10, available=(False, "no CUDA device")),
            fake("flash", 20, reject=f32_unsupported),
        ],
        failures,
    )


def run(registry, dtype=torch.float32):
    q = torch.zeros(2, 1, 4, dtype=dtype)
    return int(registry.attention(q, q, q, 0, None, 1.0)[0, 0, 0])


def test_automatic_falls_back_per_call_by_priority():
    reg = make_registry()
    assert run(reg, torch.float16) == 20  # cuda unavailable -> flash
    assert run(reg, torch.float32) == 100  # flash rejects f32 -> torch_native
    assert [row[:2] for row in reg.available_backends()] == [
        ("cuda", False),
        ("flash", True),
        ("torch_native", True),
        ("cpu", False),  # known by name (ATTN_BACKEND), not installed in this registry
    ]


def test_each_backend_is_instantiated_once():
    reg = make_registry()
    for _ in range(3):
        run(reg, torch.float16)
        run(reg, torch.float32)
    assert reg.instance("flash") is reg.instance("flash")
    assert type(reg.instance("flash")).instances == 1 and type(reg.instance("torch_native")).instances == 1


def test_context_selection_is_strict():
    reg = make_registry()
    with attn_backend(ATTN_BACKEND.FLASH):
        assert run(reg, torch.float16) == 20
        with pytest.raises(BackendUnavailable, match=r"'flash'.*dtype torch.float32 not supported"):
            run(reg, torch.float32)
    with (
        attn_backend("cuda"),
        pytest.raises(BackendUnavailable, match=r"'cuda'.*unavailable: no CUDA device"),
    ):
        run(reg)


def test_env_override_is_strict_and_context_beats_it(monkeypatch):
    reg = make_registry()
    monkeypatch.setenv("ASTR_BACKEND", "flash")
    with pytest.raises(BackendUnavailable, match="ASTR_BACKEND=flash"):
        run(reg, torch.float32)
    with attn_backend(ATTN_BACKEND.TORCH_NATIVE):
        assert run(reg, torch.float16) == 100
    assert run(reg, torch.float16) == 20


def test_invalid_env_value_names_the_valid_ones(monkeypatch):
    monkeypatch.setenv("ASTR_BACKEND", "cdua")
    with pytest.raises(BackendUnavailable, match="cdua") as err:
        run(make_registry())
    assert all(name in str(err.value) for name in ("cpu", "cuda", "flash", "torch_native"))


def test_known_name_not_installed(monkeypatch):
    monkeypatch.setenv("ASTR_BACKEND", "cuda")
    reg = BackendRegistry([fake("torch_native", 100), fake("flash", 20)])
    with pytest.raises(
        BackendUnavailable, match="not found; misspelled or not installed. Installed: flash, torch_native"
    ):
        run(reg)
    assert ("cuda", False, "not installed") in reg.available_backends()


def test_attn_backend_names_the_cpu_backend():
    reg = BackendRegistry([fake("torch_native", 100), fake("cpu", 50, reject=f32_unsupported)])
    assert [b.value for b in ATTN_BACKEND] == ["cuda", "flash", "cpu", "torch_native"]  # by priority
    with attn_backend(ATTN_BACKEND.CPU):
        assert requested_backend() == ("cpu", "attn_backend()")
        assert run(reg, torch.float16) == 50
        with pytest.raises(BackendUnavailable, match=r"'cpu'.*dtype torch.float32 not supported"):
            run(reg, torch.float32)


def test_context_nests_restores_and_survives_errors():
    assert requested_backend() == (None, "automatic")
    with attn_backend("flash"):
        with attn_backend(ATTN_BACKEND.CUDA):
            assert requested_backend()[0] == "cuda"
        assert requested_backend()[0] == "flash"
        with pytest.raises(RuntimeError), attn_backend("torch_native"):
            raise RuntimeError
        assert requested_backend()[0] == "flash"
    assert requested_backend() == (None, "automatic")
    with pytest.raises(TypeError):
        attn_backend(3).__enter__()


def test_selection_is_per_thread():
    seen = {}
    inside = threading.Event()
    release = threading.Event()

    def worker():
        seen["start"] = requested_backend()[0]  # a new thread does not inherit the caller's choice
        with attn_backend("cuda"):
            inside.set()
            release.wait(5)
            seen["inside"] = requested_backend()[0]

    with attn_backend("flash"):
        thread = threading.Thread(target=worker)
        thread.start()
        inside.wait(5)
        seen["main"] = requested_backend()[0]
        release.set()
        thread.join(5)
    assert seen == {"start": None, "inside": "cuda", "main": "flash"}


def test_broken_plugin_strict_when_named_skipped_with_warning_otherwise(caplog):
    failure = PluginFailure(
        "astrai.attention_backends",
        "cuda",
        "astrai_backend_cuda:CudaBackend",
        "astrai-backend-cuda 0.1.0",
        ImportError("libcudart.so.12: cannot open shared object file"),
    )
    reg = BackendRegistry([fake("torch_native", 100)], {"cuda": failure})
    with caplog.at_level(logging.WARNING, logger="astrai.extension.backend.policy"):
        assert run(reg) == 100
    assert "astrai-backend-cuda 0.1.0" in caplog.text and "libcudart" in caplog.text
    with attn_backend("cuda"), pytest.raises(PluginError, match=r"astrai-backend-cuda 0\.1\.0.*libcudart"):
        run(reg)
    assert ("cuda", False, failure.describe()) in reg.available_backends()


def test_in_memory_registry_validates_classes():
    with pytest.raises(PluginError):
        BackendRegistry([object])
    with pytest.raises(PluginError, match="must match"):
        check_backend_class("cuda", fake("flash", 20), "entry point 'cuda'")


def test_discovery_from_an_installed_distribution(tmp_path, monkeypatch):
    (tmp_path / "astrai_fake_backends.py").write_text(
        textwrap.dedent("""
        from astrai.extension import AttentionBackend

        class Good(AttentionBackend):
            name, priority = "fake_good", 30
            @classmethod
            def is_available(cls):
                return True, ""
            def supports(self, q, kv_cache):
                return None
            def forward(self, q, k, v, layer_id, kv_cache, scale):
                return q

        class Misnamed(Good):
            name = "something_else"

        class NotABackend:
            name = "fake_plain"
    """)
    )
    (tmp_path / "astrai_fake_broken.py").write_text("raise ImportError('needs libfoo')\n")
    dist = tmp_path / "astrai_fake_plugins-1.2.3.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: astrai-fake-plugins\nVersion: 1.2.3\n")
    (dist / "entry_points.txt").write_text(
        textwrap.dedent("""
        [astrai.attention_backends]
        fake_good = astrai_fake_backends:Good
        fake_misnamed = astrai_fake_backends:Misnamed
        fake_plain = astrai_fake_backends:NotABackend
        fake_broken = astrai_fake_broken:Thing
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        reg = BackendRegistry.discover()
    finally:
        sys.modules.pop("astrai_fake_backends", None)
        sys.modules.pop("astrai_fake_broken", None)
    rows = {name: (ok, reason) for name, ok, reason in reg.available_backends()}
    assert rows["fake_good"] == (True, "") and rows["torch_native"] == (True, "")
    for name, problem in [
        ("fake_misnamed", "must match"),
        ("fake_plain", "not a subclass"),
        ("fake_broken", "needs libfoo"),
    ]:
        assert not rows[name][0] and "astrai-fake-plugins 1.2.3" in rows[name][1] and problem in rows[name][1]
        with attn_backend(name), pytest.raises(PluginError, match="astrai-fake-plugins 1.2.3"):
            run(reg)
    assert run(reg) == 0  # automatic: fake_good (priority 30) runs, returning q


def test_default_registry_runs_torch_native_on_cpu():
    reset_registry()
    assert get_registry() is get_registry()
    assert ("torch_native", True, "") in available_backends()
    # One request, two new tokens at positions 0 and 1, slots 3 and 1 of a 4-slot pool.
    kv = KVCache(
        k_buffer=torch.zeros(1, 4, 1, 2),
        v_buffer=torch.zeros(1, 4, 1, 2),
        req_to_token=torch.tensor([[3, 1, 0]], dtype=torch.int32),
        req_pool_indices=torch.tensor([0]),
        seq_lens=torch.tensor([2]),
        out_cache_loc=torch.tensor([3, 1]),
        max_len=2,
        kv_indptr=torch.tensor([0, 2], dtype=torch.int32),
        qo_indptr=torch.tensor([0, 2], dtype=torch.int32),
        max_q_len=2,
        num_tokens=2,
        q_lens_host=(2,),
        seq_lens_host=(2,),
    )
    q = torch.tensor([[[1.0, 0.0]], [[1.0, 0.0]]])
    k = torch.tensor([[[0.0, 0.0]], [[2.0, 0.0]]])
    v = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]])
    out = attention(q, k, v, 0, kv, 1.0)
    w = 1 / (1 + torch.e**2)  # token 1: softmax over scores (0, 2)
    torch.testing.assert_close(out, torch.tensor([[[1.0, 0.0]], [[w, 1 - w]]]))
    assert torch.equal(kv.k_buffer[0, 3], k[0]) and torch.equal(kv.k_buffer[0, 1], k[1])
    reset_registry()


@pytest.mark.parametrize("op", ["attn_paged_decode", "attn_paged_prefill", "rotary_emb"])
def test_ops_raise_when_kernels_are_not_built(op):
    if hasattr(torch.ops.astrai, op):
        pytest.skip("the compiled astrai ops are registered in this process")
    fn = getattr(ops, op)
    args = [None] * len(inspect.signature(fn).parameters)
    with pytest.raises(KernelUnavailable, match=rf"torch\.ops\.astrai\.{op} .*astrai-backend-cuda"):
        fn(*args)
    assert issubclass(KernelUnavailable, BackendUnavailable)  # callers catching the family see it
