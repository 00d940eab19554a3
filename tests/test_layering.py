"""The layers of the distributions: astrai-core imports no web stack and no server; backends no server."""

from __future__ import annotations

import subprocess
import sys

import pytest

IMPORT_ALL = """
import importlib, pkgutil, sys
pkg = importlib.import_module({package!r})
for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
    importlib.import_module(info.name)
print(" ".join(sorted(m for m in {forbidden!r} if m in sys.modules)))
"""


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        ("astrai", ("fastapi", "uvicorn", "starlette", "astrai_server")),
        ("astrai_backend_cpu", ("astrai_server", "fastapi", "uvicorn")),
        ("astrai_backend_cuda", ("astrai_server", "fastapi", "uvicorn")),
        ("astrai_backend_flash", ("astrai_server", "fastapi", "uvicorn")),
    ],
)
def test_package_and_all_its_modules_import_without(package: str, forbidden: tuple[str, ...]) -> None:
    code = IMPORT_ALL.format(package=package, forbidden=forbidden)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "", f"importing {package} and its modules loaded {done.stdout.strip()}"
