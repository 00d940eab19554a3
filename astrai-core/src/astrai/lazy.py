"""Lazy package attributes: a package's public names imported from their modules on first use.

A package whose ``__init__`` would otherwise import torch (or a subsystem) for names most importers
never touch keeps a table of name -> defining module and takes its module ``__getattr__`` and
``__dir__`` (PEP 562) from ``lazy_attributes``::

    __getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module
from typing import Any


def lazy_attributes(
    package: str, table: dict[str, str], namespace: dict[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``, whose globals are ``namespace``: a name of ``table``
    is imported from its module at its first lookup and kept in ``namespace``, so that later
    lookups do not come here."""

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(table))

    return __getattr__, __dir__
