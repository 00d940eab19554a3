"""``GrammarCache``: an engine's grammar backend and its compiled grammars, by spec, bounded.

``GrammarConfig`` (``astrai.grammar.base``) bounds the work one spec may cost: its size
(``max_bytes``, checked before anything is compiled), the compile's time (``timeout``) and how many
compiles run and wait (``workers``, ``max_pending``: ``astrai.grammar.pool``); and the memory the
compiled grammars keep (``cache_bytes``). Every bound is a 400 or a 429 naming its setting.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from astrai.errors import PluginError, RequestRejected
from astrai.grammar.base import (
    GRAMMARS,
    GrammarBackend,
    GrammarConfig,
    GrammarMatcher,
    GrammarSpec,
    check_grammar_backend,
)
from astrai.plugins import load_plugins

if TYPE_CHECKING:
    from astrai.grammar.pool import CompilePool
    from astrai.model import Tokenizer

__all__ = ["GrammarCache", "GrammarConfig"]

logger = logging.getLogger(__name__)


class GrammarCache:
    """Compiles specs with the configured ``astrai.grammars`` backend (``name``; None: the first
    available, ``xgrammar`` first) within ``config``'s bounds, and keeps the most recently used
    compiled grammars within ``config.cache_entries`` and ``config.cache_bytes``.

    The backend is made on first use (building its vocabulary table takes a fraction of a
    second), and with it the compile workers (``astrai.grammar.pool``) when it can export itself
    and ``config.workers`` > 0. ``compile`` may be called from any thread, several at once; a spec
    being compiled by one caller is waited for by the others rather than compiled twice.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        name: str | None = None,
        config: GrammarConfig | None = None,
    ) -> None:
        self._args = (tokenizer, vocab_size, tuple(stop_token_ids))
        self.name = name
        self.config = config or GrammarConfig()
        self._backend: GrammarBackend | None = None
        self._pool: CompilePool | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._compiled: OrderedDict[GrammarSpec, tuple[Any, int]] = OrderedDict()  # spec -> (compiled, bytes)
        self._bytes = 0
        self._pending: dict[GrammarSpec, threading.Event] = {}
        self._threads: ThreadPoolExecutor | None = None  # compile_async's waiters (not the event loop's pool)

    @property
    def backend(self) -> GrammarBackend:
        """The backend, made on first use. Raises RequestRejected when none is installed or the
        named one is missing or broken (a request asked for something the server cannot do)."""
        with self._lock:
            if self._backend is None:
                backend = self._load()(*self._args)
                if self.config.workers and backend.export() is not None and not self._closed:
                    from astrai.grammar.pool import CompilePool

                    c = self.config
                    self._pool = CompilePool(backend, c.workers, c.timeout, c.max_pending)
                self._backend = backend
            return self._backend

    @property
    def bytes_cached(self) -> int:
        """Memory the kept compiled grammars hold, as their backend counts it."""
        return self._bytes

    def _load(self) -> type[GrammarBackend]:
        loaded = load_plugins(GRAMMARS, check_grammar_backend)
        if self.name is not None:
            if self.name in loaded.failures:
                raise PluginError(loaded.failures[self.name].describe())
            if self.name not in loaded.classes:
                raise PluginError(
                    f"grammar backend {self.name!r} is not installed; "
                    f"installed: {', '.join(loaded.classes) or 'none'}"
                )
            return loaded.classes[self.name]
        order = sorted(loaded.classes, key=lambda n: (n != "xgrammar", n))
        for name in order:
            if loaded.classes[name].is_available():
                return loaded.classes[name]
        raise RequestRejected(
            "constrained decoding needs a grammar backend: none is installed (pip install xgrammar)",
            param="grammar",
        )

    def check(self, spec: GrammarSpec) -> None:
        """RequestRejected (400) when ``spec`` is larger than ``config.max_bytes``: nothing is compiled."""
        size = len(spec.value.encode("utf-8"))
        if size > self.config.max_bytes:
            raise RequestRejected(
                f"the {spec.kind} is {size} bytes; at most {self.config.max_bytes} are compiled "
                "(--max-grammar-bytes)",
                param="grammar",
            )

    def compile(self, spec: GrammarSpec, cancel: threading.Event | None = None) -> Any:
        """The compiled grammar of ``spec`` (cached). Raises RequestRejected for an invalid or oversized
        spec or one whose compile outlasted ``config.timeout``, Overloaded when too many compiles are
        under way, ``astrai.grammar.pool.Cancelled`` once ``cancel`` is set (the caller left)."""
        while True:
            with self._lock:
                if spec in self._compiled:
                    self._compiled.move_to_end(spec)
                    return self._compiled[spec][0]
                waiting = self._pending.get(spec)
                if waiting is None:
                    self._pending[spec] = threading.Event()
                    break
            while not waiting.wait(0.05):  # someone else compiles it; then look again (it may have failed)
                if cancel is not None and cancel.is_set():
                    from astrai.grammar.pool import Cancelled

                    raise Cancelled("the grammar compile was abandoned: its client left", param="grammar")
        try:
            self.check(spec)
            backend = self.backend
            pool = self._pool
            compiled = (
                backend.compile(spec) if pool is None else backend.deserialize(pool.compile(spec, cancel))
            )
            self._keep(spec, compiled, backend.compiled_bytes(compiled))
            return compiled
        finally:
            with self._lock:
                self._pending.pop(spec).set()

    def _keep(self, spec: GrammarSpec, compiled: Any, size: int) -> None:
        """Cache ``compiled`` (least recently used ones go past the bounds); one larger than the whole
        byte bound is used by its request and not kept."""
        if size > self.config.cache_bytes:
            return
        with self._lock:
            self._compiled[spec] = (compiled, size)
            self._bytes += size
            while len(self._compiled) > self.config.cache_entries or self._bytes > self.config.cache_bytes:
                self._bytes -= self._compiled.popitem(last=False)[1][1]

    async def compile_async(self, spec: GrammarSpec) -> Any:
        """``compile`` awaited in the running event loop, on threads of this cache's own (never the
        loop's default executor, which parses request bodies): cancelling the await (its client
        left) stops the compile (``cancel``)."""
        with self._lock:
            if self._threads is None:  # one waiter per compile that may run or wait, and one to refuse more
                c = self.config
                self._threads = ThreadPoolExecutor(
                    c.workers + c.max_pending + 1, thread_name_prefix="astrai-grammar"
                )
            threads = self._threads
        cancel = threading.Event()
        future = asyncio.get_running_loop().run_in_executor(threads, self.compile, spec, cancel)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            cancel.set()
            future.add_done_callback(
                lambda f: f.cancelled() or f.exception()
            )  # retrieved: no "never retrieved" log
            raise

    def matcher(self, spec: GrammarSpec, compiled: Any = None) -> GrammarMatcher:
        """A fresh matcher for ``spec`` (``compiled``: its compiled grammar; None: compiled here
        unless cached)."""
        backend = self.backend
        matcher = backend.matcher(self.compile(spec) if compiled is None else compiled)
        matcher.backend = backend
        return matcher

    def cancel_all(self) -> None:
        """Stop every compile under way or waiting for a worker (a drain); later compiles run."""
        pool = self._pool
        if pool is not None:
            pool.cancel_all()

    def close(self) -> None:
        """Stop the compile workers (the engine shuts down); later compiles run on the caller's thread."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
            threads, self._threads = self._threads, None
        if pool is not None:
            pool.close()
        if threads is not None:
            threads.shutdown(wait=False)
