"""Each protocol module is a unit a third party can copy: it imports no other protocol module.

Read from the sources of ``astrai_server/protocols/``: every import counts, at module level, inside
a function or under ``if TYPE_CHECKING:`` (a copied file would miss that module all the same), and
so does ``importlib.import_module`` or ``__import__`` of a literal name. What the protocols share
lives outside that folder, in ``astrai_server.request_parts`` and ``astrai_server.openai_shapes``,
which import no protocol module either; and none of them loads the web stack, so that a builder is
tested without HTTP.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import astrai_server.protocols

PROTOCOLS = Path(astrai_server.protocols.__file__).parent
PACKAGE = "astrai_server.protocols"
MODULES = sorted(p.stem for p in PROTOCOLS.glob("*.py") if p.stem != "__init__")
SHARED = ["astrai_server.request_parts", "astrai_server.openai_shapes"]


def imported_names(source: str, package: str) -> set[str]:
    """The dotted names a module's source imports, anywhere in it; ``from a import b`` gives ``a.b``
    (``b`` may be a module); relative imports resolved against ``package``."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join([*parts[: len(parts) - node.level + 1], base]).strip(".")
            names.update(f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Call) and _dynamic_import(node.func) and node.args:
            if isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                names.add(node.args[0].value)
    return names


def _dynamic_import(func: ast.expr) -> bool:
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    return name in ("import_module", "__import__")


def protocol_modules_in(names: set[str]) -> set[str]:
    """The protocol modules among ``names`` (``astrai_server.protocols.openai``, or a name under it)."""
    found = set()
    for name in names:
        head, _, rest = name.partition(PACKAGE + ".")
        if not head and rest.split(".")[0] in MODULES:
            found.add(rest.split(".")[0])
    return found


def test_the_protocol_modules_are_found() -> None:
    assert {"openai", "anthropic", "completions", "responses"} <= set(MODULES)


@pytest.mark.parametrize("module", MODULES)
def test_a_protocol_module_imports_no_other_protocol_module(module: str) -> None:
    source = (PROTOCOLS / f"{module}.py").read_text(encoding="utf-8")
    others = protocol_modules_in(imported_names(source, PACKAGE)) - {module}
    assert not others, (
        f"protocols/{module}.py imports {sorted(others)}: move what they share out of protocols/"
    )


@pytest.mark.parametrize("module", SHARED)
def test_the_shared_modules_import_no_protocol_module(module: str) -> None:
    path = PROTOCOLS.parent / f"{module.rpartition('.')[2]}.py"
    assert not protocol_modules_in(imported_names(path.read_text(encoding="utf-8"), "astrai_server"))


def test_the_reading_sees_every_kind_of_import() -> None:
    source = """
from typing import TYPE_CHECKING
from . import anthropic
if TYPE_CHECKING:
    from astrai_server.protocols.openai import Strict
def f():
    import astrai_server.protocols.responses
    return importlib.import_module("astrai_server.protocols.completions")
from .openai import FINISH
from ..protocols import other
from astrai_server.openai_shapes import FINISH
"""
    names = imported_names(source, PACKAGE)
    assert protocol_modules_in(names) == {"anthropic", "openai", "responses", "completions"}
    assert "astrai_server.protocols.other" in names  # not a protocol module: not reported
    assert "astrai_server.openai_shapes.FINISH" in names


def test_protocols_and_shared_modules_load_no_web_stack() -> None:
    modules = [*SHARED, *(f"{PACKAGE}.{m}" for m in MODULES)]
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print(' '.join(m for m in ('fastapi', 'starlette', 'uvicorn') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "", f"importing the protocols loaded {done.stdout.strip()}"
