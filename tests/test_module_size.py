"""No module of the distributions, examples, scripts or benchmarks is over 300 lines, unless its
docstring says why ("Over 300 lines because ..."): a newcomer should find a room, not a hall."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 300
SOURCES = sorted(
    [
        *ROOT.glob("astrai-*/src/**/*.py"),
        *ROOT.glob("examples/*/src/**/*.py"),
        *ROOT.glob("scripts/*.py"),
        *ROOT.glob("benchmarks/*.py"),
    ]
)


def test_the_sources_are_found():
    names = {p.name for p in SOURCES}
    assert {"scheduler.py", "batching.py", "runner.py", "serve_bench.py"} <= names


@pytest.mark.parametrize("path", SOURCES, ids=[str(p.relative_to(ROOT)) for p in SOURCES])
def test_module_is_short_or_says_why(path: Path):
    text = path.read_text(encoding="utf-8")
    lines = len(text.splitlines())
    if lines <= LIMIT:
        return
    doc = ast.get_docstring(ast.parse(text)) or ""
    assert "Over 300 lines because" in doc, f"{lines} lines and no reason in the module docstring"
