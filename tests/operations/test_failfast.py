"""``astrai serve`` at start against real subprocesses (issue 29).

A model that cannot load ends the process with status 1 and one line naming the file and the
problem (``--on-load-failure unhealthy`` keeps it up, answering 503); a model whose metadata asks
for absurd sizes is refused from its header, under an address-space limit far below what loading
it would take; SIGTERM ends a start that waits on another process's kernel build; and a kernel
build killed half-way (torch's ``lock`` file left in the cache) holds up no later start.
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from serving import Served, free_port, wait_healthy

from astrai.extension.build_lock import LOCK_NAME, TORCH_LOCK_NAME

#: Address space of a server under test: importing torch, transformers and uvicorn and serving the
#: default model in float32 with --max-seq-len 512 took under 3 GiB (2 OpenMP threads, 2 malloc
#: arenas); refusing a million layers must happen far below the 23.6 GiB that used to go to the OOM killer.
MEMORY_LIMIT = 4 * 2**30
#: Seconds a server may take to start and fail (imports of torch and transformers, the GGUF header):
#: a server that does not exit at all is what the tests catch.
FAIL_WITHIN = 120
SMALL_PROCESS = {"OMP_NUM_THREADS": "2", "MALLOC_ARENA_MAX": "2"}  # threads reserve address space each


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


class Server(Served):
    """A ``Served`` whose stderr is kept apart (``output``) from its stdout."""

    def stderr_lines(self) -> list[str]:
        return self.log().strip().splitlines()

    def wait_log(self, text: str, timeout: float = FAIL_WITHIN) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.log():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the server never logged {text!r}:\n{self.log()}")
            time.sleep(0.1)


@pytest.fixture
def serve(tmp_path: Path):
    """``serve(*flags, env=None, limit=False) -> Server``: ``astrai serve`` on a free port in float32;
    ``limit``: under ``MEMORY_LIMIT`` of address space. Every process is killed when the test ends."""
    procs: list[subprocess.Popen] = []

    def start(*flags: str, env: dict[str, str] | None = None, limit: bool = False) -> Server:
        port = free_port()
        err = tmp_path / f"server-{len(procs)}.err"
        cmd = [sys.executable, "-m", "astrai.cli", "serve", "--port", str(port), "--dtype", "float32", *flags]
        with err.open("wb") as stderr:
            proc = subprocess.Popen(
                cmd,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                env={**os.environ, **SMALL_PROCESS, **(env or {})},
                preexec_fn=_limit_memory if limit else None,
            )
        procs.append(proc)
        return Server(f"http://127.0.0.1:{port}", err, proc)

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _exit_status(server: Server, timeout: float = FAIL_WITHIN) -> int:
    try:
        return server.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"astrai serve did not exit within {timeout} s:\n{server.log()}")


def _gguf_with(tmp_path: Path, source: Path, key: str, value: int) -> Path:
    """A copy of ``source`` whose uint32 metadata ``key`` is ``value`` (rewritten in place: the key's
    length and name, then its value type, uint32, and the value; found in the bytes, as gguf's
    reader would take seconds to walk the 49k-token vocabulary before it)."""
    path = tmp_path / f"{key.rsplit('.', 1)[-1]}.gguf"
    data = bytearray(source.read_bytes())
    name = struct.pack("<Q", len(key)) + key.encode()
    at = data.index(name) + len(name)
    assert data.count(name) == 1 and struct.unpack_from("<I", data, at)[0] == 4  # GGUF_TYPE_UINT32
    struct.pack_into("<I", data, at + 4, value)
    path.write_bytes(data)
    return path


@pytest.fixture
def truncated_model(tmp_path: Path, default_model_path: Path) -> Path:
    path = tmp_path / "cut.gguf"
    data = default_model_path.read_bytes()
    path.write_bytes(data[: len(data) * 3 // 5])  # the header whole, the tensor data cut short
    return path


def test_a_model_that_cannot_load_ends_serve_with_one_line_naming_the_file(
    serve, truncated_model: Path
) -> None:
    server = serve("--model", str(truncated_model))
    assert _exit_status(server) == 1
    lines = server.stderr_lines()
    assert lines[-1].startswith(f"astrai serve: error: {truncated_model}: truncated: the file has "), lines[
        -1
    ]
    assert "Traceback" not in server.log()  # only at --log-level debug


def test_on_load_failure_unhealthy_keeps_serving_503(serve, truncated_model: Path) -> None:
    server = serve("--model", str(truncated_model), "--on-load-failure", "unhealthy")
    server.wait_log(f"{truncated_model}: truncated")
    time.sleep(1)  # an exit would have begun by now
    assert server.proc.poll() is None
    assert httpx.get(server.url + "/health", timeout=10).status_code == 503
    server.proc.send_signal(signal.SIGTERM)
    assert _exit_status(server, 30) == 0


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        (
            "llama.block_count",
            10**6,
            "llama.block_count is 1000000, but the file holds the tensors of 30 blocks",
        ),
        ("llama.attention.head_count", 0, "llama.attention.head_count is 0: it must be positive"),
        (
            "llama.context_length",
            2**31 - 1,
            "the model's context length 2147483647; a max_seq_len serves less",
        ),
    ],
    ids=["block_count-1e6", "head_count-0", "context_length-2e31"],
)
def test_absurd_metadata_is_refused_without_allocating(
    serve, tmp_path, default_model_path, key, value, message
) -> None:
    model = _gguf_with(tmp_path, default_model_path, key, value)
    server = serve("--model", str(model), limit=True)
    assert _exit_status(server) == 1
    last = server.stderr_lines()[-1]
    assert last.startswith(f"astrai serve: error: {model}: ") and message in last, last
    assert "MemoryError" not in server.log() and "Traceback" not in server.log()


@pytest.mark.slow  # loads the default model
def test_an_absurd_context_length_serves_the_context_asked_for(serve, tmp_path, default_model_path) -> None:
    model = _gguf_with(tmp_path, default_model_path, "llama.context_length", 2**31 - 1)
    server = serve("--model", str(model), "--max-seq-len", "512", limit=True)
    wait_healthy(server)
    (card,) = httpx.get(server.url + "/v1/models", timeout=10).json()["data"]
    assert card["context_length"] == 512
    body = {"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}
    assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200


# ---------------------------------------------------------------- the kernel cache


@pytest.fixture(scope="module")
def built_kernels() -> Path:
    """The session's CPU kernel cache (``ASTRAI_CPU_CACHE`` or the per-CPU default), built if need be."""
    from astrai.errors import KernelUnavailable
    from astrai_backend_cpu.build import cache_dir, load_kernels

    try:
        load_kernels()
    except KernelUnavailable as err:
        pytest.skip(str(err))
    return cache_dir()


@pytest.fixture
def kernel_cache(tmp_path: Path, built_kernels: Path) -> Path:
    """A copy of the built cache, as another replica's volume would hold it (no lock of anyone's)."""
    return Path(
        shutil.copytree(
            built_kernels, tmp_path / "kernels", ignore=shutil.ignore_patterns(LOCK_NAME, TORCH_LOCK_NAME)
        )
    )


def test_sigterm_during_the_start_ends_serve_at_once(serve, kernel_cache: Path) -> None:
    # another live process holds the build lock: the start waits for it (as long as it lives)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\nfrom astrai.extension.build_lock import build_lock\n"
            "with build_lock(sys.argv[1]):\n    print('held', flush=True)\n    time.sleep(600)",
            str(kernel_cache),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        server = serve(env={"ASTRAI_CPU_CACHE": str(kernel_cache)})
        server.wait_log(
            f"waiting for the kernel build in {kernel_cache} by another process (pid {holder.pid} on "
        )
        assert httpx.get(server.url + "/health", timeout=10).status_code == 503
        start = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        assert _exit_status(server, 30) == 0  # the status of a drained stop
        assert time.monotonic() - start < 5, server.log()
        assert holder.poll() is None  # it was waited for, never disturbed
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()


@pytest.mark.slow  # loads the default model
def test_a_build_killed_half_way_holds_up_no_later_start(serve, kernel_cache: Path) -> None:
    (kernel_cache / TORCH_LOCK_NAME).touch()  # what torch's FileBaton leaves when its builder is killed
    server = serve(env={"ASTRAI_CPU_CACHE": str(kernel_cache)})
    wait_healthy(server)
    assert f"removing {kernel_cache / TORCH_LOCK_NAME}" in server.log()
    assert not (kernel_cache / TORCH_LOCK_NAME).exists()


def test_the_failure_line_names_the_file_whatever_raised(default_model_path: Path) -> None:
    from astrai.errors import KernelUnavailable, ModelFormatError
    from astrai_server.loader import describe_failure

    path = str(default_model_path)
    assert (
        describe_failure(ZeroDivisionError("division by zero"), None)
        == f"{path}: ZeroDivisionError: division by zero"
    )
    assert (
        describe_failure(ModelFormatError(f"{path}: block_count is 0"), path) == f"{path}: block_count is 0"
    )
    compiler = KernelUnavailable("kernels could not be built: error: x.cpp:1\n  1 | int x\n    |      ^")
    assert (
        describe_failure(compiler, path)
        == f"{path}: kernels could not be built: error: x.cpp:1 (more in the log above)"
    )
    missing = describe_failure(FileNotFoundError("gone"), "/nowhere/model.gguf")
    assert missing == "/nowhere/model.gguf: FileNotFoundError: gone"
