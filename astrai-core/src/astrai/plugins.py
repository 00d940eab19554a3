"""Entry-point groups of astrai, the loader that reads them, and the hook plugin manager.

This is the only module that spells a group name, and the only one that
imports stevedore. One loader serves every group (``load_plugins``); each group
has its validator (``VALIDATORS``), run when a plugin loads. Loading is strict
in astrai's way: a plugin that fails to import, or that does not implement its
group's ABC, is not dropped silently; its failure is kept (with the distribution
it came from) so that the caller can raise it when that plugin is asked for by
name, and list it (``astrai plugins``). It never takes the process down otherwise.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pluggy

from astrai import hookspecs
from astrai.errors import PluginError

if TYPE_CHECKING:
    from astrai.extension.backend.base import AttentionBackend
    from astrai.model.architecture import Architecture
    from astrai.protocol import ResponseBuilder
    from astrai.sampling.base import SamplingStrategy

logger = logging.getLogger(__name__)

ATTENTION_BACKENDS = "astrai.attention_backends"
"""``AttentionBackend`` subclasses; the name is what ``ASTR_BACKEND`` takes."""
PROTOCOLS = "astrai.protocols"
"""``astrai.protocol.ResponseBuilder`` subclasses mounted by astrai-server."""
SAMPLING = "astrai.sampling"
"""``astrai.sampling.SamplingStrategy`` subclasses; the name selects one per request."""
MODELS = "astrai.models"
"""``astrai.model.architecture.Architecture`` objects; the name is the architecture's."""
HOOKS = "astrai.plugins"
"""Hook plugins: modules or objects implementing ``astrai.hookspecs`` hooks."""
GROUPS = (ATTENTION_BACKENDS, PROTOCOLS, SAMPLING, MODELS, HOOKS)


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


def _check_class(abc: type, name: str, plugin: object, origin: str) -> type:
    if not (isinstance(plugin, type) and issubclass(plugin, abc)):
        raise PluginError(f"{origin}: {plugin!r} is not a subclass of {abc.__module__}.{abc.__qualname__}")
    if getattr(plugin, "name", None) != name:
        raise PluginError(
            f"{origin}: {plugin.__qualname__}.name is {getattr(plugin, 'name', None)!r} but its entry point "
            f"is {name!r}; they must match"
        )
    return plugin


def check_backend_class(name: str, plugin: object, origin: str) -> type[AttentionBackend]:
    """Validate an ``astrai.attention_backends`` plugin: an ``AttentionBackend`` named ``name``.

    ``origin`` names the entry point and distribution for the message. Raises PluginError.
    """
    from astrai.extension.backend.base import AttentionBackend  # lazy: avoids an import cycle

    return _check_class(AttentionBackend, name, plugin, origin)


def check_builder_class(name: str, plugin: object, origin: str) -> type[ResponseBuilder]:
    """Validate an ``astrai.protocols`` plugin: a ``ResponseBuilder`` named ``name`` whose
    ``route`` starts with "/" and whose ``request_model`` is a pydantic model. Raises PluginError."""
    from pydantic import BaseModel

    from astrai.protocol import ResponseBuilder

    cls = _check_class(ResponseBuilder, name, plugin, origin)
    route = getattr(cls, "route", None)
    if not (isinstance(route, str) and route.startswith("/")):
        raise PluginError(f"{origin}: {cls.__qualname__}.route must be a path starting with '/', got {route!r}")
    model = getattr(cls, "request_model", None)
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        raise PluginError(f"{origin}: {cls.__qualname__}.request_model must be a pydantic BaseModel subclass")
    return cls


def check_strategy_class(name: str, plugin: object, origin: str) -> type[SamplingStrategy]:
    """Validate an ``astrai.sampling`` plugin: a ``SamplingStrategy`` named ``name``. Raises PluginError."""
    from astrai.sampling.base import SamplingStrategy

    return _check_class(SamplingStrategy, name, plugin, origin)


def check_architecture(name: str, plugin: object, origin: str) -> Architecture:
    """Validate an ``astrai.models`` plugin: an ``Architecture`` named ``name``. Raises PluginError."""
    from astrai.model.architecture import Architecture

    if not isinstance(plugin, Architecture):
        raise PluginError(f"{origin}: {plugin!r} is not an astrai.model.architecture.Architecture")
    if plugin.name != name:
        raise PluginError(f"{origin}: architecture is named {plugin.name!r} but its entry point is {name!r}")
    return plugin


def check_hook_plugin(name: str, plugin: object, origin: str) -> object:
    """Validate an ``astrai.plugins`` plugin: registering it in a scratch manager must succeed
    and every ``astrai_*`` hook it implements must be one of ``astrai.hookspecs``. Raises PluginError."""
    PluginManager().register_checked(plugin, name, origin)
    return plugin


#: Validator of each group: ``check(entry-point name, loaded object, origin) -> object``.
VALIDATORS: dict[str, Callable[[str, object, str], Any]] = {
    ATTENTION_BACKENDS: check_backend_class,
    PROTOCOLS: check_builder_class,
    SAMPLING: check_strategy_class,
    MODELS: check_architecture,
    HOOKS: check_hook_plugin,
}


def load_plugins(group: str) -> LoadedPlugins:
    """Import every entry point of ``group`` on the current ``sys.path`` and validate it.

    Never raises for a bad plugin: import errors and validation errors
    (``VALIDATORS[group]``) end up in ``failures``; a name declared twice keeps the
    first. Each call re-reads the entry points (callers cache the result).
    """
    from stevedore import ExtensionManager

    check = VALIDATORS[group]
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


def load_attention_backends() -> LoadedPlugins:
    """``load_plugins(ATTENTION_BACKENDS)``: every installed attention backend class."""
    return load_plugins(ATTENTION_BACKENDS)


def load_protocols() -> LoadedPlugins:
    """``load_plugins(PROTOCOLS)``: every installed ``ResponseBuilder`` class."""
    return load_plugins(PROTOCOLS)


def load_sampling_strategies() -> LoadedPlugins:
    """``load_plugins(SAMPLING)``: every installed sampling strategy class, built-ins included."""
    return load_plugins(SAMPLING)


def load_architectures() -> LoadedPlugins:
    """``load_plugins(MODELS)``: every installed model ``Architecture``."""
    return load_plugins(MODELS)


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
        loaded = load_plugins(HOOKS)
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
