"""The hooks astrai calls: who wants to observe or extend it (pluggy, project name ``"astrai"``).

A hook plugin is a module (or any object) registered in the ``astrai.plugins``
entry-point group, as pytest plugins are in ``pytest11``; it defines functions
named after the hooks below, decorated with :data:`hookimpl` (``astrai.hookimpl``)::

    # pyproject.toml: [project.entry-points."astrai.plugins"]  my_plugin = "my_plugin"
    import astrai

    @astrai.hookimpl
    def astrai_request_finished(engine, request):
        print(request.request_id, request.total_time)

An implementation may take any subset of a hook's arguments, by name. Every hook
is a notification: return values are ignored, and an implementation that raises
is logged with its plugin's name while the others still run; nothing it raises
reaches astrai's caller, the scheduler or the HTTP client.
"""

from __future__ import annotations

from typing import Any

import pluggy

# The arguments are annotated ``Any`` and their types named in the docstrings: this module sits low
# in core (astrai.hooks imports it), so it imports nothing of the engine, not even for annotations.

hookspec = pluggy.HookspecMarker("astrai")
hookimpl = pluggy.HookimplMarker("astrai")
"""Marks a plugin's function as the implementation of the hook of the same name."""


@hookspec
def astrai_add_options(parser: Any) -> None:
    """Add command-line options for the plugin to the ``astrai`` commands that run an engine.

    ``parser`` has argparse's ``add_argument(*flags, **kwargs)``; its options appear
    under "plugin options" in ``astrai serve`` / ``chat`` / ``generate``. Use flags and
    ``dest`` names that start with the plugin's name (``--request-log`` ->
    ``request_log``). Each value reaches ``engine.config.plugin_options[dest]`` (the
    ``default`` given here when the flag is absent); ``astrai serve`` also reads it
    from the YAML ``server:`` section under the ``dest`` name (flags win). Called once
    for each of those commands when the ``astrai`` command builds its parser; engines
    made from Python get ``EngineConfig.plugin_options`` directly.
    """


@hookspec
def astrai_register_commands(subparsers: Any, plugins: Any) -> None:
    """Add subcommands to the ``astrai`` command (astrai-server adds ``serve`` this way).

    ``subparsers`` is the ``astrai`` parser's argparse subparsers action: call
    ``subparsers.add_parser(name, help=...)``, add the command's arguments, and set
    ``parser.set_defaults(run=fn)``; ``astrai`` then returns ``fn(args)`` (an int, the
    exit status) for that command, after its arguments are parsed. ``plugins`` is the
    :class:`astrai.hooks.PluginManager` the command runs with: give it to
    ``astrai.cli.PluginOptions(parser, plugins)`` for the ``astrai_add_options`` options,
    and to the engines the command makes. Called once per parser, whenever the
    ``astrai`` command builds one, so keep it cheap: import what the command needs to
    run inside ``fn``. If it raises (a name that is taken, for one), the failure is
    logged and ``astrai`` works without that plugin's commands.
    """


@hookspec
def astrai_engine_started(engine: Any) -> None:
    """``engine`` (:class:`astrai.engine.InferenceEngine`) runs and is about to reach its creator.

    Called on the thread constructing the engine, once per engine, before any
    request is submitted. ``engine.config`` (with ``plugin_options``) and
    ``engine.model.config`` describe it. Open what the plugin needs per engine here.
    """


@hookspec
def astrai_engine_stopped(engine: Any) -> None:
    """``engine.shutdown()`` stopped the scheduler; every ``astrai_request_finished`` call
    for it has returned. Called once per engine, on the thread that shut it down.
    Close what ``astrai_engine_started`` opened."""


@hookspec
def astrai_request_finished(engine: Any, request: Any) -> None:
    """One request of ``engine`` is over (finished, stopped, aborted or failed).

    ``request`` (:class:`astrai.request.FinishedRequest`) carries its token counts,
    finish reason and timings. Called once per request, in completion order, on
    astrai's hook thread: never the scheduler's, so a slow implementation (I/O)
    delays other hook calls but never a token. The caller may already hold the
    result when this runs.
    """


@hookspec
def astrai_server_app(app: Any, settings: Any) -> None:
    """astrai-server built its FastAPI ``app`` (protocol routes, /health, /stats mounted).

    Add routes (``app.add_api_route``) or middleware (``app.add_middleware``) here.
    ``settings`` is the ``astrai_server.ServerSettings`` in force (plugin option values
    in ``settings.plugin_options``). The engine may not exist yet: read
    ``request.app.state.engine`` when a request arrives. Called once per app, before
    it serves.
    """
