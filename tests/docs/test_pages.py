"""The docs as a whole: runnable examples run, the site builds, architecture tables match the code."""

from __future__ import annotations

import inspect
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from docs_pages import DOCS, KINDS, ROOT, Block, all_blocks

from astrai import groups, hookspecs

DOCTESTS = all_blocks("doctest")


def test_markers_are_well_formed() -> None:
    blocks = all_blocks()  # raises on an unknown marker or a marker with no block
    assert {b.kind for b in blocks} == set(KINDS), "every kind of marker is in use"
    for b in blocks:
        assert bool(b.rows) != bool(b.text), f"{b.where}: a marker takes one table or one code block"
    for b in DOCTESTS:
        assert b.language == "python", f"{b.where}: <!-- doctest --> marks a python block"


@pytest.mark.parametrize("block", DOCTESTS, ids=[f"{b.page}:{b.line}" for b in DOCTESTS])
def test_python_example_runs(block: Block) -> None:
    """A block runs after the earlier blocks of its page that share its name, in one namespace."""
    earlier = [b for b in DOCTESTS if b.argument and (b.page, b.argument) == (block.page, block.argument)]
    namespace = {"__name__": "__doctest__"}
    for b in [b for b in earlier if b.line < block.line] + [block]:
        exec(compile(b.text, b.where, "exec"), namespace)


def test_site_builds_strictly(tmp_path: Path) -> None:
    """Broken links, anchors and files outside the nav fail ``mkdocs build --strict``."""
    pytest.importorskip(
        "mkdocs", reason="mkdocs is not installed (pip install -r docs/requirements.txt; nox -s docs)"
    )
    site = tmp_path / "site"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--config-file",
            str(ROOT / "mkdocs.yml"),
            "--site-dir",
            str(site),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    nav = re.findall(r":\s*(\S+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M)
    assert sorted(nav) == sorted(p.name for p in DOCS.glob("*.md")), (
        "every page in the nav, every nav entry a page"
    )
    assert (site / "http-api" / "index.html").is_file()
    shutil.rmtree(site)


def _registered() -> dict[str, set[tuple[str, str]]]:
    """``{group: {(entry-point name, distribution)}}`` from the pyproject.toml of each distribution here."""
    tomllib = pytest.importorskip("tomllib")
    found: dict[str, set[tuple[str, str]]] = {}
    for pyproject in sorted(ROOT.glob("astrai-*/pyproject.toml")):
        project = tomllib.loads(pyproject.read_text())["project"]
        for group, entries in project.get("entry-points", {}).items():
            found.setdefault(group, set()).update((name, project["name"]) for name in entries)
    return found


def test_entry_point_groups_table_matches_the_pyprojects() -> None:
    (block,) = all_blocks("entry-point-groups")
    registered = _registered()
    assert set(registered) <= set(groups.GROUPS), "a distribution registers in a group astrai does not define"
    rows = {r["Group"]: r for r in block.records()}
    assert sorted(rows) == sorted(groups.GROUPS)
    for group, row in rows.items():
        cell = row["Registered in this repository"]
        documented = set(re.findall(r"([\w.]+) \(([\w-]+)\)", cell))
        assert documented == registered.get(group, set()), f"{block.where}: {group}"
        assert documented or cell == "none", f"{block.where}: {group}"


HOOK_TABLES = all_blocks("hooks")


@pytest.mark.parametrize("block", HOOK_TABLES, ids=[f"{b.page}:{b.line}" for b in HOOK_TABLES])
def test_hooks_table_lists_every_hookspec(block: Block) -> None:
    """Each hook once; a cell written ``name(arg, ...)`` names the hookspec's arguments exactly."""
    specs = {
        name: list(inspect.signature(fn).parameters)
        for name, fn in inspect.getmembers(hookspecs, inspect.isfunction)
        if name.startswith("astrai_")
    }
    cells = [re.fullmatch(r"(\w+)(?:\((.*)\))?", r["Hook"]) for r in block.records()]
    assert all(cells), f"{block.where}: a Hook cell is a name or name(arg, ...)"
    assert sorted(m[1] for m in cells) == sorted(specs), block.where
    for m in cells:
        if m[2] is not None:
            assert [a.strip() for a in m[2].split(",")] == specs[m[1]], f"{block.where}: arguments of {m[1]}"
