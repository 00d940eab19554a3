"""Issue 17, the hardened HTTP edge: request ids, the access log, CORS, API keys, TLS, log formats
and settings from the environment (``astrai_server.edge``, ``astrai_server.logs``,
``config.read_environment``).

The unit layer runs the app on the scripted fake engine (tests/server/conftest.py), in an
in-process uvicorn where it needs one; the real layer (slow) starts ``astrai serve`` subprocesses:
HTTPS with a certificate made here, CORS, keys from the environment and a file, JSON logs, settings
from the environment over the YAML file and under the flags.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import gc
import json
import logging
import re
import socket
import ssl
import threading
import time
import warnings
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import Request

from astrai_server import ServerSettings, connections, create_app, edge, logs
from astrai_server import keys as keyring
from astrai_server.cli import add_serve_arguments, settings_from_args
from astrai_server.config import _env_kind, env_name, load_settings, read_environment
from astrai_server.errors import ConfigError

CHAT = "/v1/chat/completions"
HI = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2}
GENERATED = re.compile(r"req-[0-9a-f]{16}")
UNAUTHORIZED = {"detail": "invalid or missing API key (Authorization: Bearer or x-api-key)"}


class Keep(logging.Handler):
    """Keeps the records it sees, with the request id filter of ``astrai serve``'s handler."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self.addFilter(logs.RequestIdFilter())

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def kept() -> Iterator[Keep]:
    """Records of ``astrai_server`` (the access log included) and of ``edge_test``, at INFO."""
    handler = Keep()
    loggers = [logging.getLogger(n) for n in ("astrai_server", "edge_test")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.INFO)
    yield handler
    for lg, level in zip(loggers, levels, strict=True):
        lg.removeHandler(handler)
        lg.setLevel(level)


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="astrai serve")
    add_serve_arguments(parser)
    return parser.parse_args(argv)


# ---------------------------------------------------------------- certificates made here


def _pki(folder: Path) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1 and localhost, a client certificate, their keys
    (PEM), and the server's key encrypted with the password ``pw``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.now(timezone.utc)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def usage(sign_certs: bool) -> x509.KeyUsage:
        return x509.KeyUsage(
            digital_signature=True,
            content_commitment=False,
            key_encipherment=False,
            data_encipherment=False,
            key_agreement=False,
            key_cert_sign=sign_certs,
            crl_sign=sign_certs,
            encipher_only=False,
            decipher_only=False,
        )

    def builder(subject: str, key: Any) -> x509.CertificateBuilder:
        return (
            x509.CertificateBuilder()
            .subject_name(name(subject))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - timedelta(minutes=5))
            .not_valid_after(now + timedelta(days=1))
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        )

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        builder("astrai test CA", ca_key)
        .issuer_name(name("astrai test CA"))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(usage(True), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    files = {"ca": folder / "ca.pem"}
    files["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    for who, purpose, san in (
        (
            "server",
            ExtendedKeyUsageOID.SERVER_AUTH,
            [x509.DNSName("localhost"), x509.IPAddress(__import__("ipaddress").ip_address("127.0.0.1"))],
        ),
        ("client", ExtendedKeyUsageOID.CLIENT_AUTH, [x509.DNSName("client.example")]),
    ):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            builder(who, key)
            .issuer_name(ca.subject)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(usage(False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([purpose]), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
            )
            .add_extension(x509.SubjectAlternativeName(san), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        files[f"{who}_cert"], files[f"{who}_key"] = folder / f"{who}.pem", folder / f"{who}.key"
        files[f"{who}_cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        plain = serialization.NoEncryption()
        files[f"{who}_key"].write_bytes(
            key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, plain)
        )
        if who == "server":
            files["encrypted_key"] = folder / "server-encrypted.key"
            locked = serialization.BestAvailableEncryption(b"pw")
            files["encrypted_key"].write_bytes(
                key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, locked)
            )
    return files


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return _pki(tmp_path_factory.mktemp("pki"))


def _trusting(pki: dict[str, Path], client_cert: bool = False) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(pki["ca"]))
    if client_cert:
        context.load_cert_chain(str(pki["client_cert"]), str(pki["client_key"]))
    return context


@contextlib.contextmanager
def _uvicorn(app: Any, **options: Any) -> Iterator[int]:
    """``app`` under uvicorn (with ``options``: TLS) in a thread on a free loopback port; yields the port."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2, **options))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            gc.collect()


# ---------------------------------------------------------------- EdgeMiddleware, unit


def _call(app: Any, scope: dict[str, Any]) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b""}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    with contextlib.suppress(RuntimeError):
        asyncio.run(app(scope, receive, send))
    return sent


def _scope(method: str, path: str, headers: list[tuple[bytes, bytes]] = ()) -> dict[str, Any]:
    return {
        "type": "http",
        "method": method,
        "path": path,
        "headers": list(headers),
        "client": ("10.0.0.1", 5000),
    }


def test_the_middleware_counts_names_echoes_and_logs(kept: Keep) -> None:
    state = argparse.Namespace(in_flight=0, request_ids=set())
    seen: list[tuple[int, str | None, str]] = []

    async def inner(scope: dict[str, Any], receive: Any, send: Any) -> None:
        seen.append((state.in_flight, edge.current_request_id(), scope["state"]["request_id"]))
        if scope["path"] == "/boom":
            raise RuntimeError("boom")
        scope["state"]["usage"] = {"prompt_tokens": 7, "completion_tokens": 3}
        await send(
            {
                "type": "http.response.start",
                "status": 201,
                "headers": [(b"x-request-id", b"stale"), (b"a", b"b")],
            }
        )
        await send({"type": "http.response.body", "body": b"ok"})

    app = edge.EdgeMiddleware(inner, state)
    answers = {}
    for method, path in [
        ("GET", "/health"),
        ("GET", "/metrics"),
        ("HEAD", "/health"),
        ("POST", CHAT),
        ("GET", "/stats"),
        ("GET", "/boom"),
    ]:
        answers[method, path] = _call(
            app, _scope(method, path, [(b"x-request-id", f"{method}{path}".replace("/", ".").encode())])
        )
    assert [count for count, *_ in seen] == [0, 0, 0, 1, 1, 1]  # /health and /metrics are not in flight
    assert all(context == given for _, context, given in seen)
    assert (state.in_flight, state.request_ids) == (0, set())
    start = answers["POST", CHAT][0]
    assert start["status"] == 201 and start["headers"] == [
        (b"a", b"b"),
        (b"x-request-id", b"POST.v1.chat.completions"),
    ]
    boom = answers["GET", "/boom"]  # an exception before the response: Starlette's 500, with the id
    assert boom[0]["status"] == 500 and (b"x-request-id", b"GET.boom") in boom[0]["headers"]
    assert boom[1]["body"] == b"Internal Server Error"
    access = [r for r in kept.records if r.name == "astrai_server.access"]
    assert [(r.method, r.path, r.status, r.request_id) for r in access][3:] == [
        ("POST", CHAT, 201, "POST.v1.chat.completions"),
        ("GET", "/stats", 201, "GET.stats"),
        ("GET", "/boom", 500, "GET.boom"),
    ]
    post = access[3]
    assert (post.prompt_tokens, post.completion_tokens, post.client, post.route) == (
        7,
        3,
        "10.0.0.1:5000",
        None,
    )
    assert post.duration >= 0 and not hasattr(access[5], "prompt_tokens")
    assert (
        post.getMessage().startswith("POST /v1/chat/completions 201 ")
        and "request_id=POST.v1.chat.completions" in post.getMessage()
    )


def test_a_control_character_in_a_path_is_escaped_in_the_log(kept: Keep) -> None:
    state = argparse.Namespace(in_flight=0, request_ids=set())

    async def inner(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 404, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    _call(edge.EdgeMiddleware(inner, state), _scope("GET", "/a\nINFO fake line\x1b"))
    (record,) = [r for r in kept.records if r.name == "astrai_server.access"]
    assert record.path == "/a\\x0aINFO fake line\\x1b" and "\n" not in record.getMessage()


# ---------------------------------------------------------------- request ids through the app


def _probe_app(fakes: Any, **settings: Any) -> Any:
    engine = fakes.FakeEngine([fakes.Script(["x"] * 40, delay=0.05)])
    app = create_app(ServerSettings(**settings), engine)

    async def probe(request: Request) -> dict[str, Any]:
        logging.getLogger("edge_test").info("inside the request")
        request.state.usage = {"prompt_tokens": 3, "completion_tokens": 4}
        return {"state": request.state.request_id, "context": edge.current_request_id()}

    app.add_api_route("/probe/{name}", probe, methods=["GET"])
    return app


def test_request_ids_are_echoed_sanitised_and_unique_in_flight(fakes: Any, kept: Keep) -> None:
    app = _probe_app(fakes)
    with fakes.serve_app(app) as url, httpx.Client(base_url=url, timeout=30) as c:
        assert GENERATED.fullmatch(c.get("/health").headers["x-request-id"])
        given = "Abc.09_:-" + "z" * 119  # 128 characters
        assert c.get("/health", headers={"x-request-id": given}).headers["x-request-id"] == given
        bad = [b"", b"a b", b"z" * 129, "é".encode(), b"a/b", b"x\ty"]
        for value in bad:
            assert GENERATED.fullmatch(
                c.get("/health", headers={"x-request-id": value}).headers["x-request-id"]
            ), value
        r = c.get("/probe/abc", headers={"x-request-id": "probe-1"})
        assert (
            r.json() == {"state": "probe-1", "context": "probe-1"} and r.headers["x-request-id"] == "probe-1"
        )
        with c.stream(
            "POST", CHAT, json={**HI, "max_tokens": 40, "stream": True}, headers={"x-request-id": "dup"}
        ) as stream:
            assert stream.headers["x-request-id"] == "dup"
            lines = stream.iter_lines()
            next(lines)
            assert app.state.in_flight == 1 and app.state.request_ids == {"dup"}
            twin = c.get("/v1/models", headers={"x-request-id": "dup"}).headers["x-request-id"]
            assert re.fullmatch(r"dup-[0-9a-f]{8}", twin)
            assert c.get("/health").status_code == 200 and app.state.in_flight == 1
            rest = "\n".join(lines)
        assert "[DONE]" in rest
        deadline = time.monotonic() + 5
        while app.state.in_flight and time.monotonic() < deadline:
            time.sleep(0.02)
        assert (app.state.in_flight, app.state.request_ids) == (0, set())
        assert (
            c.get("/v1/models", headers={"x-request-id": "dup"}).headers["x-request-id"] == "dup"
        )  # free again
    replaced = [
        r
        for r in kept.records
        if r.name == "astrai_server.edge" and "is not 1 to 128 characters" in r.getMessage()
    ]
    assert len(replaced) == len(bad) and all(GENERATED.fullmatch(r.request_id) for r in replaced)
    assert any(r.name == "astrai_server.edge" and "in flight already" in r.getMessage() for r in kept.records)
    (inside,) = [r for r in kept.records if r.name == "edge_test"]
    assert inside.request_id == "probe-1"
    (access,) = [r for r in kept.records if r.name == "astrai_server.access" and r.request_id == "probe-1"]
    assert (access.method, access.path, access.route, access.status) == (
        "GET",
        "/probe/abc",
        "/probe/{name}",
        200,
    )
    assert (access.prompt_tokens, access.completion_tokens) == (3, 4) and access.client.startswith(
        "127.0.0.1:"
    )
    (streamed,) = [
        r
        for r in kept.records
        if r.name == "astrai_server.access" and r.request_id == "dup" and r.method == "POST"
    ]
    assert (
        streamed.route == CHAT and streamed.completion_tokens == 40
    )  # the handler's usage, after the last byte


def test_401s_errors_and_preflights_carry_the_id_and_cors_is_off_by_default(fakes: Any) -> None:
    with (
        fakes.serve_app(_probe_app(fakes, api_key=["k"])) as url,
        httpx.Client(base_url=url, timeout=30) as c,
    ):
        r = c.post(CHAT, json=HI, headers={"x-request-id": "no-key"})
        assert (r.status_code, r.headers["x-request-id"]) == (401, "no-key")
        r = c.get("/stats", headers={"x-request-id": "no-key-2"})
        assert (r.status_code, r.json(), r.headers["x-request-id"]) == (401, UNAUTHORIZED, "no-key-2")
        r = c.post(CHAT, content=b"{", headers={"x-api-key": "k", "x-request-id": "bad-json"})
        assert (r.status_code, r.headers["x-request-id"]) == (400, "bad-json")
        preflight = {"origin": "https://app.example", "access-control-request-method": "POST"}
        r = c.options(CHAT, headers=preflight)
        assert r.status_code == 405 and GENERATED.fullmatch(r.headers["x-request-id"])
        assert not [h for h in r.headers if h.startswith("access-control-")]
        r = c.post(CHAT, json=HI, headers={"x-api-key": "k", "origin": "https://app.example"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


# ---------------------------------------------------------------- API keys


def test_any_of_several_keys_opens_and_every_key_is_compared(
    fakes: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text("# keys of the test\n\n  file-key-1  \r\nfile-key-2\n#file-key-3\n", encoding="utf-8")
    app = create_app(ServerSettings(api_key=["flag-a", "clé-b"], api_key_file=str(keys)), fakes.FakeEngine())
    assert app.state.keys.keys == (b"flag-a", "clé-b".encode(), b"file-key-1", b"file-key-2")
    compared: list[bytes] = []
    real = keyring.hmac.compare_digest
    monkeypatch.setattr(keyring.hmac, "compare_digest", lambda a, b: compared.append(b) or real(a, b))
    with fakes.serve_app(app) as url, httpx.Client(base_url=url, timeout=30) as c:
        for key in (b"flag-a", "clé-b".encode(), b"file-key-1", b"file-key-2"):
            for header in ({"authorization": b"Bearer " + key}, {"x-api-key": key}):
                compared.clear()
                assert c.get("/openapi.json", headers=header).status_code == 200, header
                assert compared == list(app.state.keys.keys)  # all four, the first one matching or not
        for wrong in (
            b"#file-key-3",
            b"file-key-3",
            b"# keys of the test",
            "flag-a,clé-b".encode(),
            b"",
            b"flag-",
        ):
            assert c.get("/openapi.json", headers={"x-api-key": wrong}).status_code == 401, wrong
        assert c.get("/health").status_code == 200


def test_a_key_file_that_cannot_serve_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "keys.txt"
    cases = [
        (None, "cannot read it"),
        ("# only a comment\n\n   \n", "the file holds no key"),
        ("good-key\nbad\x01secret\n", "line 2: the API key holds a control character"),
        (b"\xffkey\n", "cannot read it"),
    ]
    for text, message in cases:
        if text is None:
            path.unlink(missing_ok=True)
        elif isinstance(text, bytes):
            path.write_bytes(text)
        else:
            path.write_text(text)
        with pytest.raises(ConfigError, match=message) as caught:
            keyring.api_keys(ServerSettings(api_key_file=str(path)))
        assert str(caught.value).startswith(f"--api-key-file {path}") and "secret" not in str(caught.value)


def test_the_key_flag_repeats_and_keys_stay_whole() -> None:
    s = settings_from_args(_parse(["--api-key", "a", "--api-key", "b,c", "--api-key-file", "/k.txt"]))
    assert (s.api_key, s.api_key_file) == (["a", "b,c"], "/k.txt")
    assert ServerSettings(api_key="one").api_key == ["one"]
    with pytest.raises(
        ConfigError, match=r"^--api-key: Value error, the API key begins or ends with whitespace"
    ):
        load_settings({"api_key": ["a", " b"]}, environ={})
    with pytest.raises(ConfigError, match=r"^--api-key: List should have at least 1 item"):
        load_settings({"api_key": []}, environ={})


# ---------------------------------------------------------------- settings from the environment


def test_environment_between_the_yaml_file_and_the_flags(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text(
        "server:\n  port: 8001\n  max_batch_size: 4\n  served_model_name: yaml\n  kv_memory: 64MiB\n"
    )
    for name, value in {
        "ASTRAI_PORT": "8002",
        "ASTRAI_MAX_BATCH_SIZE": "8",
        "ASTRAI_SERVED_MODEL_NAME": "env",
    }.items():
        monkeypatch.setenv(name, value)
    s = settings_from_args(_parse(["--config", str(config), "--port", "9000"]))
    assert (s.port, s.max_batch_size, s.served_model_name, s.kv_memory) == (9000, 8, "env", 64 * 2**20)


def test_every_setting_is_read_from_its_variable() -> None:
    def text(value: Any) -> str:
        return (
            ",".join(value)
            if isinstance(value, list)
            else value
            if isinstance(value, str)
            else json.dumps(value)
        )

    fields = ServerSettings.model_fields
    unsettable = {
        k for k, f in fields.items() if f.default is None and _env_kind(f.annotation) in ("text", "list")
    }
    env = {env_name(k): text(f.default) for k, f in fields.items() if k not in unsettable}
    assert set(read_environment(env)) == set(fields) - unsettable
    assert load_settings({}, environ=env) == ServerSettings()
    assert all(env_name(k) == "ASTRAI_" + k.upper() for k in fields)


def test_how_a_variable_becomes_a_setting() -> None:
    env = {
        "ASTRAI_PAGED": "false",
        "ASTRAI_KV_MEMORY": "1GiB",
        "ASTRAI_SAMPLING": "{typical_p: 0.9}",
        "ASTRAI_PROTOCOLS": "openai, anthropic,",
        "ASTRAI_API_KEY": "k1, k2",
        "ASTRAI_MAX_SEQ_LEN": "null",
        "ASTRAI_MODEL": "123",
        "ASTRAI_LOG_FORMAT": "json",
        "ASTRAI_ALLOWED_METHODS": "get,post",
        "ASTRAI_PLUGIN_OPTIONS": "{request_log: /env.jsonl, trace: 2}",
        "ASTRAI_CPU_CACHE": "/not/a/setting",
    }
    s = load_settings({"trace": 3}, None, {"request_log": None, "trace": 1, "other": 0}, environ=env)
    assert (s.paged, s.kv_memory, s.sampling, s.protocols) == (
        False,
        2**30,
        {"typical_p": 0.9},
        ["openai", "anthropic"],
    )
    assert (s.api_key, s.max_seq_len, s.model, s.log_format, s.allowed_methods) == (
        ["k1", "k2"],
        None,
        "123",
        "json",
        ["GET", "POST"],
    )
    assert s.plugin_options == {
        "request_log": "/env.jsonl",
        "trace": 3,
        "other": 0,
    }  # the flag wins over the variable


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"ASTRAI_MAX_BATCH_SIZE": "0"},
            "ASTRAI_MAX_BATCH_SIZE: Input should be greater than or equal to 1 (got 0)",
        ),
        (
            {"ASTRAI_PORT": "http"},
            "ASTRAI_PORT: Input should be a valid integer, unable to parse string as an integer (got 'http')",
        ),
        (
            {"ASTRAI_API_KEY": ""},
            "ASTRAI_API_KEY: Value error, the API key is empty or only whitespace; "
            "leave it unset to serve without a key (got '')",
        ),
        ({"ASTRAI_API_KEY": "a,,b"}, "ASTRAI_API_KEY: Value error, the API key is empty or only whitespace"),
        (
            {"ASTRAI_SAMPLING": "typical_p=0.9"},
            "ASTRAI_SAMPLING: expected a YAML mapping such as {typical_p: 0.9} (got 'typical_p=0.9')",
        ),
        ({"ASTRAI_DTYPE": "float64"}, "ASTRAI_DTYPE: Input should be 'float32', 'bfloat16' or 'float16'"),
        (
            {"ASTRAI_ALLOWED_ORIGINS": "https://app.example/"},
            "ASTRAI_ALLOWED_ORIGINS: Value error, 'https://app.example/' is not an origin",
        ),
        ({"ASTRAI_LOG_FORMAT": "xml"}, "ASTRAI_LOG_FORMAT: Input should be 'text' or 'json'"),
    ],
    ids=["range", "type", "empty-key", "empty-key-in-list", "mapping", "choice", "origin", "log-format"],
)
def test_a_bad_variable_is_an_error_naming_it(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings({}, environ=env)
    assert str(caught.value).startswith(message)


def test_cors_settings_are_checked() -> None:
    s = settings_from_args(
        _parse(
            ["--allowed-origins", "https://a.example, http://b.example:8080", "--allowed-methods", "get,PUT"]
        )
    )
    assert (s.allowed_origins, s.allowed_methods, s.allowed_headers) == (
        ["https://a.example", "http://b.example:8080"],
        ["GET", "PUT"],
        ["*"],
    )
    assert ServerSettings().allowed_origins == []
    for bad in (["null"], ["app.example"], ["https://app.example/path"]):
        with pytest.raises(ConfigError, match="is not an origin"):
            load_settings({"allowed_origins": bad}, environ={})
    with pytest.raises(
        ConfigError, match="--allowed-headers: Value error, 'x y' is not an HTTP method or header name"
    ):
        load_settings({"allowed_headers": ["x y"]}, environ={})


# ---------------------------------------------------------------- logging


def test_json_lines_carry_the_fields_and_never_break() -> None:
    formatter = logs.JsonFormatter()
    try:
        raise ValueError("bad\nthing")
    except ValueError:
        import sys

        exc_info = sys.exc_info()
    record = logging.LogRecord(
        "astrai_server.access", logging.INFO, __file__, 1, "line one\nline\u2028two %s", ("é",), exc_info
    )
    for name, value in {
        "method": "POST",
        "path": CHAT,
        "route": CHAT,
        "status": 200,
        "duration": 0.25,
        "client": "1.2.3.4:5",
        "prompt_tokens": 12,
        "completion_tokens": 5,
    }.items():
        setattr(record, name, value)

    def formatted() -> str:
        token = logs._current.set("req-0123456789abcdef")
        try:
            logs.RequestIdFilter().filter(record)
            return formatter.format(record)
        finally:
            logs._current.reset(token)

    line = contextvars.copy_context().run(formatted)
    assert len(line.splitlines()) == 1 and line.isascii()
    out = json.loads(line)
    assert datetime.fromisoformat(out.pop("time")).tzinfo is not None
    assert "ValueError: bad\nthing" in out.pop("exc_info")
    assert out == {
        "level": "INFO",
        "logger": "astrai_server.access",
        "message": "line one\nline\u2028two é",
        "request_id": "req-0123456789abcdef",
        "method": "POST",
        "path": CHAT,
        "route": CHAT,
        "status": 200,
        "duration": 0.25,
        "client": "1.2.3.4:5",
        "prompt_tokens": 12,
        "completion_tokens": 5,
    }
    outside = logging.LogRecord("astrai", logging.WARNING, __file__, 1, "no request", (), None)
    logs.RequestIdFilter().filter(outside)
    assert json.loads(formatter.format(outside))["request_id"] is None


def test_log_config_and_uvicorn_options(pki: dict[str, Path]) -> None:
    text = logs.log_config(ServerSettings(log_level="warning"))
    assert text["formatters"]["astrai"] == {"format": "%(levelname)s %(name)s: %(message)s"}
    assert text["root"] == {"level": "WARNING", "handlers": ["astrai"]} and text["handlers"]["astrai"][
        "filters"
    ] == ["request_id"]
    assert all(
        text["loggers"][n] == {"handlers": [], "propagate": True}
        for n in ("uvicorn", "uvicorn.error", "uvicorn.access")
    )
    assert logs.log_config(ServerSettings(log_format="json"))["formatters"]["astrai"] == {
        "()": logs.JsonFormatter
    }
    plain = edge.uvicorn_options(ServerSettings())
    assert set(plain) == {"log_config", "access_log", "http"} and plain["access_log"] is False
    assert issubclass(plain["http"], connections.GuardedProtocol) and plain["http"].header_timeout == 10.0
    tls = edge.uvicorn_options(
        ServerSettings(
            ssl_certfile=str(pki["server_cert"]),
            ssl_keyfile=str(pki["encrypted_key"]),
            ssl_keyfile_password="pw",
            ssl_ca_certs=str(pki["ca"]),
            ssl_cert_reqs="required",
        )
    )
    assert {k: v for k, v in tls.items() if k.startswith("ssl_")} == {
        "ssl_certfile": str(pki["server_cert"]),
        "ssl_keyfile": str(pki["encrypted_key"]),
        "ssl_keyfile_password": "pw",
        "ssl_ca_certs": str(pki["ca"]),
        "ssl_cert_reqs": ssl.CERT_REQUIRED,
    }


# ---------------------------------------------------------------- TLS


def test_tls_settings_that_cannot_serve_are_config_errors(pki: dict[str, Path]) -> None:
    cert, key, ca = str(pki["server_cert"]), str(pki["server_key"]), str(pki["ca"])
    cases = [
        ({"ssl_keyfile": key}, "--ssl-keyfile needs --ssl-certfile"),
        ({"ssl_ca_certs": ca}, "--ssl-ca-certs needs --ssl-certfile"),
        ({"ssl_cert_reqs": "required"}, "--ssl-cert-reqs needs --ssl-certfile"),
        (
            {"ssl_certfile": cert, "ssl_keyfile": key, "ssl_cert_reqs": "optional"},
            "--ssl-cert-reqs optional needs --ssl-ca-certs",
        ),
        ({"ssl_certfile": "/nonexistent/cert.pem"}, "--ssl-certfile /nonexistent/cert.pem: no such file"),
        (
            {"ssl_certfile": cert, "ssl_keyfile": "/nonexistent/key.pem"},
            "--ssl-keyfile /nonexistent/key.pem: no such file",
        ),
        (
            {"ssl_certfile": cert},
            f"--ssl-certfile {cert}: not a PEM certificate chain and its private key",
        ),  # no key in it
        (
            {"ssl_certfile": cert, "ssl_keyfile": str(pki["client_key"])},
            "not a PEM certificate chain and its private key",
        ),
        ({"ssl_certfile": key, "ssl_keyfile": key}, "not a PEM certificate chain"),
        (
            {"ssl_certfile": cert, "ssl_keyfile": str(pki["encrypted_key"])},
            "the key is encrypted; give --ssl-keyfile-password",
        ),
        (
            {"ssl_certfile": cert, "ssl_keyfile": str(pki["encrypted_key"]), "ssl_keyfile_password": "wrong"},
            "not a PEM certificate chain",
        ),
        (
            {"ssl_certfile": cert, "ssl_keyfile": key, "ssl_ca_certs": key},
            f"--ssl-ca-certs {key}: not PEM CA certificates",
        ),
    ]
    for given, message in cases:
        with pytest.raises(ConfigError) as caught:
            edge.check_tls(ServerSettings(**given))
        assert message in str(caught.value), given
    assert edge.check_tls(ServerSettings()) is False
    assert edge.check_tls(
        ServerSettings(ssl_certfile=cert, ssl_keyfile=key, ssl_ca_certs=ca, ssl_cert_reqs="required")
    )


def test_client_certificates_when_required(fakes: Any, pki: dict[str, Path]) -> None:
    settings = ServerSettings(
        ssl_certfile=str(pki["server_cert"]),
        ssl_keyfile=str(pki["server_key"]),
        ssl_ca_certs=str(pki["ca"]),
        ssl_cert_reqs="required",
    )
    options = {
        k: v for k, v in edge.uvicorn_options(settings).items() if k.startswith("ssl_")
    }  # this process keeps its logging
    with _uvicorn(create_app(settings, fakes.FakeEngine()), **options) as port:
        url = f"https://127.0.0.1:{port}/health"
        r = httpx.get(url, verify=_trusting(pki, client_cert=True), timeout=10)
        assert r.status_code == 200 and GENERATED.fullmatch(r.headers["x-request-id"])
        with pytest.raises(httpx.TransportError):
            httpx.get(url, verify=_trusting(pki), timeout=10)  # no client certificate
        with pytest.raises(httpx.TransportError):
            httpx.get(url, timeout=10)  # the CA is not one the system trusts


# ---------------------------------------------------------------- real servers (slow)


@pytest.fixture(scope="module")
def edge_server(start_server: Any, pki: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Any:
    """HTTPS; CORS for https://app.example by flag (the variable's origin loses); keys from
    ASTRAI_API_KEY and a file; JSON logs and the model name from variables, over the YAML file;
    ASTRAI_PORT=1 under the fixture's --port."""
    tmp = tmp_path_factory.mktemp("edge")
    keys, config = tmp / "keys.txt", tmp / "serve.yaml"
    keys.write_text("# the file's keys\n\nfile-key-1\n  file-key-2  \n# file-key-3\n")
    config.write_text("server:\n  served_model_name: from-yaml\n  log_format: text\n  max_batch_size: 2\n")
    env = {
        "ASTRAI_API_KEY": "env-key-1, env-key-2",
        "ASTRAI_SERVED_MODEL_NAME": "from-env",
        "ASTRAI_LOG_FORMAT": "json",
        "ASTRAI_PORT": "1",
        "ASTRAI_ALLOWED_ORIGINS": "https://other.example",
        "ASTRAI_ADMIN_API_KEY": "operator-key",
    }
    return start_server(
        "--config",
        str(config),
        "--ssl-certfile",
        str(pki["server_cert"]),
        "--ssl-keyfile",
        str(pki["server_key"]),
        "--api-key-file",
        str(keys),
        "--allowed-origins",
        "https://app.example",
        env=env,
        scheme="https",
    )


@pytest.fixture
def client(edge_server: Any, pki: dict[str, Path]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=edge_server.url, verify=_trusting(pki), timeout=120) as c:
        yield c


KEY = {"authorization": "Bearer env-key-1"}


@pytest.mark.slow
def test_a_tls_round_trip(edge_server: Any, client: httpx.Client) -> None:
    assert client.get("/health").json() == {"status": "ok", "model_loaded": True}
    r = client.post(CHAT, json=HI, headers=KEY)
    # sampled: two tokens may spell no character (half of one, say), so the answer's shape is what counts
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length" and isinstance(
        r.json()["choices"][0]["message"]["content"], str
    )
    with pytest.raises(httpx.TransportError):
        httpx.get(
            edge_server.url.replace("https://", "http://") + "/health", timeout=10
        )  # no plain HTTP on it
    with pytest.raises(httpx.ConnectError):
        httpx.get(edge_server.url + "/health", timeout=10)  # a certificate only our CA vouches for


@pytest.mark.slow
def test_cors_preflight_allowed_for_a_listed_origin_and_refused_for_another(client: httpx.Client) -> None:
    asked = {
        "access-control-request-method": "POST",
        "access-control-request-headers": "authorization, content-type, x-stainless-os",
    }
    r = client.options(CHAT, headers={"origin": "https://app.example", **asked})  # no key: browsers send none
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == "https://app.example"
    assert (
        "POST" in r.headers["access-control-allow-methods"]
        and "x-stainless-os" in r.headers["access-control-allow-headers"]
    )
    assert GENERATED.fullmatch(r.headers["x-request-id"])
    for origin in ("https://other.example", "https://evil.example"):  # the variable's origin lost to the flag
        r = client.options(CHAT, headers={"origin": origin, **asked})
        assert r.status_code == 400 and "access-control-allow-origin" not in r.headers, origin
    r = client.options(
        CHAT, headers={"origin": "https://app.example", "access-control-request-method": "DELETE"}
    )
    assert r.status_code == 400
    r = client.post(CHAT, json=HI, headers={"origin": "https://app.example", **KEY})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
    assert "x-request-id" in r.headers["access-control-expose-headers"]
    r = client.post(CHAT, json=HI, headers={"origin": "https://app.example"})  # a 401 the page can read
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "https://app.example"


@pytest.mark.slow
def test_request_ids_are_echoed(client: httpx.Client) -> None:
    r = client.post(CHAT, json=HI, headers={"x-request-id": "edge-json-1", **KEY})
    assert (r.status_code, r.headers["x-request-id"]) == (200, "edge-json-1")
    r = client.post(CHAT, json=HI, headers={"x-request-id": "edge-401"})
    assert (r.status_code, r.headers["x-request-id"]) == (401, "edge-401")
    with client.stream(
        "POST", CHAT, json={**HI, "stream": True}, headers={"x-request-id": "edge-stream", **KEY}
    ) as s:
        assert s.headers["x-request-id"] == "edge-stream" and "[DONE]" in s.read().decode()
    assert GENERATED.fullmatch(client.get("/health").headers["x-request-id"])
    assert GENERATED.fullmatch(
        client.get("/health", headers={"x-request-id": "no spaces"}).headers["x-request-id"]
    )


@pytest.mark.slow
def test_keys_from_the_environment_and_a_file(client: httpx.Client) -> None:
    for key in ("env-key-1", "env-key-2", "file-key-1", "file-key-2"):
        for header in ({"authorization": f"Bearer {key}"}, {"x-api-key": key}):
            r = client.get("/v1/models", headers=header)
            assert r.status_code == 200 and [m["id"] for m in r.json()["data"]] == ["from-env"], (
                header,
                r.text,
            )  # env over YAML
            for route in ("/metrics", "/stats"):  # every tenant's traffic: the operator's key only
                r = client.get(route, headers=header)
                assert r.status_code == 403 and "--admin-api-key" in r.json()["detail"], (route, header)
    for wrong in ("file-key-3", "# file-key-3", "# the file's keys", "env-key-1, env-key-2", "from-env"):
        assert client.get("/v1/models", headers={"x-api-key": wrong}).status_code == 401, wrong
    assert (client.get("/metrics").status_code, client.get("/health").status_code) == (401, 200)
    operator = {"authorization": "Bearer operator-key"}
    assert client.get("/metrics", headers=operator).status_code == 200
    assert client.get("/stats", headers=operator).json()["active_tasks"] >= 0
    assert client.get("/v1/models", headers=operator).status_code == 200  # and every other route


@pytest.mark.slow
def test_json_log_lines_parse_and_carry_the_fields(edge_server: Any, client: httpx.Client) -> None:
    r = client.post(CHAT, json=HI, headers={"x-request-id": "edge-log-1", **KEY})
    usage = r.json()["usage"]
    client.get("/health", headers={"x-request-id": "bad id"})
    deadline = time.monotonic() + 10
    while '"edge-log-1"' not in edge_server.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    lines = [line for line in edge_server.log().splitlines() if line.strip()]
    first = next(i for i, line in enumerate(lines) if line.startswith("{"))
    assert not [
        line for line in lines[:first] if "astrai.plugins" not in line
    ]  # before the settings: plugin discovery
    records = [json.loads(line) for line in lines[first:]]  # every line from the settings on
    assert all({"time", "level", "logger", "message", "request_id"} <= set(r) for r in records)
    assert any(
        r["logger"] == "uvicorn.error" and "Uvicorn running on https://" in r["message"] for r in records
    )
    (access,) = [
        r for r in records if r["logger"] == "astrai_server.access" and r["request_id"] == "edge-log-1"
    ]
    assert (access["method"], access["path"], access["route"], access["status"]) == ("POST", CHAT, CHAT, 200)
    assert (
        access["level"] == "INFO"
        and 0 < access["duration"] < 120
        and access["client"].startswith("127.0.0.1:")
    )
    assert (access["prompt_tokens"], access["completion_tokens"]) == (
        usage["prompt_tokens"],
        usage["completion_tokens"],
    )
    (replaced,) = [r for r in records if r["logger"] == "astrai_server.edge" and "'bad id'" in r["message"]]
    assert GENERATED.fullmatch(replaced["request_id"])
    assert not [r for r in records if r["logger"] == "uvicorn.access"]  # one access line per request: ours


@pytest.mark.slow
def test_a_bad_tls_file_or_variable_stops_the_command(start_server: Any, pki: dict[str, Path]) -> None:
    cases = [
        (
            ("--ssl-certfile", "/nonexistent/cert.pem"),
            {},
            "--ssl-certfile /nonexistent/cert.pem: no such file",
        ),
        (("--ssl-keyfile", str(pki["server_key"])), {}, "--ssl-keyfile needs --ssl-certfile"),
        (
            ("--ssl-certfile", str(pki["server_cert"]), "--ssl-keyfile", str(pki["client_key"])),
            {},
            f"--ssl-certfile {pki['server_cert']} and --ssl-keyfile {pki['client_key']}: "
            "not a PEM certificate chain and its private key",
        ),
        (
            (),
            {"ASTRAI_MAX_BATCH_SIZE": "0"},
            "ASTRAI_MAX_BATCH_SIZE: Input should be greater than or equal to 1 (got 0)",
        ),
    ]
    started = [
        start_server(*flags, env=env, healthy=False) for flags, env, _ in cases
    ]  # side by side: each stops at once
    for (_, _, message), served in zip(cases, started, strict=True):
        assert served.proc.wait(120) == 2, served.log()
        assert f"astrai serve: error: {message}" in served.log()
