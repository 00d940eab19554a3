"""``astrai.extension.build_lock``: one builder per kernel build directory, and no wait on a dead one.

The holders are real processes (a flock is per open file, so a thread of this process would do
for "live", but only a process can die holding it): a live holder makes a taker wait, and say
so once; a holder killed outright (SIGKILL, as an OOM kill) releases it, and the torch ``lock``
file it left is removed by the next taker.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from astrai.extension.build_lock import LOCK_NAME, TORCH_LOCK_NAME, build_lock

HOLDER = """
import sys, time
from pathlib import Path
from astrai.extension.build_lock import build_lock
with build_lock(sys.argv[1]):
    (Path(sys.argv[1]) / "lock").touch()  # as torch's FileBaton does when its build starts
    print("held", flush=True)
    time.sleep(600)
"""


@pytest.fixture
def holder(tmp_path: Path):
    """``start()`` a process that holds the lock of ``tmp_path`` (and made torch's lock file) until killed."""
    procs: list[subprocess.Popen] = []

    def start() -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True
        )
        procs.append(proc)
        assert proc.stdout.readline().strip() == "held"
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()
        proc.stdout.close()


def test_a_live_holder_makes_a_taker_wait_and_say_so_once_then_its_death_frees_the_lock(
    tmp_path: Path, holder, caplog: pytest.LogCaptureFixture
) -> None:
    proc = holder()
    taken = threading.Event()

    def take() -> None:
        with build_lock(tmp_path):
            taken.set()

    caplog.set_level(logging.INFO, logger="astrai.extension.build_lock")
    taker = threading.Thread(target=take, daemon=True)
    taker.start()
    assert not taken.wait(1.5), "the lock was taken while its holder lives"
    waiting = [r.getMessage() for r in caplog.records if "waiting for the kernel build" in r.getMessage()]
    assert len(waiting) == 1
    assert waiting[0].startswith(
        f"waiting for the kernel build in {tmp_path} by another process (pid {proc.pid} on "
    )
    proc.send_signal(signal.SIGKILL)  # dies holding it, as an OOM kill leaves a build
    assert taken.wait(10), "the lock of a dead holder was not taken"
    taker.join(5)
    assert not (tmp_path / TORCH_LOCK_NAME).exists()  # its torch lock file went with it


def test_a_dead_builders_torch_lock_is_removed_at_once(
    tmp_path: Path, holder, caplog: pytest.LogCaptureFixture
) -> None:
    proc = holder()
    proc.kill()
    proc.wait()
    assert (tmp_path / TORCH_LOCK_NAME).exists()  # what a killed build leaves: torch would wait on it forever
    start = time.monotonic()
    with build_lock(tmp_path):
        assert not (tmp_path / TORCH_LOCK_NAME).exists()
    assert time.monotonic() - start < 2
    assert any("did not finish" in r.getMessage() for r in caplog.records)
    assert not any("waiting" in r.getMessage() for r in caplog.records)


def test_the_lock_is_released_when_the_block_ends(tmp_path: Path) -> None:
    with build_lock(tmp_path):
        assert (tmp_path / LOCK_NAME).read_text().startswith("pid ")  # for the waiters' log line
    take = "import sys\nfrom astrai.extension.build_lock import build_lock\n"
    take += "with build_lock(sys.argv[1]): print('taken')"
    done = subprocess.run(
        [sys.executable, "-c", take, str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert done.stdout.strip() == "taken" and "waiting" not in done.stderr
