"""CPU tuning: malloc's (astrai.malloc) applied once on Linux/glibc, a no-op elsewhere; OpenMP teams."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from astrai import cpu_tuning, malloc


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt tuning targets glibc")
def test_tune_malloc_applies_once_on_glibc():
    code = "from astrai.malloc import tune_malloc; print(tune_malloc(), tune_malloc())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "True"]


def test_tune_malloc_is_a_no_op_off_linux(monkeypatch):
    monkeypatch.setattr(malloc.sys, "platform", "darwin")
    malloc._libc.cache_clear()
    malloc.tune_malloc.cache_clear()
    try:
        assert malloc.tune_malloc() is False
        malloc.trim_heap()  # nothing to call: no error
    finally:
        malloc._libc.cache_clear()
        malloc.tune_malloc.cache_clear()


def test_run_off_thread_returns_the_result_from_another_thread():
    import threading

    caller = threading.get_ident()
    assert cpu_tuning.run_off_thread(lambda a, b: (a + b, threading.get_ident() != caller), 2, 3) == (5, True)


def test_run_off_thread_raises_the_workers_exception():
    def fail():
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        cpu_tuning.run_off_thread(fail)


_TEAM = """
import os, torch
from astrai.cpu_tuning import release_openmp_team
torch.set_num_threads(2)  # a team of two even on one CPU: one worker thread
def threads():
    return len(os.listdir("/proc/self/task"))
base = threads()
torch.ones(1 << 22).add_(1)  # large enough to run in parallel
formed = threads()
released = release_openmp_team()
print(base, formed, threads(), released, release_openmp_team())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc")
def test_release_openmp_team_ends_the_calling_threads_team():
    """A parallel op leaves this thread a team (one worker thread); the release ends it, and a second
    release, with no team left, is harmless."""
    out = subprocess.run([sys.executable, "-c", _TEAM], capture_output=True, text=True, check=True)
    base, formed, after, released, again = out.stdout.split()
    assert (int(formed), int(after), released, again) == (int(base) + 1, int(base), "True", "True")


def test_the_scheduler_releases_the_team_of_the_thread_that_starts_it_or_submits(
    monkeypatch, tiny_model, tiny_tokenizer, make_engine
):
    import threading

    import astrai.scheduler
    from astrai.sampling import SamplingParams

    calls: list[int] = []
    monkeypatch.setattr(
        astrai.scheduler, "release_openmp_team", lambda: calls.append(threading.get_ident()) or True
    )
    engine = make_engine(tiny_model, tiny_tokenizer)
    assert calls == [threading.get_ident()]
    submitter: list[int] = []

    def submit() -> None:
        submitter.append(threading.get_ident())
        r = engine.submit([5, 6, 7], SamplingParams(max_tokens=2, temperature=0.0))
        r.wait_completion()
        r.raise_for_error()

    thread = threading.Thread(target=submit)
    thread.start()
    thread.join()
    assert calls == [threading.get_ident(), submitter[0]]
