"""Fixtures of the hostile-client tests (issue 16): real ``astrai serve`` subprocesses on loopback ports.

``start_server`` (tests/conftest.py) starts servers (see tests/serving.py); ``server`` is one
shared default server for the module.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from serving import Served


@pytest.fixture(scope="module")
def server(start_server: Callable[..., Served]) -> Served:
    """One default ``astrai serve`` (info logging) shared by a test module."""
    return start_server("--log-level", "info")
