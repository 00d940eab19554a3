"""The import graph of the distributions, read from their sources: acyclic between and inside them.

Every ``import`` counts, at module level or inside a function (a lazy import still ties two
modules together), except those under ``if TYPE_CHECKING:`` (annotations only). A module's
edge goes to the module it names: ``from a.b import c`` is an edge to ``a.b.c`` when that is
a module, else to the package ``a.b``. Implicit imports of parent packages are not edges.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: Distribution -> the folder that holds its top-level package(s).
DISTRIBUTIONS = {
    "astrai-core": ROOT / "astrai-core" / "src",
    "astrai-server": ROOT / "astrai-server" / "src",
    "astrai-backend-cpu": ROOT / "astrai-backend-cpu" / "src",
    "astrai-backend-cuda": ROOT / "astrai-backend-cuda" / "src",
    "astrai-backend-flash": ROOT / "astrai-backend-flash" / "src",
    "astrai-ollama": ROOT / "examples" / "astrai-ollama" / "src",
    "astrai-typical-p": ROOT / "examples" / "astrai-typical-p" / "src",
    "astrai-request-log": ROOT / "examples" / "astrai-request-log" / "src",
}


def _modules(src: Path) -> dict[str, Path]:
    out = {}
    for path in sorted(src.rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = {name: path for src in DISTRIBUTIONS.values() for name, path in _modules(src).items()}
OWNER = {name: dist for dist, src in DISTRIBUTIONS.items() for name in _modules(src)}


def _runtime_imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement, skipping the bodies of ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and ast.unparse(child.test) in (
                "TYPE_CHECKING",
                "typing.TYPE_CHECKING",
            ):
                stack.extend(child.orelse)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child
            stack.append(child)


def imports_of(module: str) -> set[str]:
    """The modules of these distributions that ``module`` imports."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in _runtime_imports(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                base = ".".join(
                    [*package.split(".")[: len(package.split(".")) - node.level + 1], base]
                ).strip(".")
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        for name in names:
            while name and name not in MODULES:  # `import a.b.c` of a function or attribute: its module
                name = name.rpartition(".")[0]
            if name and name != module:
                out.add(name)
    return out


GRAPH = {module: imports_of(module) for module in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


@pytest.mark.parametrize("dist", list(DISTRIBUTIONS))
def test_modules_of_a_distribution_import_one_another_without_a_cycle(dist: str) -> None:
    inside = {m: {n for n in deps if OWNER[n] == dist} for m, deps in GRAPH.items() if OWNER[m] == dist}
    assert inside, f"no modules found for {dist}"
    assert _cycles(inside) == []


def test_distributions_import_one_another_without_a_cycle() -> None:
    between: dict[str, set[str]] = {}
    for module, deps in GRAPH.items():
        between.setdefault(OWNER[module], set()).update(OWNER[n] for n in deps if OWNER[n] != OWNER[module])
    assert _cycles(between) == []
    assert between["astrai-core"] == set(), "astrai-core imports another distribution"


def test_the_plugin_loader_imports_nothing_above_it() -> None:
    """``astrai.plugins`` sits under every subsystem: they import it, it imports none of them."""
    assert GRAPH["astrai.plugins"] <= {"astrai.errors", "astrai.hookspecs"}


def test_the_checker_sees_cycles_and_lazy_imports() -> None:
    """The test's own reading: a lazy import is an edge, a TYPE_CHECKING one is not, cycles are found."""
    assert "astrai.groups" in GRAPH["astrai.cli"]  # imported inside plugin_rows()
    assert "astrai.engine" not in GRAPH["astrai.hookspecs"]  # annotations only
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


BACKENDS = ("astrai-backend-cpu", "astrai-backend-cuda", "astrai-backend-flash")
PLUGIN_API = "astrai.extension.api"


def _named_modules(module: str, *, type_checking: bool) -> Iterator[tuple[int, str]]:
    """``(line, module named)`` of every import statement of ``module`` (also those under
    ``if TYPE_CHECKING:`` when ``type_checking``); a from-import names the module it is from."""
    tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
    nodes = ast.walk(tree) if type_checking else _runtime_imports(tree)
    for node in nodes:
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            yield node.lineno, node.module or ""


@pytest.mark.parametrize("dist", BACKENDS)
def test_a_backend_imports_astrai_through_its_plugin_api_alone(dist: str) -> None:
    """The backend distributions name one module of astrai-core, annotations included."""
    core = {m for m, owner in OWNER.items() if owner == "astrai-core"}
    found = [
        f"{module}:{line} {name}"
        for module, owner in OWNER.items()
        if owner == dist
        for line, name in _named_modules(module, type_checking=True)
        if (name in core or name.startswith("astrai.")) and name != PLUGIN_API
    ]
    assert found == []


def _reaches(start: str, goal: str) -> bool:
    seen, todo = set(), [start]
    while todo:
        module = todo.pop()
        if module == goal:
            return True
        if module not in seen:
            seen.add(module)
            todo.extend(GRAPH.get(module, ()))
    return False


def test_no_module_imports_a_package_that_imports_it() -> None:
    """``from pkg import x`` inside ``pkg`` runs while ``pkg/__init__`` may still be importing the
    module (the reading above counts it as an edge to ``pkg.x``): a hidden circle when that
    ``__init__`` reaches the module."""
    found = [
        f"{module}:{line} from {name}"
        for module in MODULES
        for line, name in _named_modules(module, type_checking=False)
        if name != module and module.startswith(name + ".") and name in MODULES and _reaches(name, module)
    ]
    assert found == []


def _every_import(module: str) -> set[str]:
    """The modules of these distributions that ``module`` names in any import statement, those under
    ``if TYPE_CHECKING:`` included (an annotation ties two modules together for a reader too)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    [*package.split(".")[: len(package.split(".")) - node.level + 1], base]
                ).strip(".")
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name and name != module:
                out.add(name)
    return out


CORE = {m for m, owner in OWNER.items() if owner == "astrai-core"}
#: Core's floors, bottom first: a module imports (annotations included) only from its own floor or
#: below. The bottom holds what has no dependency in astrai; the contracts are plain data that
#: plugins, protocols and the step share (no torch: tests/test_contracts.py); the subsystems each
#: have one idea; the engine's parts drive them; the top is what a user calls.
FLOORS: list[tuple[str, set[str]]] = [
    (
        "bottom",
        {
            "astrai.errors",
            "astrai.lazy",
            "astrai.malloc",
            "astrai.cpu_tuning",
            "astrai.hookspecs",
            "astrai.chat_prompt",
        },
    ),
    (
        "contracts",
        {
            "astrai.plugins",
            "astrai.logprobs",
            "astrai.limits",
            "astrai.extension.backend.selection",
            "astrai.grammar.base",
            "astrai.sampling.params",
            "astrai.thinking",  # ThinkingFormat: a field of SamplingParams; its state imports nothing
            "astrai.step",
            "astrai.config",
            "astrai.protocol",
        },
    ),
    ("subsystems", set()),  # every module not named on another floor
    (
        "engine parts",
        {
            "astrai.request",
            "astrai.result",
            "astrai.batching",
            "astrai.runner",
            "astrai.scheduler",
            "astrai.groups",
        },
    ),
    (
        "top",
        {
            "astrai",
            "astrai.engine",
            "astrai.cli",
            # pooling models: a decoder's runs on an InferenceEngine (astrai.embedding.decoder)
            "astrai.embedding",
            "astrai.embedding.loader",
            "astrai.embedding.decoder",
            "astrai.embedding.gguf",
        },
    ),
]


def _floor(module: str) -> int:
    named = [i for i, (_, members) in enumerate(FLOORS) if module in members]
    return named[0] if named else 2


def test_core_has_no_import_circle_even_counting_annotations() -> None:
    graph = {m: {n for n in _every_import(m) if n in CORE} for m in CORE}
    assert _cycles(graph) == []


def test_core_imports_only_its_own_floor_or_below() -> None:
    found = [
        f"{module} ({FLOORS[_floor(module)][0]}) imports {name} ({FLOORS[_floor(name)][0]})"
        for module in sorted(CORE)
        for name in sorted(_every_import(module) & CORE)
        if _floor(name) > _floor(module) and not module.startswith(name + ".")
    ]
    assert found == []
    assert all(m in CORE for _, members in FLOORS for m in members), (
        "a floor names a module that is not there"
    )
