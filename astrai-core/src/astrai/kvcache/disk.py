"""DiskTier: the KV tiers' folder (``astrai.kvcache.tier``), written by a thread of its own.

Its files live under ``<dir>/<fingerprint hex>/``, the fingerprint a digest of the model (its
architecture and the checksum of its weights), the pool's dtypes and its layout, so a restarted
server finds the files of the same model and cache again, and those of another (another model, a
changed checkpoint, ``--kv-cache-dtype``) are left alone with a log line. ``<dir>`` must be empty
or one of ours (its ``ASTRAI-KV-CACHE`` marker): a directory it cannot write, a full disk or a
foreign directory disables the disk tier with one warning, and serving goes on. Each file holds a
header (magic, version, fingerprint, key, length) and a checksum of its payload: a corrupt or
truncated file is found on read, removed, and never served. Least recently used files go first
once the folder would pass its bound.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

__all__ = ["MARKER", "DiskTier", "fingerprint"]

MARKER = "ASTRAI-KV-CACHE"
_MAGIC, _VERSION = b"ASKV", 1
_HEADER = struct.Struct("<4sI16s16sQ16s")  # magic, version, fingerprint, key, payload bytes, checksum
_PENDING_BYTES = 256 * 2**20  # pages queued for the disk at most; past it a page is not written


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def fingerprint(model_config: object, tensors: list[tuple[str, torch.Tensor]], layout: dict) -> bytes:
    """A digest of the model (its config and every weight's bytes, ``tensors`` as ``state_dict()``
    gave them) and of the pool's ``layout`` (dtypes, shapes, page size): what a disk tier's files
    belong to."""
    h = hashlib.blake2b(repr(sorted(layout.items())).encode(), digest_size=16)
    h.update(repr(model_config).encode())
    for name, t in tensors:
        h.update(f"{name} {t.dtype} {tuple(t.shape)}".encode())
        if t.device.type != "meta" and t.numel():
            h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().data)
    return h.digest()


class DiskTier:
    """Pages in files under ``<root>/<fingerprint hex>/``, at most ``max_bytes``, written by a thread.

    ``fingerprint`` is computed on that thread (hashing the weights takes a while for a large model):
    until it is known, and the folder's files are indexed, ``get`` finds nothing. ``enabled`` turns
    False (one warning) on an unusable directory or a failed write.
    """

    def __init__(self, root: str | os.PathLike, max_bytes: int, fingerprint: Callable[[], bytes]) -> None:
        self.root, self.max_bytes = Path(root), max_bytes
        self.enabled = self._claim()
        self._fingerprint = fingerprint
        self._fp = b""
        self._dir: Path | None = None
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> file bytes, least recently used first
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._pending = 0  # bytes queued
        self._ready = threading.Event()
        self.counters = {"written": 0, "corrupt": 0, "skipped": 0}
        self._thread = threading.Thread(target=self._run, name="astrai-kv-disk", daemon=True)
        if self.enabled:
            self._thread.start()

    # ----------------------------------------------------------------- set-up
    def _claim(self) -> bool:
        """Create or adopt the directory; False (one warning) when it is unwritable or foreign."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            entries = {p.name for p in self.root.iterdir()}
            if entries and MARKER not in entries:
                self._warn(
                    f"it holds files that are not astrai's ({len(entries)} entries, no {MARKER} marker)"
                )
                return False
            (self.root / MARKER).write_text("astrai KV cache pages: one folder per model and cache layout\n")
        except OSError as err:
            self._warn(f"it cannot be used: {err}")
            return False
        return True

    def _warn(self, why: str) -> None:
        logger.warning(
            "KV cache disk tier disabled: --kv-cache-dir %s: %s; serving goes on without it", self.root, why
        )

    def _index_folder(self) -> None:
        self._fp = self._fingerprint()
        self._dir = self.root / self._fp.hex()
        self._dir.mkdir(exist_ok=True)
        others = [p.name for p in self.root.iterdir() if p.is_dir() and p != self._dir]
        if others:
            logger.info(
                "KV cache disk tier: ignoring %d folder(s) of another model, checkpoint or cache layout in %s",
                len(others),
                self.root,
            )
        files = []
        for path in self._dir.glob("*.kv"):
            try:
                stat = path.stat()
                files.append((stat.st_mtime, bytes.fromhex(path.stem), stat.st_size))
            except (OSError, ValueError):
                continue
        with self._lock:
            for _, key, size in sorted(files):
                self._index[key] = size
        logger.info("KV cache disk tier: %d page(s) found in %s", len(files), self._dir)

    # ----------------------------------------------------------------- the writer thread
    def _run(self) -> None:
        try:
            self._index_folder()
        except Exception as err:  # noqa: BLE001 - whatever it is, the tier goes and serving goes on
            self._disable(f"it cannot be used: {type(err).__name__}: {err}")
        finally:
            self._ready.set()
        while True:
            item = self._queue.get()
            if item is None:
                return
            key, payload = item
            try:
                if self.enabled:
                    self._write(key, payload)
            except OSError as err:  # a full disk, a folder taken away
                self._disable(f"writing a page failed: {err}")
            finally:
                with self._lock:
                    self._pending -= payload.numel()
                self._queue.task_done()

    def _disable(self, why: str) -> None:
        if self.enabled:
            self.enabled = False
            self._warn(why)

    def _path(self, key: bytes) -> Path:
        return self._dir / f"{key.hex()}.kv"

    def _write(self, key: bytes, payload: torch.Tensor) -> None:
        data = payload.numpy().data
        header = _HEADER.pack(_MAGIC, _VERSION, self._fp, key, len(data), _digest(data))
        path = self._path(key)
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(data)
        os.replace(tmp, path)  # a reader never sees a half-written file under its name
        size = _HEADER.size + len(data)
        with self._lock:
            self._index[key] = size
            self._index.move_to_end(key)
            total = sum(self._index.values())
            old = []
            while total > self.max_bytes and len(self._index) > 1:
                gone, n = self._index.popitem(last=False)
                total -= n
                old.append(gone)
        self.counters["written"] += 1
        for gone in old:
            self._path(gone).unlink(missing_ok=True)

    # ----------------------------------------------------------------- the pool's side
    def put(self, key: bytes, payload: torch.Tensor, wait: bool = False) -> None:
        """Queue a page for writing: dropped while too much is queued already, or with ``wait`` (a
        shutdown's save) once the queue has drained."""
        if not self.enabled:
            return
        if wait and self._pending + payload.numel() > _PENDING_BYTES:
            self._queue.join()
        with self._lock:
            if key in self._index or self._pending + payload.numel() > _PENDING_BYTES:
                if key not in self._index:
                    self.counters["skipped"] += 1
                return
            self._pending += payload.numel()
        self._queue.put((key, payload))

    def get(self, key: bytes) -> torch.Tensor | None:
        """The page's payload, read and checked now; None when absent, not yet indexed, or corrupt
        (a corrupt file is removed)."""
        if not self.enabled or not self._ready.is_set():
            return None
        with self._lock:
            if key not in self._index:
                return None
            self._index.move_to_end(key)
        path = self._path(key)
        try:
            raw = path.read_bytes()
        except OSError:
            raw = b""
        payload = self._check(raw, key)
        if payload is None:
            self.counters["corrupt"] += 1
            logger.warning("KV cache disk tier: %s is corrupt or truncated; removed, not served", path)
            with self._lock:
                self._index.pop(key, None)
            path.unlink(missing_ok=True)
            return None
        return torch.frombuffer(bytearray(payload), dtype=torch.uint8)

    def _check(self, raw: bytes, key: bytes) -> bytes | None:
        if len(raw) < _HEADER.size:
            return None
        magic, version, fp, stored, n, checksum = _HEADER.unpack_from(raw)
        payload = raw[_HEADER.size :]
        if (magic, version, fp, stored) != (_MAGIC, _VERSION, self._fp, key) or len(payload) != n:
            return None
        return payload if _digest(payload) == checksum else None

    def stats(self) -> tuple[int, int]:
        """``(pages, bytes)`` on disk."""
        with self._lock:
            return len(self._index), sum(self._index.values())

    def wait_ready(self) -> None:
        """Return once the weights are hashed and the folder's pages indexed (an engine's start)."""
        if self._thread.is_alive():
            self._ready.wait()

    def flush(self) -> None:
        """Wait until the folder is indexed and every queued page is written (tests)."""
        if self._thread.is_alive():
            self._ready.wait()
            self._queue.join()

    def close(self) -> None:
        """Write what is queued, then stop the thread."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
