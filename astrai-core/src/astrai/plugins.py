"""Entry-point groups of astrai, and the loaders that read them.

This is the only module that spells a group name, and the only one that
imports stevedore. Loaders are strict in astrai's way: a plugin that fails to
import, or that does not implement its group's ABC, is not dropped silently;
its failure is kept (with the distribution it came from) so that the caller
can raise it when that plugin is asked for by name, and list it.
"""

from __future__ import annotations

import importlib.metadata
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from astrai.errors import PluginError

if TYPE_CHECKING:
    from astrai.extension.backend.base import AttentionBackend

logger = logging.getLogger(__name__)

ATTENTION_BACKENDS = "astrai.attention_backends"
PROTOCOLS = "astrai.protocols"
SAMPLING = "astrai.sampling"
MODELS = "astrai.models"
HOOKS = "astrai.plugins"


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
    """What a loader found: usable classes by entry-point name, and failures by name."""

    classes: dict[str, type[Any]] = field(default_factory=dict)
    failures: dict[str, PluginFailure] = field(default_factory=dict)


def distribution_of(group: str, name: str, target: str) -> str:
    """``"<distribution> <version>"`` declaring entry point ``name = target`` in ``group``."""
    for ep in importlib.metadata.entry_points(group=group):
        if ep.name == name and ep.value == target and ep.dist is not None:
            return f"{ep.dist.metadata['Name']} {ep.dist.version}"
    return "an unknown distribution"


def check_backend_class(name: str, plugin: object, origin: str) -> type[AttentionBackend]:
    """Validate an ``astrai.attention_backends`` plugin at load time.

    ``origin`` names the entry point and distribution for the message. Returns
    ``plugin`` when it is a subclass of ``AttentionBackend`` whose ``name`` equals
    the entry-point ``name``; raises ``PluginError`` otherwise.
    """
    from astrai.extension.backend.base import AttentionBackend  # lazy: avoids an import cycle

    if not (isinstance(plugin, type) and issubclass(plugin, AttentionBackend)):
        raise PluginError(f"{origin}: {plugin!r} is not a subclass of astrai AttentionBackend")
    if plugin.name != name:
        raise PluginError(
            f"{origin}: {plugin.__qualname__}.name is {plugin.name!r} but its entry point is {name!r}; "
            "they must match"
        )
    return plugin


def load_attention_backends() -> LoadedPlugins:
    """Import every ``astrai.attention_backends`` entry point of the current ``sys.path``.

    Never raises for a bad plugin: import errors and validation errors
    (``check_backend_class``) end up in ``failures``. Each call re-reads the
    entry points (callers cache the result: one discovery per process).
    """
    from stevedore import ExtensionManager

    group = ATTENTION_BACKENDS
    loaded = LoadedPlugins()

    def keep_failure(_manager: object, ep: importlib.metadata.EntryPoint, err: BaseException) -> None:
        loaded.failures[ep.name] = PluginFailure(
            group, ep.name, ep.value, distribution_of(group, ep.name, ep.value), err
        )

    # stevedore caches entry-point lists per namespace for the whole process;
    # drop ours so that a deliberate re-discovery sees newly installed plugins.
    ExtensionManager.ENTRY_POINT_CACHE.pop(group, None)
    manager = ExtensionManager(group, invoke_on_load=False, on_load_failure_callback=keep_failure)
    for ext in manager.extensions:
        target = ext.entry_point.value
        dist = distribution_of(group, ext.name, target)
        try:
            cls = check_backend_class(ext.name, ext.plugin, f"entry point {ext.name!r} = {target} of {dist}")
        except PluginError as err:
            loaded.failures[ext.name] = PluginFailure(group, ext.name, target, dist, err)
            continue
        if ext.name in loaded.classes:
            logger.warning("attention backend %r declared twice; keeping the first", ext.name)
            continue
        loaded.classes[ext.name] = cls
    return loaded
