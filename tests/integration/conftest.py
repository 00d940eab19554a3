"""Fixtures of the integration tests: the default model as an HF folder, the real server, no network.

``engine`` and ``base_url`` are the server tests' own fixtures (a float32 engine on the default
model, a real uvicorn server on a loopback port), taken from tests/server/conftest.py rather
than copied: a conftest is not importable by name, so it is loaded from its file once here.
"""

from __future__ import annotations

import importlib.util
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


def _load_server_conftest() -> Any:
    path = Path(__file__).parents[1] / "server" / "conftest.py"
    spec = importlib.util.spec_from_file_location("astrai_tests_server_conftest", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while being made
    spec.loader.exec_module(module)
    return module


_server = _load_server_conftest()
engine = _server.engine  # session: InferenceEngine.from_model(None, float32, max_seq_len=1024)
base_url = _server.base_url  # session: every installed protocol served on ``engine``

LOOPBACK = {"127.0.0.1", "::1", "localhost"}


@pytest.fixture(scope="session")
def hf_model_dir(hf_oracle, default_model_path, tmp_path_factory) -> Path:
    """A transformers folder (safetensors + tokenizer) of the default GGUF dequantized to float32.

    Saved from the session's ``hf_oracle``, so its weights are the oracle's, bit for bit. What
    loads it by path (lm-eval's ``hf`` model, its API models' ``tokenizer=``) needs no hub.
    """
    import transformers

    dest = tmp_path_factory.mktemp("hf-float32")
    # A model loaded from GGUF keeps a GGUF quantizer that refuses save_pretrained, and a config
    # still marked "gguf" would make from_pretrained look for a .gguf in the folder. The weights
    # are plain float32 tensors already: detach both for the save, and put them back, since the
    # oracle is shared with the other tests of the session.
    quantizer, quant_config = hf_oracle.hf_quantizer, hf_oracle.config.quantization_config
    hf_oracle.hf_quantizer = None
    del hf_oracle.config.quantization_config
    try:
        hf_oracle.save_pretrained(dest)
    finally:
        hf_oracle.hf_quantizer, hf_oracle.config.quantization_config = quantizer, quant_config
    from hf_gguf import reading_once

    with reading_once():
        tokenizer = transformers.AutoTokenizer.from_pretrained(
            str(default_model_path.parent), gguf_file=default_model_path.name, local_files_only=True
        )
    tokenizer.save_pretrained(dest)
    return dest


@pytest.fixture(scope="module")
def offline(tmp_path_factory) -> Iterator[list[str]]:
    """For a whole module: the HF hub and datasets offline, every connection beyond loopback refused.

    Yields the list of refused hosts: a library that tried the network and swallowed the error
    still shows up there. huggingface_hub and datasets read the offline flags when imported, so
    their module constants are set as well as the environment. The datasets cache goes to a
    temporary folder. Module scope, so that module fixtures (a reference run) are covered too.
    """
    import datasets.config
    import huggingface_hub.constants

    refused: list[str] = []
    getaddrinfo, connect = socket.getaddrinfo, socket.socket.connect

    def guarded_getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host not in LOOPBACK:
            refused.append(str(host))
            raise OSError(f"offline test: lookup of {host!r} refused")
        return getaddrinfo(host, *args, **kwargs)

    def guarded_connect(sock: socket.socket, address: Any) -> Any:
        if sock.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in LOOPBACK:
            refused.append(str(address[0]))
            raise OSError(f"offline test: connection to {address!r} refused")
        return connect(sock, address)

    with pytest.MonkeyPatch.context() as mp:
        for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
            mp.setenv(var, "1")
        mp.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        mp.setattr(datasets.config, "HF_HUB_OFFLINE", True)
        mp.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
        mp.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path_factory.mktemp("datasets"))
        mp.setattr(socket, "getaddrinfo", guarded_getaddrinfo)
        mp.setattr(socket.socket, "connect", guarded_connect)
        yield refused
