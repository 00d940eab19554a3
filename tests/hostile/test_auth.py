"""Issue 16, finding 4: the gaps in authentication, against a real ``astrai serve``.

- ``--api-key ""`` silently turned authentication off; an empty or blank key now stops the
  command with exit status 2 and a message that says why.
- With a key set, ``/openapi.json`` (which lists every route) needs it, like every route but
  ``/health``; there are no docs pages.
- Keys are compared as UTF-8 bytes in constant time: a non-ASCII key (this one ends in "à",
  whose UTF-8 ends in the byte 0xA0 that latin-1 reads as a no-break space) works from a client
  that sends it in UTF-8, and only then.
- (Issue 17) Several keys: ``--api-key`` repeated; any of them opens every guarded route, and
  ``/health`` needs none; (issue 29) but ``/stats`` and ``/metrics``, which show every tenant's
  traffic, answer only an operator's key (``--admin-api-key``, none here): 403.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.slow  # the real default model, in a subprocess

KEY = "clé-secrète-à"
SECOND = "second-key"  # the same server's other key
UNAUTHORIZED = "invalid or missing API key (Authorization: Bearer or x-api-key)"
HI = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 1}


@pytest.fixture(scope="module")
def keyed(start_server: Any) -> Any:
    return start_server("--api-key", KEY, "--api-key", SECOND)


def test_an_empty_or_blank_key_stops_the_command(start_server: Any) -> None:
    keys = ["", "   ", "\t"]
    started = [
        start_server("--api-key", key, healthy=False) for key in keys
    ]  # side by side: each stops at once
    for key, served in zip(keys, started, strict=True):
        assert served.proc.wait(120) == 2, served.log()
        assert (
            "astrai serve: error: --api-key: Value error, the API key is empty or only whitespace; "
            f"leave it unset to serve without a key (got {key!r})"
        ) in served.log()


def test_openapi_needs_the_key_and_health_does_not(keyed: Any) -> None:
    r = httpx.get(keyed.url + "/openapi.json", timeout=10)
    assert (r.status_code, r.json()) == (401, {"detail": UNAUTHORIZED})
    r = httpx.get(keyed.url + "/openapi.json", headers={"x-api-key": b"wrong"}, timeout=10)
    assert (r.status_code, r.json()) == (401, {"detail": UNAUTHORIZED})
    for header in ({"authorization": b"Bearer " + KEY.encode()}, {"x-api-key": KEY.encode()}):
        r = httpx.get(keyed.url + "/openapi.json", headers=header, timeout=10)
        assert r.status_code == 200 and "/v1/chat/completions" in r.json()["paths"], r.text
        assert "/openapi.json" not in r.json()["paths"]
        for docs in ("/docs", "/redoc", "/docs/oauth2-redirect"):
            assert httpx.get(keyed.url + docs, headers=header, timeout=10).status_code == 404
    assert httpx.get(keyed.url + "/health", timeout=10).json() == {"status": "ok", "model_loaded": True}


def test_a_non_ascii_key_works_from_a_utf8_client(keyed: Any) -> None:
    utf8 = KEY.encode("utf-8")
    for header in (
        {"authorization": b"Bearer " + utf8},
        {"authorization": b"bearer  " + utf8},
        {"x-api-key": utf8},
    ):
        assert httpx.get(keyed.url + "/v1/models", headers=header, timeout=10).status_code == 200, header
        r = httpx.post(keyed.url + "/v1/chat/completions", json=HI, headers=header, timeout=60)
        assert r.status_code == 200, r.text
        r = httpx.post(keyed.url + "/v1/messages", json=HI, headers=header, timeout=60)
        assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "sent",
    [KEY.encode("latin-1"), KEY.encode("utf-8")[:-1], KEY.encode("utf-8") + b"x", b"", b"cle-secrete-a"],
    ids=["latin-1", "one-byte-short", "one-byte-long", "empty", "ascii-lookalike"],
)
def test_anything_but_the_keys_utf8_is_refused(keyed: Any, sent: bytes) -> None:
    headers = [{"x-api-key": sent}] + (
        [{"authorization": b"Bearer " + sent}] if sent else [{"authorization": b"Bearer"}]
    )
    for header in headers:
        r = httpx.get(keyed.url + "/v1/models", headers=header, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["message"] == UNAUTHORIZED, header
        r = httpx.post(keyed.url + "/v1/chat/completions", json=HI, headers=header, timeout=60)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
        r = httpx.post(keyed.url + "/v1/messages", json=HI, headers=header, timeout=60)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", r.text


def test_each_key_opens_every_guarded_route(keyed: Any) -> None:
    for key in (KEY.encode("utf-8"), SECOND.encode()):
        for header in ({"authorization": b"Bearer " + key}, {"x-api-key": key}):
            for path in ("/v1/models", "/openapi.json"):
                assert httpx.get(keyed.url + path, headers=header, timeout=10).status_code == 200, (
                    path,
                    header,
                )
            for path in ("/stats", "/metrics"):
                r = httpx.get(keyed.url + path, headers=header, timeout=10)
                assert r.status_code == 403 and "--admin-api-key" in r.json()["detail"], (path, header)
    for header in ({}, {"x-api-key": f"{KEY},{SECOND}".encode()}, {"x-api-key": SECOND.encode() + b"x"}):
        r = httpx.get(keyed.url + "/metrics", headers=header, timeout=10)
        assert (r.status_code, r.json()) == (401, {"detail": UNAUTHORIZED}), header
    assert httpx.get(keyed.url + "/health", timeout=10).status_code == 200
