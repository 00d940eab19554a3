"""Reading the checked parts of ``docs/*.md``: blocks that follow an HTML comment marker.

A marker is a line ``<!-- kind -->`` or ``<!-- kind: argument -->``; the next non-blank
lines are its block, either a fenced code block (its body) or a pipe table (its rows;
a pipe inside a cell must be inside a code span). The kinds are listed in ``KINDS``; an
unknown kind is an error, so a typo never turns a checked block into an unchecked one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

KINDS = {
    "doctest": "a python block the tests execute (argument: a name; blocks of one page with the same "
    "name share one namespace and run in order)",
    "excerpt": "a code block found verbatim in a repository file (argument: its path from the repository "
    "root); a line '# ...' separates pieces that appear in that order",
    "golden": "a block equal to what tests/docs/goldens.py generates under that name",
    "fields": "a table of a pydantic request model's fields (argument: module:Class)",
    "mapping": "a two-column table equal to a dict (argument: module:NAME)",
    "stats-fields": "the fields of GET /stats",
    "status-map": "astrai_server.errors.STATUS_BY_ERROR, in order",
    "endpoints": "every route astrai-server mounts",
    "entry-point-groups": "astrai.groups.GROUPS and what this repository registers in them",
    "hooks": "the hooks of astrai.hookspecs (a cell 'name(arg, ...)' also gives their arguments)",
    "plugin-groups": "astrai.groups.GROUPS in order, with their constants and validators",
    "dataclass-fields": "a dataclass's fields in order, with their annotations (argument: module:Class)",
    "module-names": (
        "a table of a module's public names (its __all__), each with what it is (argument: module)"
    ),
    "plugins-output": "lines of 'astrai plugins' output, compared with the real command's",
    "serve-options": "every 'astrai serve' flag and ServerSettings field: type, default, range",
    "cli-options": "every option of the 'astrai' command and of its chat, generate and plugins subcommands",
    "serve-yaml": "a serve.yaml that load_settings reads as written (argument: hook-plugin options it "
    "uses, comma-separated)",
    "env-vars": "every ASTR*_ environment variable the distributions' sources name",
}

_MARKER = re.compile(r"^<!--\s*([a-z-]+)(?::\s*(\S+))?\s*-->\s*$")
_LINK = re.compile(r"\[([^\]]+)\]\([^)]+\)")


@dataclass
class Block:
    """One marked block of one page."""

    page: str  # file name, e.g. "http-api.md"
    line: int  # 1-based line of the marker
    kind: str
    argument: str | None
    text: str = ""  # fenced block body (without the fences), ends with a newline
    language: str | None = None  # the fence's info string
    rows: list[list[str]] = field(default_factory=list)  # table rows, header first, cells as written

    @property
    def where(self) -> str:
        return f"docs/{self.page}:{self.line}"

    def records(self) -> list[dict[str, str]]:
        """Table rows below the header as ``{header: plain cell text}``."""
        header = [plain(c) for c in self.rows[0]]
        return [dict(zip(header, (plain(c) for c in row), strict=True)) for row in self.rows[1:]]


def plain(cell: str) -> str:
    """A cell's text without code-span backticks, link targets and surrounding space."""
    return _LINK.sub(r"\1", cell).replace("`", "").strip()


def _split_row(line: str) -> list[str]:
    """A row's cells; a pipe inside a code span belongs to its cell, as Python-Markdown reads it."""
    cells, current, in_code = [], [], False
    for ch in line.strip().removeprefix("|").removesuffix("|"):
        in_code ^= ch == "`"
        if ch == "|" and not in_code:
            cells.append("".join(current).strip())
            current = []
        else:
            current.append(ch)
    return [*cells, "".join(current).strip()]


def _block_after(lines: list[str], i: int, block: Block) -> None:
    while i < len(lines) and not lines[i].strip():
        i += 1
    if i >= len(lines):
        raise ValueError(f"{block.where}: marker {block.kind!r} is followed by nothing")
    if lines[i].startswith("```"):
        block.language = lines[i][3:].strip() or None
        body = []
        i += 1
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        if i == len(lines):
            raise ValueError(f"{block.where}: unclosed code block")
        block.text = "".join(line + "\n" for line in body)
    elif lines[i].startswith("|"):
        while i < len(lines) and lines[i].startswith("|"):
            row = _split_row(lines[i])
            if not all(set(c) <= set("-: ") for c in row):  # skip the |---| delimiter row
                block.rows.append(row)
            i += 1
        if any(len(r) != len(block.rows[0]) for r in block.rows):
            raise ValueError(f"{block.where}: table rows have different numbers of cells")
    else:
        raise ValueError(f"{block.where}: marker {block.kind!r} is not followed by a code block or a table")


def page_blocks(page: Path) -> list[Block]:
    """Every marked block of one page, in order."""
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks = []
    for i, line in enumerate(lines):
        m = _MARKER.match(line)
        if m is None:
            continue
        kind, argument = m.groups()
        if kind not in KINDS:
            raise ValueError(f"docs/{page.name}:{i + 1}: unknown marker {kind!r}; known: {', '.join(KINDS)}")
        block = Block(page.name, i + 1, kind, argument)
        _block_after(lines, i + 1, block)
        blocks.append(block)
    return blocks


def all_blocks(kind: str | None = None) -> list[Block]:
    """Marked blocks of every page under docs/, optionally of one kind."""
    blocks = [b for page in sorted(DOCS.glob("*.md")) for b in page_blocks(page)]
    return [b for b in blocks if kind is None or b.kind == kind]
