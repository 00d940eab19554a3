"""``LoraManager``: the engine's adapters by name, loaded and unloaded while it serves.

At most ``max_loras`` adapters are resident, each in a slot of the model's ``LoraSet``. ``load``
reads and checks the files on the calling thread (never the scheduler's: a step is not held up)
and writes the slot under the manager's lock; a new adapter's slot is one no running row uses, so
the running steps never see it half written. Past ``max_loras``, the least recently used adapter
without requests in flight is evicted; when every one has some, ``AdapterBusy``. ``unload``
removes the name at once (new requests for it are refused as an unknown model); the requests in
flight finish on its weights, and its slot is freed when the last one ends. Each resident adapter
has a uid of its own: the prefix cache keeps its pages apart (``namespace``), and drops them once
it is gone (``on_gone``).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from astrai.errors import AdapterBusy, AdapterError, ModelNotFound
from astrai.lora.adapter import read_adapter

if TYPE_CHECKING:
    from astrai.lora.layers import LoraSet
    from astrai.model.config import ModelConfig

__all__ = ["Adapter", "LoraManager"]


@dataclass(eq=False)
class Adapter:
    """A resident adapter: what requests hold (``slot``) and what ``/v1/models`` and metrics show."""

    name: str
    path: str
    rank: int
    slot: int
    uid: int
    created: float
    in_flight: int = 0
    unloaded: bool = False
    stats: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_STATS, 0))

    def namespace(self, namespace: object) -> tuple:
        """The prefix cache's namespace of a request on this adapter in ``namespace``."""
        return ("lora", self.uid, namespace)


_STATS = ("requests", "prompt_tokens", "generation_tokens")


class LoraManager:
    """Adapters of one engine's model (see the module doc)."""

    def __init__(
        self,
        lora: LoraSet,
        config: ModelConfig,
        max_loras: int,
        max_rank: int,
        reserved: tuple[str, ...] = (),
    ) -> None:
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be >= 1, got {max_loras}, {max_rank}")
        self.lora, self.config = lora, config
        self.max_loras, self.max_rank = max_loras, max_rank
        self.reserved = set(reserved)  # names an adapter may not take (the base model's)
        self._lock = threading.Lock()
        self._loading: set[str] = set()
        self._by_name: dict[str, Adapter] = {}  # least recently used first
        self._free = list(range(max_loras))
        self._uids = itertools.count(1)
        self.on_gone: Callable[[Adapter], None] | None = None  # an adapter's slot was freed

    @property
    def adapters(self) -> list[Adapter]:
        """The resident adapters, in the order they were loaded."""
        with self._lock:
            return sorted(self._by_name.values(), key=lambda a: a.uid)

    def load(self, name: str, path: str | Path, now: float = 0.0) -> Adapter:
        """Read the adapter at ``path`` and make it ``name``. Raises AdapterError (a bad name, a name in
        use, files that are no fitting LoRA: nothing is kept) or AdapterBusy (no slot to be had)."""
        if not name or not isinstance(name, str) or name != name.strip():
            raise AdapterError("an adapter needs a name (no surrounding spaces)")
        with self._lock:
            self._check_free(name)
            self._loading.add(name)
        try:
            read = read_adapter(name, path, self.config, self.lora.shapes, self.max_rank)
            with self._lock:
                slot = self._slot()
                self.lora.put(slot, read)
                adapter = Adapter(name, str(path), read.rank, slot, next(self._uids), now)
                self._by_name[name] = adapter
        finally:
            with self._lock:
                self._loading.discard(name)
        return adapter

    def _check_free(self, name: str) -> None:
        if name in self.reserved:
            raise AdapterError(f"{name!r} is the base model's name; give the adapter another")
        if name in self._by_name or name in self._loading:
            raise AdapterError(f"an adapter named {name!r} is loaded already; unload it first")

    def _slot(self) -> int:
        """A free slot, evicting the least recently used idle adapter if needed (under the lock)."""
        if self._free:
            return self._free.pop(0)
        idle = next((a for a in self._by_name.values() if a.in_flight == 0), None)
        if idle is None:
            names = ", ".join(self._by_name)
            raise AdapterBusy(
                f"all {self.max_loras} adapter slots (--max-loras) have requests in flight ({names}); "
                "retry when one is idle, or unload one"
            )
        del self._by_name[idle.name]
        idle.unloaded = True
        self._gone(idle)
        return self._free.pop(0)

    def unload(self, name: str) -> Adapter:
        """Remove ``name``: refused to new requests now, its slot freed when its last request ends.
        Raises ModelNotFound for a name not loaded."""
        with self._lock:
            adapter = self._by_name.pop(name, None)
            if adapter is None:
                raise ModelNotFound(f"no LoRA adapter named {name!r} is loaded")
            adapter.unloaded = True
            if adapter.in_flight == 0:
                self._gone(adapter)
        return adapter

    def _gone(self, adapter: Adapter) -> None:
        """Free ``adapter``'s slot (under the lock; nobody runs on it)."""
        self.lora.put(adapter.slot, None)
        self._free.append(adapter.slot)
        if self.on_gone is not None:
            self.on_gone(adapter)

    def acquire(self, name: str) -> Adapter:
        """The adapter ``name``, held for one request until ``release``; ModelNotFound if not loaded."""
        with self._lock:
            adapter = self._by_name.pop(name, None)
            if adapter is None:
                raise ModelNotFound(f"The model `{name}` does not exist or you do not have access to it.")
            self._by_name[name] = adapter  # most recently used last
            adapter.in_flight += 1
            return adapter

    def release(self, adapter: Adapter, prompt_tokens: int = 0, generation_tokens: int = 0) -> None:
        """A request on ``adapter`` ended (counted when it brought tokens)."""
        with self._lock:
            adapter.in_flight -= 1
            if prompt_tokens:
                adapter.stats["requests"] += 1
                adapter.stats["prompt_tokens"] += prompt_tokens
                adapter.stats["generation_tokens"] += generation_tokens
            if adapter.unloaded and adapter.in_flight == 0:
                self._gone(adapter)

    def stats(self) -> Mapping[str, Mapping[str, int]]:
        """Per resident adapter: requests ended, prompt and generated tokens, requests in flight."""
        with self._lock:
            return {a.name: {**a.stats, "in_flight": a.in_flight} for a in self._by_name.values()}
