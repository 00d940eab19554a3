"""Fixtures of the docs tests: the tiny engine of ``tiny_server`` and a client of its app."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from tiny_server import make_tiny_engine, serve, shut_down


@pytest.fixture(scope="module")
def tiny_engine() -> Iterator[Any]:
    """``make_tiny_engine()``, shared by a module's tests; its pool is checked at the end."""
    engine = make_tiny_engine()
    yield engine
    shut_down(engine)


@pytest.fixture(scope="module")
def client(tiny_engine: Any) -> Iterator[Any]:
    """A TestClient of the app over ``tiny_engine``; the server requires ``tiny_server.API_KEY``."""
    with serve(tiny_engine) as c:
        yield c
