"""The processes of ``astrai serve --data-parallel-size M``, which ``astrai_server.replicas`` starts.

``python -m astrai_server.child replica``: one engine replica, a whole ``astrai serve`` (``cli.serve``)
on the ``ServerSettings`` that arrive as JSON on stdin. ``python -m astrai_server.child gateway``: the
SGLang Model Gateway (``smg.launch_router``, as ``smg launch`` runs it) on the arguments that arrive as
a JSON list on stdin. Stdin and not the command line, because both carry the API keys, which ``ps``
shows to every user of the machine.

Each child asks Linux to send it SIGTERM when the supervisor dies (``PR_SET_PDEATHSIG``), so that a
supervisor killed outright leaves no replica behind; the replicas run in their own session (a Ctrl-C
in the terminal reaches the supervisor alone, which then stops them in order).
"""

from __future__ import annotations

import json
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _die_with_parent(parent: int) -> None:
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: a killed supervisor may leave its children running
        return
    if os.getppid() != parent:  # the supervisor died before the request was made
        os.kill(os.getpid(), signal.SIGTERM)


def replica() -> int:
    """One replica: 0 on a clean stop, 1 when the model fails to load, 2 on a configuration or plugin
    error (as ``astrai serve``)."""
    from astrai.errors import AstraiError
    from astrai_server.cli import configure_logging, serve
    from astrai_server.config import ServerSettings
    from astrai_server.errors import ModelLoadFailed

    settings = ServerSettings.model_validate_json(sys.stdin.buffer.read())
    try:
        configure_logging(settings)
        serve(settings)
    except AstraiError as exc:
        sys.stderr.write(f"astrai serve (replica on port {settings.port}): error: {exc}\n")
        return 1 if isinstance(exc, ModelLoadFailed) else 2
    except KeyboardInterrupt:
        return 130
    return 0


def gateway() -> int:
    """The gateway, until a signal stops it (it drains on SIGTERM); 1 when it cannot start."""
    from smg.launch_router import launch_router, parse_router_args

    try:
        launch_router(parse_router_args(json.loads(sys.stdin.read())))
    except Exception as exc:  # smg has logged it
        sys.stderr.write(f"astrai serve (gateway): error: {exc}\n")
        return 1
    return 0


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("replica", "gateway"):
        sys.stderr.write("usage: python -m astrai_server.child {replica|gateway} SUPERVISOR_PID < settings\n")
        return 2
    _die_with_parent(int(argv[1]))
    return replica() if argv[0] == "replica" else gateway()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
