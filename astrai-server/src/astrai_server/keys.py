"""API keys: which keys are accepted, who sends a request (``caller``), and the key file.

``key_ring(settings)`` reads the keys once at start (``app.state.keys``, set by ``edge.install``):
the ``api_key`` list, the lines of ``api_key_file`` and the operator keys of ``admin_api_key``.
``caller(request)`` checks a request's key and says who calls: its tenant (a digest of the key,
never the key: the prefix cache's namespaces hold it) and whether it is an operator (``/stats``,
``/metrics``); ``authorized(request)`` is whether any key matched.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from astrai_server.config import ServerSettings, check_key
from astrai_server.errors import ConfigError

__all__ = [
    "OPEN",
    "Caller",
    "KeyRing",
    "api_keys",
    "authorized",
    "caller",
    "key_matches",
    "key_ring",
    "read_key_file",
]


def api_keys(settings: ServerSettings) -> tuple[bytes, ...] | None:
    """Every accepted key as UTF-8 (``api_key``, ``api_key_file``'s, then ``admin_api_key``), None when
    there is none."""
    keys = list(settings.api_key or [])
    if settings.api_key_file is not None:
        keys += read_key_file(settings.api_key_file)
    keys += settings.admin_api_key or []
    return tuple(dict.fromkeys(k.encode("utf-8") for k in keys)) or None


@dataclass(frozen=True)
class KeyRing:
    """The accepted keys (UTF-8), and per key whether it is an operator's and its tenant id."""

    keys: tuple[bytes, ...]
    admin: tuple[bool, ...]
    tenants: tuple[str, ...]  # a digest of the key: what the prefix cache's namespaces and logs may hold


@dataclass(frozen=True)
class Caller:
    """Who sent a request that passed the key check."""

    tenant: str | None  # the tenant id of its key; None when no key is configured (one tenant)
    admin: bool  # an operator key (``admin_api_key``), or no key configured at all


#: The caller when no key is configured: everyone is the one tenant, and an operator.
OPEN = Caller(None, True)


def key_ring(settings: ServerSettings) -> KeyRing | None:
    """The keys of ``settings`` (``api_keys``), None when there is none. Raises ConfigError for an
    unreadable ``api_key_file``."""
    keys = api_keys(settings)
    if keys is None:
        return None
    admin = {k.encode("utf-8") for k in settings.admin_api_key or ()}
    tenants = tuple(hashlib.sha256(b"astrai-tenant\0" + k).hexdigest()[:16] for k in keys)
    return KeyRing(keys, tuple(k in admin for k in keys), tenants)


def read_key_file(path: str | Path) -> list[str]:
    """The keys of a file, one a line; blank lines and lines starting with ``#`` are skipped, blanks
    around a key dropped. Raises ConfigError (naming the line, never the key) for a bad one."""
    where = f"--api-key-file {path}"
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{where}: cannot read it: {e}") from None
    keys = []
    for number, line in enumerate(lines, 1):
        key = line.strip()
        if key and not key.startswith("#"):
            try:
                keys.append(check_key(key))
            except ValueError as e:
                raise ConfigError(f"{where}, line {number}: {e}") from None
    if not keys:
        raise ConfigError(
            f"{where}: the file holds no key (only blank lines and # comments); "
            "leave the setting unset to serve without a key"
        )
    return keys


def key_index(given: bytes, keys: Sequence[bytes]) -> int:
    """The index of ``given`` in ``keys`` (-1: none): each compared in constant time, all of them always."""
    found = -1
    for i, key in enumerate(keys):
        if hmac.compare_digest(given, key):
            found = i
    return found


def key_matches(given: bytes, keys: Sequence[bytes]) -> bool:
    """Whether ``given`` is one of ``keys`` (``key_index``)."""
    return key_index(given, keys) >= 0


def caller(request: Any) -> Caller | None:
    """Who calls (``OPEN`` when no key is configured); None when a key is required and the request's
    ``Authorization: Bearer <key>`` / ``x-api-key: <key>`` matches none.

    Compared in constant time as bytes: the header's bytes as the client sent them (Starlette
    decodes them as latin-1, which encoding back undoes) against each key's UTF-8, so a non-ASCII
    key matches a client that sends it in UTF-8."""
    ring: KeyRing | None = request.app.state.keys
    if ring is None:
        return OPEN
    auth = request.headers.get("authorization", "")
    # only HTTP's own blanks: str.strip() would also eat latin-1 0x85 and 0xA0, the last byte of "à" in UTF-8
    given = auth[7:].strip(" \t") if auth[:7].lower() == "bearer " else request.headers.get("x-api-key", "")
    i = key_index(given.encode("latin-1"), ring.keys)
    return None if i < 0 else Caller(ring.tenants[i], ring.admin[i])


def authorized(request: Any) -> bool:
    """No key configured, or the request's key matches one (see ``caller``)."""
    return caller(request) is not None
