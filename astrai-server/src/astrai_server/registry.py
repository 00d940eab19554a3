"""Protocol discovery: the ``astrai.protocols`` entry-point group, loaded with stevedore.

Every installed builder is validated when it loads (a ``ResponseBuilder``
subclass, ``name`` equal to its entry-point name, a route starting with "/",
a pydantic request model). A broken plugin is logged and skipped, unless it
was asked for by name: then its error is raised.

(Kept here until ``astrai.plugins`` grows a protocol loader; it reuses that
module's group name and failure records.)
"""

from __future__ import annotations

import importlib.metadata
import logging
from collections.abc import Sequence

from pydantic import BaseModel

from astrai.errors import PluginError
from astrai.plugins import PROTOCOLS, LoadedPlugins, PluginFailure, distribution_of
from astrai.protocol import ResponseBuilder

logger = logging.getLogger(__name__)


def check_builder_class(name: str, plugin: object, origin: str) -> type[ResponseBuilder]:
    """Return ``plugin`` if it is a valid builder for entry point ``name``; raise PluginError otherwise."""
    if not (isinstance(plugin, type) and issubclass(plugin, ResponseBuilder)):
        raise PluginError(f"{origin}: {plugin!r} is not a subclass of astrai.protocol.ResponseBuilder")
    if getattr(plugin, "name", None) != name:
        raise PluginError(f"{origin}: {plugin.__qualname__}.name is {getattr(plugin, 'name', None)!r}, not {name!r}")
    route = getattr(plugin, "route", None)
    if not (isinstance(route, str) and route.startswith("/")):
        raise PluginError(f"{origin}: {plugin.__qualname__}.route must be a path starting with '/', got {route!r}")
    model = getattr(plugin, "request_model", None)
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        raise PluginError(f"{origin}: {plugin.__qualname__}.request_model must be a pydantic BaseModel subclass")
    return plugin


def load_protocols() -> LoadedPlugins:
    """Import every ``astrai.protocols`` entry point; failures are kept, never raised."""
    from stevedore import ExtensionManager

    loaded = LoadedPlugins()

    def keep_failure(_manager: object, ep: importlib.metadata.EntryPoint, err: BaseException) -> None:
        dist = distribution_of(PROTOCOLS, ep.name, ep.value)
        loaded.failures[ep.name] = PluginFailure(PROTOCOLS, ep.name, ep.value, dist, err)

    ExtensionManager.ENTRY_POINT_CACHE.pop(PROTOCOLS, None)  # see newly installed plugins
    manager = ExtensionManager(PROTOCOLS, invoke_on_load=False, on_load_failure_callback=keep_failure)
    for ext in manager.extensions:
        target = ext.entry_point.value
        dist = distribution_of(PROTOCOLS, ext.name, target)
        try:
            cls = check_builder_class(ext.name, ext.plugin, f"entry point {ext.name!r} = {target} of {dist}")
        except PluginError as err:
            loaded.failures[ext.name] = PluginFailure(PROTOCOLS, ext.name, target, dist, err)
            continue
        loaded.classes.setdefault(ext.name, cls)
    return loaded


def select_builders(
    loaded: LoadedPlugins, names: Sequence[str] | None, model_name: str
) -> list[ResponseBuilder]:
    """Instantiate the builders to mount: ``names`` strictly, or every one that loaded.

    Raises PluginError for a requested name that failed or is not installed, and
    for two builders claiming the same route.
    """
    if names is None:
        for failure in loaded.failures.values():
            logger.warning("protocol skipped: %s", failure.describe())
        chosen = sorted(loaded.classes)
    else:
        chosen = list(names)
        for name in chosen:
            if name in loaded.failures:
                raise loaded.failures[name].as_error()
            if name not in loaded.classes:
                installed = ", ".join(sorted(loaded.classes)) or "none"
                raise PluginError(f"protocol {name!r} not found; misspelled or not installed? Installed: {installed}")
    builders = [loaded.classes[name](model_name) for name in chosen]
    routes: dict[str, str] = {}
    for b in builders:
        if b.route in routes:
            raise PluginError(f"protocols {routes[b.route]!r} and {b.name!r} both claim route {b.route}")
        routes[b.route] = b.name
    return builders
