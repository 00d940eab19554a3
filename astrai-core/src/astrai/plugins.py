"""The loader of astrai's entry-point groups: the bottom floor of core's plugin stack.

It imports no subsystem (nor ``astrai.hookspecs``: the hook manager is ``astrai.hooks``, a floor
above). Each subsystem names its own group and validator next to its ABC
(``astrai.extension.backend.base.ATTENTION_BACKENDS``, ``astrai.sampling.base.SAMPLING``,
``astrai.model.architecture.MODELS``, ``astrai.protocol.PROTOCOLS``, ``astrai.hooks.HOOKS``) and
loads it with ``load_plugins(group, check)``; ``astrai.groups`` lists them all. This is the only
module that imports stevedore. Loading is strict in astrai's way: a plugin that fails to import,
or that does not implement its group's ABC, is not dropped silently; its failure is kept
(with the distribution it came from) so that the caller can raise it when that plugin is
asked for by name, and list it (``astrai plugins``). It never takes the process down otherwise.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from astrai.errors import PluginError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PluginFailure:
    """A plugin of ``group`` that could not be used: import error or failed validation."""

    group: str
    name: str  # entry-point name
    target: str  # "module:attr"
    distribution: str  # "name version" of the distribution declaring it
    error: BaseException

    def describe(self) -> str:
        """One line naming the entry point, its distribution and the error."""
        return (
            f"entry point {self.name!r} = {self.target} of {self.distribution} "
            f"(group {self.group}) failed to load: {type(self.error).__name__}: {self.error}"
        )

    def as_error(self) -> PluginError:
        """The failure as a ``PluginError`` to raise (chain ``from self.error``)."""
        if isinstance(self.error, PluginError):
            return self.error
        return PluginError(self.describe())


@dataclass
class LoadedPlugins:
    """What a loader found: usable plugins by entry-point name, and failures by name.

    ``classes`` holds what each entry point loaded (a class for backends, protocols
    and sampling; an ``Architecture`` for models; a module for hooks).
    """

    classes: dict[str, Any] = field(default_factory=dict)
    failures: dict[str, PluginFailure] = field(default_factory=dict)


def _distributions(group: str) -> dict[tuple[str, str], str]:
    """``(name, target) -> "<distribution> <version>"`` of every entry point of ``group`` (the first
    declaring it): one scan of the installed distributions, which takes tens of milliseconds."""
    found: dict[tuple[str, str], str] = {}
    for ep in importlib.metadata.entry_points(group=group):
        if ep.dist is not None:
            found.setdefault((ep.name, ep.value), f"{ep.dist.metadata['Name']} {ep.dist.version}")
    return found


def distribution_of(group: str, name: str, target: str) -> str:
    """``"<distribution> <version>"`` declaring entry point ``name = target`` in ``group``."""
    return _distributions(group).get((name, target), "an unknown distribution")


def check_class(abc: type, name: str, plugin: object, origin: str) -> type:
    """A validator's common part: ``plugin`` is a subclass of ``abc`` whose ``name`` is its entry
    point's. ``origin`` names the entry point and distribution for the message. Raises PluginError."""
    if not (isinstance(plugin, type) and issubclass(plugin, abc)):
        raise PluginError(f"{origin}: {plugin!r} is not a subclass of {abc.__module__}.{abc.__qualname__}")
    if getattr(plugin, "name", None) != name:
        raise PluginError(
            f"{origin}: {plugin.__qualname__}.name is {getattr(plugin, 'name', None)!r} but its entry point "
            f"is {name!r}; they must match"
        )
    return plugin


def installed_state() -> tuple[tuple[str, int | None], ...]:
    """``sys.path`` with each entry's modification time: it changes when a distribution is
    installed, removed or put on the path (its dist-info folder comes or goes), so that a cache
    of what ``load_plugins`` found can key on it and discover again then. A few ``stat`` calls."""
    state = []
    for entry in sys.path:
        try:
            mtime: int | None = os.stat(entry or ".").st_mtime_ns
        except OSError:
            mtime = None
        state.append((entry, mtime))
    return tuple(state)


#: A group's validator: ``check(entry-point name, loaded object, origin) -> object``, raising PluginError.
Validator = Callable[[str, object, str], Any]


def load_plugins(group: str, check: Validator) -> LoadedPlugins:
    """Import every entry point of ``group`` on the current ``sys.path`` and validate it with ``check``.

    Never raises for a bad plugin: import errors and validation errors end up in
    ``failures``; a name declared twice keeps the first. Each call re-reads the entry
    points (callers cache the result).
    """
    from stevedore import ExtensionManager

    loaded = LoadedPlugins()
    dists = _distributions(group)  # once: a scan per plugin made each call cost a second

    def dist_of(name: str, target: str) -> str:
        return dists.get((name, target), "an unknown distribution")

    def keep_failure(_manager: object, ep: importlib.metadata.EntryPoint, err: BaseException) -> None:
        loaded.failures[ep.name] = PluginFailure(group, ep.name, ep.value, dist_of(ep.name, ep.value), err)

    # stevedore caches entry-point lists per namespace for the whole process;
    # drop ours so that a deliberate re-discovery sees newly installed plugins.
    ExtensionManager.ENTRY_POINT_CACHE.pop(group, None)
    manager = ExtensionManager(group, invoke_on_load=False, on_load_failure_callback=keep_failure)
    for ext in manager.extensions:
        target = ext.entry_point.value
        dist = dist_of(ext.name, target)
        try:
            obj = check(ext.name, ext.plugin, f"entry point {ext.name!r} = {target} of {dist}")
        except PluginError as err:
            loaded.failures[ext.name] = PluginFailure(group, ext.name, target, dist, err)
            continue
        if ext.name in loaded.classes:
            logger.warning("%s entry point %r declared twice; keeping the first", group, ext.name)
            continue
        loaded.classes[ext.name] = obj
    return loaded
