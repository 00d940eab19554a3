"""The loader of astrai's entry-point groups, and the hook plugin manager.

The bottom of core's plugin stack: it imports no subsystem. Each subsystem names its own
group and validator next to its ABC (``astrai.extension.backend.base.ATTENTION_BACKENDS``,
``astrai.sampling.base.SAMPLING``, ``astrai.model.architecture.MODELS``,
``astrai.protocol.PROTOCOLS``; the hook group ``HOOKS`` is this module's) and loads it with
``load_plugins(group, check)``; ``astrai.groups`` lists them all. This is the only module
that imports stevedore. Loading is strict in astrai's way: a plugin that fails to import,
or that does not implement its group's ABC, is not dropped silently; its failure is kept
(with the distribution it came from) so that the caller can raise it when that plugin is
asked for by name, and list it (``astrai plugins``). It never takes the process down otherwise.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pluggy

from astrai import hookspecs
from astrai.errors import PluginError

logger = logging.getLogger(__name__)

HOOKS = "astrai.plugins"
"""Hook plugins: modules or objects implementing ``astrai.hookspecs`` hooks."""


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


def distribution_of(group: str, name: str, target: str) -> str:
    """``"<distribution> <version>"`` declaring entry point ``name = target`` in ``group``."""
    for ep in importlib.metadata.entry_points(group=group):
        if ep.name == name and ep.value == target and ep.dist is not None:
            return f"{ep.dist.metadata['Name']} {ep.dist.version}"
    return "an unknown distribution"


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


def check_hook_plugin(name: str, plugin: object, origin: str) -> object:
    """Validate an ``astrai.plugins`` plugin: registering it in a scratch manager must succeed
    and every ``astrai_*`` hook it implements must be one of ``astrai.hookspecs``. Raises PluginError."""
    PluginManager().register_checked(plugin, name, origin)
    return plugin


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

    def keep_failure(_manager: object, ep: importlib.metadata.EntryPoint, err: BaseException) -> None:
        loaded.failures[ep.name] = PluginFailure(group, ep.name, ep.value, distribution_of(group, ep.name, ep.value), err)

    # stevedore caches entry-point lists per namespace for the whole process;
    # drop ours so that a deliberate re-discovery sees newly installed plugins.
    ExtensionManager.ENTRY_POINT_CACHE.pop(group, None)
    manager = ExtensionManager(group, invoke_on_load=False, on_load_failure_callback=keep_failure)
    for ext in manager.extensions:
        target = ext.entry_point.value
        dist = distribution_of(group, ext.name, target)
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


class PluginManager(pluggy.PluginManager):
    """astrai's hook registry: the hooks of ``astrai.hookspecs`` and the plugins implementing them.

    Made by a factory, never at import time: ``PluginManager.discover()`` loads the
    ``astrai.plugins`` entry points; tests build one from in-memory objects with
    ``PluginManager(plugins)``. Call hooks with :meth:`notify`, which isolates failures.
    """

    def __init__(self, plugins: tuple[object, ...] | list[object] = ()) -> None:
        super().__init__("astrai")
        self.add_hookspecs(hookspecs)
        self.failures: dict[str, PluginFailure] = {}
        for plugin in plugins:
            self.register_checked(plugin, None, repr(plugin))

    @classmethod
    def discover(cls) -> PluginManager:
        """A manager holding every loadable ``astrai.plugins`` entry point; failures are kept
        in ``failures`` and logged as warnings."""
        pm = cls()
        loaded = load_plugins(HOOKS, check_hook_plugin)
        pm.failures = dict(loaded.failures)
        for name, plugin in loaded.classes.items():
            try:  # validated already; this still refuses one object declared under two names
                pm.register_checked(plugin, name, name)
            except PluginError as err:
                target = next(ep.value for ep in importlib.metadata.entry_points(group=HOOKS) if ep.name == name)
                pm.failures[name] = PluginFailure(HOOKS, name, target, distribution_of(HOOKS, name, target), err)
        for failure in pm.failures.values():
            logger.warning("hook plugin skipped: %s", failure.describe())
        return pm

    def register_checked(self, plugin: object, name: str | None, origin: str) -> None:
        """Register ``plugin``; raise PluginError when pluggy refuses it or it implements
        an ``astrai_*`` hook that does not exist (a typo would never be called)."""
        name = name or getattr(plugin, "__name__", None) or f"{type(plugin).__qualname__}-{id(plugin):x}"
        try:
            self.register(plugin, name=name)
        except (ValueError, pluggy.PluginValidationError) as err:
            raise PluginError(f"{origin}: {err}") from err
        unknown = sorted(c.name for c in self.get_hookcallers(plugin) or [] if c.spec is None)
        if unknown:
            self.unregister(plugin)
            raise PluginError(f"{origin}: unknown hook {unknown[0]!r} (see astrai.hookspecs)")

    def parse_hookimpl_opts(self, plugin: object, name: str) -> Any:
        """As pytest does: an ``astrai_*`` function is a hook implementation even without
        ``@astrai.hookimpl`` (forgetting the marker must not silently disable a hook)."""
        opts = super().parse_hookimpl_opts(plugin, name)
        if opts is None and name.startswith("astrai_") and inspect.isroutine(getattr(plugin, name, None)):
            opts = {}
        return opts

    def has_impls(self, hook: str) -> bool:
        """Whether any plugin implements ``hook`` (callers skip building arguments otherwise)."""
        return bool(getattr(self.hook, hook).get_hookimpls())

    def notify(self, hook: str, **kwargs: Any) -> None:
        """Call every implementation of ``hook`` (last registered first, as pluggy does).

        One that raises is logged with its plugin's name and the rest still run; never raises.
        """
        for impl in reversed(getattr(self.hook, hook).get_hookimpls()):
            try:
                impl.function(*[kwargs[arg] for arg in impl.argnames])
            except Exception:
                logger.exception("hook %s of plugin %r failed", hook, impl.plugin_name)


class HookThread:
    """Calls hooks of ``pm`` on a daemon thread of its own, in the order they were posted.

    For notifications from a thread that must never wait on a plugin (the scheduler's):
    :meth:`post` only queues. :meth:`close` lets the queued calls run, then ends the thread.
    """

    def __init__(self, pm: PluginManager, name: str = "astrai-hooks") -> None:
        self.pm = pm
        self._queue: queue.SimpleQueue[tuple[str, dict[str, Any]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def post(self, hook: str, **kwargs: Any) -> None:
        """Queue ``pm.notify(hook, **kwargs)``; returns at once, never raises."""
        self._queue.put((hook, kwargs))

    def close(self) -> None:
        """Run what is queued, then stop the thread (idempotent; call once no one posts)."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            self.pm.notify(item[0], **item[1])

