"""CPU malloc tuning: applied once on Linux/glibc, a no-op elsewhere."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from astrai import cpu_tuning


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt tuning targets glibc")
def test_tune_malloc_applies_once_on_glibc():
    code = "from astrai.cpu_tuning import tune_malloc; print(tune_malloc(), tune_malloc())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "True"]


def test_tune_malloc_is_a_no_op_off_linux(monkeypatch):
    monkeypatch.setattr(cpu_tuning.sys, "platform", "darwin")
    cpu_tuning.tune_malloc.cache_clear()
    try:
        assert cpu_tuning.tune_malloc() is False
    finally:
        cpu_tuning.tune_malloc.cache_clear()


def test_run_off_thread_returns_the_result_from_another_thread():
    import threading

    caller = threading.get_ident()
    assert cpu_tuning.run_off_thread(lambda a, b: (a + b, threading.get_ident() != caller), 2, 3) == (5, True)


def test_run_off_thread_raises_the_workers_exception():
    def fail():
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        cpu_tuning.run_off_thread(fail)
