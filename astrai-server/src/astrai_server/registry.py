"""Which protocols to mount: the installed ``astrai.protocols`` builders, selected strictly.

Loading and load-time validation are astrai-core's (``astrai.protocol.load_protocols``,
``check_builder_class``: a ``ResponseBuilder`` subclass, ``name`` equal to its
entry-point name, a route starting with "/", a pydantic request model). A broken
plugin is logged and skipped, unless it was asked for by name: then its error is raised.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from astrai.errors import PluginError
from astrai.plugins import LoadedPlugins
from astrai.protocol import ResponseBuilder, check_builder_class, load_protocols

__all__ = ["check_builder_class", "load_protocols", "select_builders"]

logger = logging.getLogger(__name__)


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
                failure = loaded.failures[name]
                raise failure.as_error() from failure.error
            if name not in loaded.classes:
                installed = ", ".join(sorted(loaded.classes)) or "none"
                raise PluginError(
                    f"protocol {name!r} not found; misspelled or not installed? Installed: {installed}"
                )
    builders = [loaded.classes[name](model_name) for name in chosen]
    routes: dict[str, str] = {}
    for b in builders:
        for path in (b.route, *b.get_routes()):
            if path in routes:
                raise PluginError(f"protocols {routes[path]!r} and {b.name!r} both claim route {path}")
            routes[path] = b.name
    return builders
