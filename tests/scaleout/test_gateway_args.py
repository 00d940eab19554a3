"""``astrai_server.replicas`` without a model: the gateway's arguments (parsed by the installed
smg, so a flag it dropped or renamed fails here), the replicas' settings and ports, and the
settings ``--data-parallel-size`` refuses."""

from __future__ import annotations

import importlib.util

import pytest

from astrai_server.config import ServerSettings
from astrai_server.errors import ConfigError
from astrai_server.replicas import check_gateway_settings, gateway_args, replica_ports, replica_settings

URLS = ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]


def _parsed(settings: ServerSettings, keys: list[str]):
    smg = pytest.importorskip("smg.launch_router")
    return smg.parse_router_args(gateway_args(settings, 8000, URLS, 29001, keys))


def test_the_gateway_serves_the_requested_address_cache_aware_with_the_keys() -> None:
    settings = ServerSettings(
        host="0.0.0.0",
        data_parallel_size=2,
        log_level="warning",
        max_request_bytes=1000,
        shutdown_timeout=5,
        allowed_origins=["https://a.example"],
    )
    args = _parsed(settings, ["k1", "k2", "k3"])
    assert (args.host, args.port, args.worker_urls, args.policy, args.backend) == (
        "0.0.0.0",
        8000,
        URLS,
        "cache_aware",
        "sglang",
    )
    assert (args.prometheus_host, args.prometheus_port) == ("127.0.0.1", 29001)
    assert args.api_key == "k1" and [key for _, key in args.tenant_api_keys] == ["k2", "k3"]
    assert (args.max_payload_size, args.shutdown_grace_period_secs, args.log_level) == (1000, 15, "warn")
    assert args.cors_allowed_origins == ["https://a.example"]
    assert (
        args.health_check_interval_secs,
        args.health_failure_threshold,
        args.health_success_threshold,
    ) == (2, 2, 1)


def test_no_key_no_auth_and_json_logs() -> None:
    args = _parsed(ServerSettings(data_parallel_size=2, log_format="json"), [])
    assert args.api_key is None and not args.tenant_api_keys and args.log_json


def test_tls_is_the_gateway_s_and_the_replicas_serve_plain_http_on_loopback(tmp_path) -> None:
    cert = tmp_path / "both.pem"
    settings = ServerSettings(
        data_parallel_size=2, ssl_certfile=str(cert), port=8443, allowed_origins=["*"], api_key_file=None
    )
    args = _parsed(settings, [])
    assert (args.server_cert_path, args.server_key_path) == (
        str(cert),
        str(cert),
    )  # the key in the certificate file
    replica = replica_settings(settings, 9001, ["k1"])
    assert (replica.host, replica.port, replica.data_parallel_size, replica.api_key) == (
        "127.0.0.1",
        9001,
        1,
        ["k1"],
    )
    assert (replica.ssl_certfile, replica.allowed_origins, replica.api_key_file) == (None, [], None)


def test_each_replica_keeps_its_kv_cache_pages_in_a_folder_of_its_own(tmp_path) -> None:
    settings = ServerSettings(data_parallel_size=2, kv_cache_dir=str(tmp_path))
    folders = [replica_settings(settings, 9001 + i, [], i).kv_cache_dir for i in range(2)]
    assert folders == [str(tmp_path / "replica-0"), str(tmp_path / "replica-1")]
    assert replica_settings(ServerSettings(data_parallel_size=2), 9001, [], 1).kv_cache_dir is None


def test_replica_ports_from_the_base_or_free() -> None:
    assert replica_ports(ServerSettings(data_parallel_size=3, data_parallel_base_port=9100)) == [
        9100,
        9101,
        9102,
    ]
    free = replica_ports(ServerSettings(data_parallel_size=2))
    assert len(set(free)) == 2 and all(p > 0 for p in free)
    with pytest.raises(ConfigError, match="past 65535"):
        replica_ports(ServerSettings(data_parallel_size=3, data_parallel_base_port=65534))
    with pytest.raises(ConfigError, match="the gateway's port"):
        replica_ports(ServerSettings(data_parallel_size=2, data_parallel_base_port=7999, port=8000))


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"allowed_methods": ["GET"]}, "--allowed-methods with --data-parallel-size"),
        ({"allowed_headers": ["x-a"]}, "--allowed-headers with --data-parallel-size"),
        ({"ssl_certfile": "c.pem", "ssl_ca_certs": "ca.pem"}, "--ssl-ca-certs with --data-parallel-size"),
        (
            {"ssl_certfile": "c.pem", "ssl_keyfile_password": "pw"},
            "--ssl-keyfile-password with --data-parallel-size",
        ),
        ({"ssl_certfile": "missing.pem"}, "--ssl-certfile missing.pem: no such file"),
    ],
)
def test_what_the_gateway_cannot_serve_is_refused_at_start(settings: dict, message: str) -> None:
    pytest.importorskip("smg")
    with pytest.raises(ConfigError, match=message):
        check_gateway_settings(ServerSettings(data_parallel_size=2, **settings))


def test_without_smg_the_error_names_the_extra(monkeypatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ConfigError, match=r"pip install 'astrai-server\[gateway\]'"):
        check_gateway_settings(ServerSettings(data_parallel_size=2))


def test_every_replica_signs_with_one_key() -> None:
    """A thinking block signed by one replica verifies on the others: they share a key, drawn at start
    when ``signing_key`` is not set."""
    import json

    pytest.importorskip("smg")
    from astrai_server.replicas import Supervisor

    for key in (None, "s" * 16):
        replicas = Supervisor(ServerSettings(data_parallel_size=2, signing_key=key)).replicas
        keys = {json.loads(r.payload)["signing_key"] for r in replicas}
        assert len(keys) == 1 and None not in keys and (key is None or keys == {key})
