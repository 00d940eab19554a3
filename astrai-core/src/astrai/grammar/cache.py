"""``GrammarCache``: an engine's grammar backend and its compiled grammars, by spec."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from astrai.errors import PluginError, RequestRejected
from astrai.grammar.base import GRAMMARS, GrammarBackend, GrammarMatcher, GrammarSpec, check_grammar_backend
from astrai.plugins import load_plugins

if TYPE_CHECKING:
    from astrai.model import Tokenizer

__all__ = ["GrammarCache"]

logger = logging.getLogger(__name__)


class GrammarCache:
    """Compiles specs with the configured ``astrai.grammars`` backend (``name``; None: the first
    available, ``xgrammar`` first) and keeps the last ``size`` compiled grammars.

    The backend is made on first use (building its vocabulary table takes a fraction of a
    second). ``compile`` may be called from any thread, several at once; a spec being compiled
    by one caller is waited for by the others rather than compiled twice.
    """

    def __init__(
        self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Sequence[int], name: str | None = None,
        size: int = 256,
    ) -> None:  # fmt: skip
        self._args = (tokenizer, vocab_size, tuple(stop_token_ids))
        self.name, self.size = name, size
        self._backend: GrammarBackend | None = None
        self._lock = threading.Lock()
        self._compiled: OrderedDict[GrammarSpec, Any] = OrderedDict()
        self._pending: dict[GrammarSpec, threading.Event] = {}

    @property
    def backend(self) -> GrammarBackend:
        """The backend, made on first use. Raises RequestRejected when none is installed or the
        named one is missing or broken (a request asked for something the server cannot do)."""
        with self._lock:
            if self._backend is None:
                self._backend = self._load()(*self._args)
            return self._backend

    def _load(self) -> type[GrammarBackend]:
        loaded = load_plugins(GRAMMARS, check_grammar_backend)
        if self.name is not None:
            if self.name in loaded.failures:
                raise PluginError(loaded.failures[self.name].describe())
            if self.name not in loaded.classes:
                raise PluginError(f"grammar backend {self.name!r} is not installed; installed: {', '.join(loaded.classes) or 'none'}")
            return loaded.classes[self.name]
        order = sorted(loaded.classes, key=lambda n: (n != "xgrammar", n))
        for name in order:
            if loaded.classes[name].is_available():
                return loaded.classes[name]
        raise RequestRejected("constrained decoding needs a grammar backend: none is installed (pip install xgrammar)", param="grammar")

    def compile(self, spec: GrammarSpec) -> Any:
        """The compiled grammar of ``spec`` (cached). Raises RequestRejected for an invalid spec."""
        while True:
            with self._lock:
                if spec in self._compiled:
                    self._compiled.move_to_end(spec)
                    return self._compiled[spec]
                waiting = self._pending.get(spec)
                if waiting is None:
                    self._pending[spec] = threading.Event()
                    break
            waiting.wait()  # someone else compiles it; then look again (it may have failed)
        try:
            compiled = self.backend.compile(spec)
            with self._lock:
                self._compiled[spec] = compiled
                while len(self._compiled) > self.size:
                    self._compiled.popitem(last=False)
            return compiled
        finally:
            with self._lock:
                self._pending.pop(spec).set()

    def matcher(self, spec: GrammarSpec) -> GrammarMatcher:
        """A fresh matcher for ``spec`` (compiled here unless cached)."""
        backend = self.backend
        matcher = backend.matcher(self.compile(spec))
        matcher.backend = backend
        return matcher
