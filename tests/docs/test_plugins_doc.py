"""docs/plugins.md against the code: quoted files, the groups table, record fields, ``astrai plugins``."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import subprocess
import sys

import pytest
from docs_pages import ROOT, Block, all_blocks

from astrai import groups

EXCERPTS = all_blocks("excerpt")
ELISION = "# ..."


def _ids(blocks: list[Block]) -> list[str]:
    return [f"{b.page}:{b.line}" for b in blocks]


def test_the_guide_quotes_every_worked_example() -> None:
    quoted = {b.argument for b in EXCERPTS}
    examples = {str(p.relative_to(ROOT)) for p in ROOT.glob("examples/*/src/*.py")}
    examples |= {str(p.relative_to(ROOT)) for p in ROOT.glob("examples/*/pyproject.toml")}
    assert examples <= quoted, f"not quoted in the guide: {sorted(examples - quoted)}"


@pytest.mark.parametrize("block", EXCERPTS, ids=_ids(EXCERPTS))
def test_excerpt_is_verbatim(block: Block) -> None:
    """The block's pieces (split at ``# ...`` lines) appear in the file, in order, each whole lines."""
    path = ROOT / block.argument
    assert path.is_file(), f"{block.where}: no file {block.argument}"
    text = "\n" + path.read_text(encoding="utf-8")
    pieces, current = [], []
    for line in block.text.splitlines(keepends=True):
        if line.strip() == ELISION:
            pieces.append("".join(current))
            current = []
        else:
            current.append(line)
    pieces.append("".join(current))
    at = 0
    for piece in pieces:
        assert piece.strip(), f"{block.where}: an empty piece around '{ELISION}'"
        found = text.find("\n" + piece, at)
        assert found >= 0, f"{block.where}: not in {block.argument} (after what precedes it):\n{piece}"
        at = found + len(piece)


def test_groups_table_is_astrai_groups() -> None:
    (block,) = all_blocks("plugin-groups")
    rows = block.records()
    assert [r["Group"] for r in rows] == list(groups.GROUPS), block.where
    for r in rows:
        module, _, constant = r["Constant"].rpartition(".")
        assert getattr(importlib.import_module(module), constant) == r["Group"], block.where
        check = groups.VALIDATORS[r["Group"]]
        assert r["Validated by"] == check.__name__, f"{block.where}: {r['Group']}"
        assert check.__module__ == module, f"{block.where}: {r['Group']} is validated where it is named"


def test_the_guide_gives_every_hook_with_its_arguments() -> None:
    """The hooks table of plugins.md writes each hook as ``name(arg, ...)`` (test_pages checks them)."""
    (block,) = [b for b in all_blocks("hooks") if b.page == "plugins.md"]
    assert all(r["Hook"].endswith(")") for r in block.records()), block.where


FIELD_TABLES = all_blocks("dataclass-fields")


@pytest.mark.parametrize("block", FIELD_TABLES, ids=_ids(FIELD_TABLES))
def test_dataclass_table_lists_its_fields(block: Block) -> None:
    module, _, name = block.argument.partition(":")
    cls = getattr(importlib.import_module(module), name)
    annotation = lambda f: f.type if isinstance(f.type, str) else f.type.__name__  # noqa: E731
    expected = [(f.name, annotation(f)) for f in dataclasses.fields(cls)]
    assert [(r["Field"], r["Type"]) for r in block.records()] == expected, block.where
    assert all(r["Meaning"] for r in block.records()), f"{block.where}: say what each field means"


MODULE_NAME_TABLES = all_blocks("module-names")


@pytest.mark.parametrize("block", MODULE_NAME_TABLES, ids=_ids(MODULE_NAME_TABLES))
def test_module_table_lists_its_public_names(block: Block) -> None:
    """Every name of the module's ``__all__`` once, none other, each said what it is."""
    module = importlib.import_module(block.argument)
    names = [r["Name"] for r in block.records()]
    assert len(names) == len(set(names)), f"{block.where}: a name listed twice"
    assert sorted(names) == sorted(module.__all__), block.where
    assert all(hasattr(module, n) for n in names), block.where
    assert all(r["What"] for r in block.records()), f"{block.where}: say what each name is"


def _installed(distribution: str) -> bool:
    try:
        importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def test_plugins_output_is_what_the_command_prints() -> None:
    """Lines of installed distributions (and their ``error:`` lines) appear in this order in the
    real output; rows of distributions not installed here are skipped."""
    (block,) = all_blocks("plugins-output")
    done = subprocess.run(
        [sys.executable, "-m", "astrai.cli", "plugins"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    real = [line.split() for line in done.stdout.splitlines()]
    shown = [line.split() for line in block.text.splitlines()]
    assert shown[0] == real[0], f"{block.where}: the header"
    kept, keep = [], True
    for words in shown[1:]:
        if words[0] != "error:":
            keep = _installed(words[2])
        if keep:
            kept.append(words)
    at = 0
    for words in kept:
        assert words in real[at:], f"{block.where}: not printed (in this order): {' '.join(words)}"
        at = real.index(words, at) + 1
