"""Models named by Hugging Face Hub id (astrai.model.hub), against a Hub cache built in the test.

The cache has huggingface_hub's layout (``models--org--name/{refs,snapshots,blobs}``) in a
temporary HF_HUB_CACHE, and every test runs with the network guarded: a lookup or connection
beyond loopback is refused and recorded, and the tests assert that none was tried.
"""

from __future__ import annotations

import hashlib
import shutil
import socket
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub.constants
import pytest
import torch
from huggingface_hub import errors

from astrai.errors import ModelNotFound
from astrai.model import load_model, load_tokenizer, open_checkpoint
from astrai.model.hub import gguf_quant, hub_error, hub_model, parse_hub_id
from astrai.model.resolve import local_model, resolve_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"
LOOPBACK = {"127.0.0.1", "::1", "localhost"}


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """An empty Hub cache, offline, with the network guarded; yields (cache, attempts)."""
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    attempts: list[str] = []
    getaddrinfo, connect, create_connection = (
        socket.getaddrinfo,
        socket.socket.connect,
        socket.create_connection,
    )

    def guarded_getaddrinfo(host, *args, **kwargs):
        if host not in LOOPBACK:
            attempts.append(f"getaddrinfo {host}")
            raise OSError(f"test: lookup of {host!r} refused")
        return getaddrinfo(host, *args, **kwargs)

    def guarded_connect(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in LOOPBACK:
            attempts.append(f"connect {address}")
            raise OSError(f"test: connection to {address!r} refused")
        return connect(sock, address)

    def guarded_create_connection(address, *args, **kwargs):
        if address[0] not in LOOPBACK:
            attempts.append(f"create_connection {address}")
            raise OSError(f"test: connection to {address!r} refused")
        return create_connection(address, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", guarded_getaddrinfo)
    monkeypatch.setattr(socket.socket, "connect", guarded_connect)
    monkeypatch.setattr(socket, "create_connection", guarded_create_connection)
    yield cache, attempts
    assert attempts == [], "something tried to reach the network"


def online(monkeypatch):
    """Lift HF_HUB_OFFLINE (the socket guard stays: a request would still be refused and recorded)."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)


def add_snapshot(cache: Path, repo: str, files: dict[str, Path], revision="main", commit=COMMIT) -> Path:
    """``files`` (name in the repo -> source) cached as huggingface_hub caches them: content in
    ``blobs/<hash>``, ``snapshots/<commit>/<name>`` a relative link to it, ``refs/<revision>``.
    A large source's blob is a link to it rather than a copy."""
    storage = cache / ("models--" + repo.replace("/", "--"))
    snapshot = storage / "snapshots" / commit
    (storage / "blobs").mkdir(parents=True, exist_ok=True)
    for name, source in files.items():
        blob = storage / "blobs" / hashlib.sha256(f"{source}:{name}".encode()).hexdigest()
        if source.stat().st_size > 1 << 20:
            blob.unlink(missing_ok=True)
            blob.symlink_to(source.resolve())
        else:
            shutil.copyfile(source, blob)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(Path("../" * (len(Path(name).parts) + 1)) / "blobs" / blob.name)
    if revision != commit:
        (storage / "refs").mkdir(exist_ok=True)
        (storage / "refs" / revision).write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory) -> Path:
    """A tiny random Llama checkpoint (safetensors) with a word-level tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("tiny-hf")
    words = ["<unk>", "<s>", "</s>", *"abcdefghijklmnopqrstuvwxyz", "hello", "world"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    ).save_pretrained(folder)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    return folder


def hf_files(folder: Path) -> dict[str, Path]:
    return {p.name: p for p in folder.iterdir() if p.is_file()}


@pytest.mark.parametrize(
    ("name", "parsed"),
    [
        ("Qwen/Qwen3-0.6B", ("Qwen/Qwen3-0.6B", None)),
        ("unsloth/Qwen3-0.6B-GGUF:Q4_K_M", ("unsloth/Qwen3-0.6B-GGUF", "Q4_K_M")),
        ("org/name-GGUF:q8_0", ("org/name-GGUF", "q8_0")),
        ("smollm2-135m", None),
        ("dir/model.gguf", None),
        ("./org/name", None),
        ("/abs/path", None),
        ("a/b/c", None),
        ("org/na--me", None),
        ("org/name:", None),
        ("org/name:Q4 K", None),
    ],
)
def test_parse_hub_id(name, parsed):
    assert parse_hub_id(name) == parsed


@pytest.mark.parametrize(
    ("file", "quant"),
    [
        ("Qwen3-0.6B-Q4_K_M.gguf", "Q4_K_M"),
        ("SmolLM2-135M-Instruct.Q4_1.gguf", "Q4_1"),
        ("gemma-3-270m-q4_k_m.gguf", "Q4_K_M"),
        ("model_iq4_xs.gguf", "IQ4_XS"),
        ("Llama-3.2-1B-Instruct-f16.gguf", "F16"),
        ("sub/big-Q8_0-00001-of-00003.gguf", "Q8_0"),
        ("model.gguf", None),
    ],
)
def test_gguf_quant_from_the_file_name(file, quant):
    assert gguf_quant(file) == quant


def test_a_safetensors_id_loads_from_the_cache_offline(hub, tiny_hf):
    cache, _ = hub
    snapshot = add_snapshot(cache, "org/tiny", hf_files(tiny_hf))
    assert resolve_model("org/tiny") == ("hf", snapshot)
    ckpt = open_checkpoint("org/tiny")
    assert (ckpt.kind, ckpt.config.architecture, ckpt.config.vocab_size) == ("hf", "llama", 64)
    tokenizer = load_tokenizer("org/tiny", ckpt.config)
    assert tokenizer.encode("hello world") == [29, 30]
    model, _ = load_model("org/tiny", dtype=torch.float32)
    assert model.config.num_hidden_layers == 2


def test_a_cached_id_needs_no_network_when_online_either(hub, tiny_hf, monkeypatch):
    """A second start: the files are cached, so nothing asks the Hub (offline or not)."""
    cache, _ = hub
    online(monkeypatch)
    snapshot = add_snapshot(cache, "org/tiny", hf_files(tiny_hf))
    assert resolve_model("org/tiny") == ("hf", snapshot)
    assert local_model("org/tiny") == str(snapshot)
    assert open_checkpoint("org/tiny").config.hidden_size == 32


def test_an_incomplete_cached_snapshot_is_not_taken(hub, tiny_hf):
    cache, _ = hub
    files = {k: v for k, v in hf_files(tiny_hf).items() if not k.endswith(".safetensors")}
    add_snapshot(cache, "org/tiny", files)
    with pytest.raises(ModelNotFound, match="not in the Hugging Face cache"):
        resolve_model("org/tiny")


def test_revisions_resolve_to_their_snapshots(hub, tiny_hf):
    cache, _ = hub
    main = add_snapshot(cache, "org/tiny", hf_files(tiny_hf))
    tagged = add_snapshot(cache, "org/tiny", hf_files(tiny_hf), revision="v1", commit=OTHER_COMMIT)
    assert resolve_model("org/tiny") == ("hf", main)
    assert resolve_model("org/tiny", revision="v1") == ("hf", tagged)
    assert resolve_model("org/tiny", revision=OTHER_COMMIT) == ("hf", tagged)
    assert local_model("org/tiny", "v1") == str(tagged)
    with pytest.raises(ModelNotFound, match=r"org/tiny \(revision v2\) is not in the Hugging Face cache"):
        resolve_model("org/tiny", revision="v2")


def test_a_revision_of_a_local_model_is_refused(hub, tiny_hf):
    for model in (str(tiny_hf), "smollm2-135m", None):
        with pytest.raises(ModelNotFound, match="applies to a Hugging Face Hub id"):
            local_model(model, "v1")
    assert local_model(str(tiny_hf)) == str(tiny_hf) and local_model(None) is None


def test_an_existing_path_wins_over_a_hub_id(hub, tiny_hf, tmp_path, monkeypatch):
    cache, _ = hub
    add_snapshot(cache, "org/tiny", hf_files(tiny_hf))
    local = tmp_path / "work" / "org" / "tiny"
    shutil.copytree(tiny_hf, local)
    monkeypatch.chdir(tmp_path / "work")
    assert resolve_model("org/tiny") == ("hf", Path("org/tiny"))


def test_gguf_repos_pick_the_quantization(hub, default_model_path):
    cache, _ = hub
    add_snapshot(
        cache, "org/tiny-GGUF", {"tiny-Q4_1.gguf": default_model_path, "tiny-Q8_0.gguf": default_model_path}
    )
    kind, path = resolve_model("org/tiny-GGUF:q8_0")  # matched without regard to case
    assert (kind, path.name) == ("gguf", "tiny-Q8_0.gguf")
    assert open_checkpoint("org/tiny-GGUF:Q4_1").path.name == "tiny-Q4_1.gguf"
    with pytest.raises(ModelNotFound) as err:  # no Q4_K_M and two others: the user says which
        resolve_model("org/tiny-GGUF")
    assert "Q4_1, Q8_0" in str(err.value) and "org/tiny-GGUF:Q4_1" in str(err.value)

    add_snapshot(cache, "org/one-GGUF", {"one-Q4_1.gguf": default_model_path})
    assert resolve_model("org/one-GGUF")[1].name == "one-Q4_1.gguf"  # the repo's only file
    add_snapshot(
        cache, "org/km-GGUF", {"km-Q4_1.gguf": default_model_path, "km-Q4_K_M.gguf": default_model_path}
    )
    assert resolve_model("org/km-GGUF")[1].name == "km-Q4_K_M.gguf"  # llama-server's default


def test_a_missing_quantization_lists_those_there_are(hub, default_model_path):
    cache, _ = hub
    add_snapshot(
        cache, "org/tiny-GGUF", {"tiny-Q4_1.gguf": default_model_path, "tiny-Q8_0.gguf": default_model_path}
    )
    with pytest.raises(ModelNotFound) as err:
        resolve_model("org/tiny-GGUF:Q5_K_M")
    message = str(err.value)
    assert "\n" not in message
    assert "no GGUF file of quantization Q5_K_M" in message and "cached: Q4_1, Q8_0" in message
    assert "HF_HUB_OFFLINE=1" in message


def test_a_split_gguf_is_refused_saying_so(hub, default_model_path):
    cache, _ = hub
    split = {f"big-Q4_K_M-0000{i}-of-00002.gguf": default_model_path for i in (1, 2)}
    add_snapshot(cache, "org/big-GGUF", split)
    with pytest.raises(ModelNotFound, match=r"split into several files \(big-Q4_K_M-00001-of-00002\.gguf"):
        resolve_model("org/big-GGUF:Q4_K_M")


def test_an_id_not_cached_while_offline_is_one_line_with_the_fix(hub):
    with pytest.raises(ModelNotFound) as err:
        resolve_model("org/absent")
    message = str(err.value)
    assert "\n" not in message
    assert "org/absent is not in the Hugging Face cache" in message
    assert "HF_HUB_OFFLINE=1 forbids downloading it" in message


def test_astrai_chat_answers_a_missing_id_with_exit_2(hub, capsys):
    from astrai.cli import main
    from astrai.hooks import PluginManager

    assert main(["chat", "hi", "--model", "org/absent"], pm=PluginManager([])) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("astrai: error: org/absent is not in the Hugging Face cache") and "\n" not in err


class _Api:
    """``HfApi`` whose file list is given, and which records the downloads asked of it."""

    def __init__(self, files, downloads, cache: Path):
        self.files, self.downloads, self.cache = files, downloads, cache

    def __call__(self):
        return self

    def list_repo_files(self, repo, revision=None):
        if isinstance(self.files, Exception):
            raise self.files
        return self.files

    def snapshot_download(self, repo, revision=None, allow_patterns=None):
        self.downloads.append(("snapshot", repo, revision, allow_patterns))
        return str(self.cache / "snap")

    def hf_hub_download(self, repo, filename, revision=None):
        self.downloads.append(("file", repo, revision, filename))
        return str(self.cache / filename)


@pytest.fixture
def fake_hub(hub, monkeypatch):
    """Online, with huggingface_hub's list and download calls replaced: ``set(files)``."""
    import huggingface_hub

    cache, _ = hub
    online(monkeypatch)
    downloads: list[tuple] = []

    def install(files):
        api = _Api(files, downloads, cache)
        monkeypatch.setattr(huggingface_hub, "HfApi", api)
        monkeypatch.setattr(huggingface_hub, "snapshot_download", api.snapshot_download)
        monkeypatch.setattr(huggingface_hub, "hf_hub_download", api.hf_hub_download)
        return downloads

    return install


def test_a_safetensors_repo_downloads_what_the_loader_reads(fake_hub):
    downloads = fake_hub(["config.json", "model.safetensors", "README.md", "original/consolidated.pth"])
    kind, path = hub_model("org/tiny", revision="v1")
    assert kind == "hf" and path.name == "snap"
    (what, repo, revision, patterns) = downloads[0]
    assert (what, repo, revision) == ("snapshot", "org/tiny", "v1")
    assert {"config.json", "*.safetensors", "model.safetensors.index.json", "tokenizer.json"} <= set(patterns)
    assert "*.pth" not in patterns and "*" not in patterns


def test_a_gguf_repo_downloads_one_file(fake_hub):
    downloads = fake_hub(["README.md", "m-Q4_K_M.gguf", "m-Q8_0.gguf", "mmproj-m-F16.gguf"])
    assert hub_model("org/m-GGUF")[1].name == "m-Q4_K_M.gguf"
    assert hub_model("org/m-GGUF", "Q8_0")[1].name == "m-Q8_0.gguf"
    assert [d[3] for d in downloads] == ["m-Q4_K_M.gguf", "m-Q8_0.gguf"]
    with pytest.raises(
        ModelNotFound, match=r"no GGUF file of quantization Q2_K \(the repo has: Q4_K_M, Q8_0\)"
    ):
        hub_model("org/m-GGUF", "Q2_K")


def _http_error(cls, status=404):
    response = SimpleNamespace(status_code=status, headers={}, request=None)
    return cls(f"{status} Client Error: from the Hub", response=response)


def test_the_hubs_errors_reach_the_user_mapped(fake_hub):
    fake_hub(_http_error(errors.GatedRepoError, 403))
    with pytest.raises(ModelNotFound, match="org/tiny is gated: accept its terms"):
        hub_model("org/tiny")
    fake_hub(_http_error(errors.RevisionNotFoundError))
    with pytest.raises(ModelNotFound, match="org/tiny has no revision 'nope'"):
        hub_model("org/tiny", revision="nope")


@pytest.mark.parametrize(
    ("exc", "offline", "expected"),
    [
        (
            _http_error(errors.GatedRepoError, 403),
            False,
            "gated: accept its terms at https://huggingface.co/org/m",
        ),
        (_http_error(errors.RevisionNotFoundError), False, "has no revision 'v9': give --revision a branch"),
        (
            _http_error(errors.RepositoryNotFoundError, 401),
            False,
            "neither a local path nor a Hugging Face Hub",
        ),
        (errors.LocalEntryNotFoundError("not cached"), True, "HF_HUB_OFFLINE=1 forbids downloading it"),
        (errors.LocalEntryNotFoundError("not cached"), False, "the Hub could not be reached"),
        (_http_error(errors.HfHubHTTPError, 401), False, "refused the token for org/m (401)"),
        (_http_error(errors.HfHubHTTPError, 503), False, "downloading org/m at revision 'v9' failed: 503"),
        (ConnectionError("no route"), False, "could not be reached (ConnectionError: no route)"),
    ],
    ids=["gated", "revision", "repository", "offline", "unreachable", "token", "http", "connection"],
)
def test_hub_error_mapping(exc, offline, expected, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", offline)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1" if offline else "0")
    mapped = hub_error(exc, "org/m", "v9")
    assert isinstance(mapped, ModelNotFound) and expected in str(mapped) and "\n" not in str(mapped)


def test_hub_error_leaves_other_exceptions_alone():
    assert hub_error(ValueError("a bug"), "org/m") is None


def test_the_guard_sees_a_download_and_its_failure_is_one_line(hub, monkeypatch):
    """The check of the other tests works: huggingface_hub's request for an id not cached is
    refused by the guard and recorded, and the user reads one line."""
    import time

    _, attempts = hub
    online(monkeypatch)
    monkeypatch.setattr(time, "sleep", lambda seconds: None)  # huggingface_hub's back-off between retries
    with pytest.raises(ModelNotFound) as err:
        resolve_model("org/absent")
    assert attempts, "the guard did not see huggingface_hub's request"
    assert "could not be reached" in str(err.value) and "\n" not in str(err.value)
    attempts.clear()


def test_a_lora_adapter_named_by_hub_id_comes_from_the_cache(hub, tmp_path):
    """``--lora sql=org/sql-lora`` and ``/v1/load_lora_adapter`` take Hub ids: the cached snapshot's
    folder, with no request; an id neither cached nor reachable offline is the adapter's 400."""
    from astrai.errors import AdapterError
    from astrai.lora import resolve_adapter

    cache, _ = hub
    files = {}
    for name, text in (("adapter_config.json", '{"peft_type": "LORA"}'), ("adapter_model.safetensors", "x")):
        files[name] = tmp_path / name
        files[name].write_text(text)
    snapshot = add_snapshot(cache, "org/sql-lora", files)
    assert resolve_adapter("org/sql-lora") == str(snapshot)
    assert resolve_adapter(str(tmp_path)) == str(tmp_path)  # a path is taken as it is
    with pytest.raises(AdapterError, match="no LoRA adapter at org/missing-lora: not a local path"):
        resolve_adapter("org/missing-lora")
