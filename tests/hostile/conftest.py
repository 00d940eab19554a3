"""Fixtures of the hostile-client tests (issue 16): real ``astrai serve`` subprocesses on loopback ports.

``start_server`` (tests/conftest.py) starts servers (see tests/serving.py); ``server`` is one
default server (info logging) shared by the modules of this directory that take it
(``shared_server``; test_transport.py, whose timings and memory are measured, has its own): each
test reads the log from its own starting point and asserts no absolute counter.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from serving import Served, SharedServers

HERE = Path(__file__).parent
_shared: list[SharedServers] = []  # the session's, for the hook below


@pytest.fixture(scope="session")
def shared_server(
    tmp_path_factory: pytest.TempPathFactory, default_model_path: object
) -> Iterator[Callable[..., Served]]:
    """``get(*flags) -> Served``: one healthy ``astrai serve`` per distinct flags, shared by the
    modules of this directory (tests/serving.py: SharedServers); stopped as soon as the next test
    is outside this directory (``pytest_runtest_teardown``), so that no idle model outlives it."""
    servers = SharedServers(tmp_path_factory)
    _shared.append(servers)
    yield servers.get
    _shared.remove(servers)
    servers.close()


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """After the last test of this directory (in the run's order): stop the shared servers (a later
    test here would start them again)."""
    if nextitem is None or HERE not in Path(nextitem.path).parents:
        for servers in _shared:
            servers.close()


@pytest.fixture(scope="module")
def server(shared_server: Callable[..., Served]) -> Served:
    """One default ``astrai serve`` (info logging), shared by the hostile modules that take it."""
    return shared_server("--log-level", "info")
