"""The hook manager: who wants to react (pluggy), over the hooks of ``astrai.hookspecs``.

``PluginManager`` registers hook plugins (the ``astrai.plugins`` entry points, ``HOOKS``, loaded by
``astrai.plugins.load_plugins`` and validated by ``check_hook_plugin``) and calls their hooks;
``HookThread`` calls them from a thread of its own for a caller that must never wait on a plugin
(the scheduler). The only importer of ``astrai.hookspecs``; made by factories, never at import time.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import logging
import queue
import threading
from typing import Any

import pluggy

from astrai import hookspecs
from astrai.errors import PluginError
from astrai.plugins import PluginFailure, distribution_of, load_plugins

__all__ = ["HOOKS", "HookThread", "PluginManager", "check_hook_plugin"]

logger = logging.getLogger(__name__)

HOOKS = "astrai.plugins"
"""Hook plugins: modules or objects implementing ``astrai.hookspecs`` hooks."""


def check_hook_plugin(name: str, plugin: object, origin: str) -> object:
    """Validate an ``astrai.plugins`` plugin: registering it in a scratch manager must succeed
    and every ``astrai_*`` hook it implements must be one of ``astrai.hookspecs``. Raises PluginError."""
    PluginManager().register_checked(plugin, name, origin)
    return plugin


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
                target = next(
                    ep.value for ep in importlib.metadata.entry_points(group=HOOKS) if ep.name == name
                )
                pm.failures[name] = PluginFailure(
                    HOOKS, name, target, distribution_of(HOOKS, name, target), err
                )
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
