"""Memory a model will take, estimated from its header, against the memory available: before loading.

``require_memory`` adds up what loading and serving a checkpoint allocates (its weights as
loaded in the chosen dtype, quantized ones at their size in the file; the dense copy the model
is built with while the state dict is copied in; the rotary table of the served context; what
the caller reserves, an engine's KV pool) and raises ``InsufficientMemory`` with the numbers
when that exceeds what is available: the smaller of ``/proc/meminfo``'s MemAvailable and the
room under this process's cgroup memory limits (v1 or v2), or the device's free memory on CUDA.
It is an estimate meant to refuse what cannot fit (a metadata field that asks for terabytes)
before the host's OOM killer sees it, not to promise that what passes fits: allocator
overheads, packed copies and other processes come on top.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from astrai.errors import InsufficientMemory
from astrai.model.checks import TensorInfo
from astrai.model.config import ModelConfig

__all__ = ["available_memory", "require_memory", "weight_bytes"]

logger = logging.getLogger(__name__)

_CGROUP = Path("/sys/fs/cgroup")
_UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a number near 2**63


def _gib(n: int) -> str:
    return f"{n / 2**40:.1f} TiB" if n >= 2**40 else f"{n / 2**30:.1f} GiB"


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _inactive_file(folder: Path) -> int:
    """Page cache the kernel reclaims before it reaches the limit (``memory.stat``)."""
    try:
        for line in (folder / "memory.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key in ("inactive_file", "total_inactive_file"):
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _cgroup_room() -> tuple[int, str] | None:
    """The least room under this process's cgroup memory limits (its own group and its ancestors)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    rooms = []
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        if controllers == "":  # v2: one hierarchy
            root, limit_file, usage_file = _CGROUP, "memory.max", "memory.current"
        elif "memory" in controllers.split(","):
            root, limit_file, usage_file = (
                _CGROUP / "memory",
                "memory.limit_in_bytes",
                "memory.usage_in_bytes",
            )
        else:
            continue
        folder = root / rel.lstrip("/")
        # in a container the hierarchy's root is often the container's own group: look there too
        for f in [folder, *folder.parents]:
            if f == root.parent:
                break
            limit, usage = _read_int(f / limit_file), _read_int(f / usage_file)
            if limit is not None and usage is not None and limit < _UNLIMITED:
                rooms.append(
                    (max(0, limit - usage + _inactive_file(f)), f"the cgroup limit of {_gib(limit)} in {f}")
                )
    return min(rooms) if rooms else None


def available_memory(device: torch.device | str = "cpu") -> tuple[int, str] | None:
    """(bytes, where that figure comes from) that ``device`` can still take; None when unknown."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free, f"free memory of {device}"
    if device.type != "cpu":
        return None
    found = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append((int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"))
    except (OSError, ValueError, IndexError):
        pass
    room = _cgroup_room()
    if room is not None:
        found.append(room)
    return min(found) if found else None


def weight_bytes(
    tensors: Mapping[str, TensorInfo], dtype: torch.dtype, kept: Callable[[str, TensorInfo], bool]
) -> tuple[int, int]:
    """(bytes of the weights as loaded, bytes of the model's dense parameters): tensors ``kept``
    quantized count their size in the file, every other one its elements in ``dtype``."""
    loaded = dense = 0
    for name, info in tensors.items():
        as_dense = info.numel * dtype.itemsize
        dense += as_dense
        loaded += info.nbytes if kept(name, info) else as_dense
    return loaded, dense


def require_memory(
    path: Path,
    config: ModelConfig,
    tensors: Mapping[str, TensorInfo],
    dtype: torch.dtype,
    device: torch.device | str,
    kept: Callable[[str, TensorInfo], bool],
    reserve: Mapping[str, int] | None = None,
) -> None:
    """Raise InsufficientMemory when loading the checkpoint at ``path`` (then allocating ``reserve``:
    what for -> bytes) would exceed ``available_memory(device)``; nothing is allocated.

    ``config.max_position_embeddings`` is the context the model is built for (its rotary table).
    Peak: the weights as loaded plus the larger of the dense model they are copied into (while
    loading) and ``reserve`` (allocated once the loader's copies are freed).
    """
    loaded, dense = weight_bytes(tensors, dtype, kept)
    rotary = config.max_position_embeddings * config.head_dim * 4  # [ctx, head_dim / 2, 2] float32
    reserve = dict(reserve or {})
    need = loaded + rotary + max(dense, sum(reserve.values()))
    available = available_memory(device)
    if available is None:
        return
    room, where = available
    logger.debug("%s: needs about %s of the %s available (%s)", path, _gib(need), _gib(room), where)
    if need <= room:
        return
    parts = [f"{_gib(loaded)} weights in {str(dtype).removeprefix('torch.')} (+{_gib(dense)} while loading)"]
    if rotary >= 2**20:
        parts.append(f"{_gib(rotary)} rotary table (a context of {config.max_position_embeddings})")
    parts += [f"{_gib(n)} {what}" for what, n in reserve.items()]
    raise InsufficientMemory(
        f"{path}: needs about {_gib(need)} ({'; '.join(parts)}), more than the {_gib(room)} available "
        f"({where}); nothing was allocated"
    )
