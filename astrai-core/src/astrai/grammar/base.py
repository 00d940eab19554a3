"""Constrained decoding: what a request asks for (``GrammarSpec``) and the ABCs a grammar library implements.

A ``GrammarBackend`` (entry-point group ``astrai.grammars``) compiles a spec once per tokenizer
(slow: off the scheduler thread, cached by ``GrammarCache``; in a worker process of
``astrai.grammar.pool`` when the backend can ``export`` itself, so that a compile can be bounded
in time, cancelled and its memory returned) and makes one ``GrammarMatcher`` per request from it.
Each step the runner has every constrained row's matcher fill its row of one token bitmask and
applies the bitmask to those rows' logits in one operation, before the sampling pipeline;
``Request.accept`` advances the matcher by the sampled token.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from astrai.errors import PluginError, RequestRejected
from astrai.plugins import check_class

if TYPE_CHECKING:
    import torch

__all__ = [
    "GRAMMARS",
    "GrammarBackend",
    "GrammarConfig",
    "GrammarMatcher",
    "GrammarSpec",
    "check_grammar_backend",
]

GRAMMARS = "astrai.grammars"
"""The entry-point group of ``GrammarBackend`` subclasses; ``EngineConfig.grammar_backend`` names one."""

Kind = Literal["json_schema", "json_object", "regex", "choice", "grammar", "structural_tag"]
KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True)
class GrammarSpec:
    """What a constrained request's output must match. Hashable: the compile cache's key.

    ``kind`` is one of :data:`KINDS`; ``value`` is a JSON schema as compact JSON text
    (``json_schema``), ``""`` (``json_object``: any JSON object), a regular expression
    (``regex``), the choices as a JSON array of strings (``choice``), an EBNF/Lark grammar
    (``grammar``) or a structural tag as JSON (``structural_tag``). Build with :meth:`of`.
    ``compact`` (``json_schema`` and ``json_object`` only): JSON without whitespace between its
    tokens (vLLM's ``disable_any_whitespace``); by default the model may lay its JSON out as it
    learned to (pretty-printed, a bounded run of whitespace between tokens).
    """

    kind: str
    value: str = ""
    compact: bool = False

    @classmethod
    def of(cls, kind: str, value: Any = "", compact: bool = False) -> GrammarSpec:
        """A spec from a protocol's value (a schema dict, a list of choices, a string).

        Raises RequestRejected (``param`` "grammar") for an unknown kind or a value of the wrong type,
        or ``compact`` for a kind that is not JSON.
        """
        if compact and kind not in ("json_schema", "json_object"):
            raise RequestRejected(
                f"compact JSON applies to a JSON schema or object, not a {kind}", param="grammar"
            )
        if kind not in KINDS:
            raise RequestRejected(
                f"unknown grammar kind {kind!r}; one of {', '.join(KINDS)}", param="grammar"
            )
        if kind in ("json_schema", "structural_tag"):
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as e:
                    raise RequestRejected(f"{kind} is not valid JSON: {e}", param="grammar") from None
            if not isinstance(value, (dict, bool)):
                raise RequestRejected(
                    f"{kind} must be a JSON object, got {type(value).__name__}", param="grammar"
                )
            text = json.dumps(value, separators=(",", ":"))  # key order kept: properties come in it
            return cls(kind, text, compact=compact and kind == "json_schema")
        if kind == "choice":
            if not (isinstance(value, (list, tuple)) and value and all(isinstance(c, str) for c in value)):
                raise RequestRejected("choice must be a non-empty list of strings", param="grammar")
            return cls(kind, json.dumps(list(value)))
        if kind == "json_object":
            return cls(kind, "", compact=compact)
        if not isinstance(value, str) or not value:
            raise RequestRejected(f"{kind} must be a non-empty string", param="grammar")
        return cls(kind, value)


@dataclass(frozen=True)
class GrammarConfig:
    """Bounds on constrained decoding's compiles (see the module doc).

    ``workers`` 0 compiles on the requesting thread, as a backend that cannot ``export`` itself
    always does: no time-out, no cancelling."""

    workers: int = 1  # compile worker processes (compiles at once)
    max_pending: int = 8  # compiles that may wait for a worker; one more: Overloaded (429)
    timeout: float = (
        15.0  # seconds one compile may take; then its worker is killed and the request gets a 400
    )
    max_bytes: int = (
        256 * 2**10
    )  # largest spec (schema, regex, choices, grammar, tool set), in bytes of its text
    cache_bytes: int = 256 * 2**20  # memory the compiled grammars kept for reuse may hold
    cache_entries: int = 256  # compiled grammars kept for reuse

    def __post_init__(self) -> None:
        if self.workers < 0 or self.max_pending < 0 or self.max_bytes < 1 or self.cache_bytes < 0:
            raise ValueError(f"grammar bounds must be positive: {self}")
        if not self.timeout > 0:
            raise ValueError(f"grammar compile timeout must be > 0 seconds, got {self.timeout}")


class GrammarMatcher(ABC):
    """One request's position in its grammar. Used on the scheduler thread only; ``backend`` is
    the backend that made it (its bitmask layout)."""

    backend: GrammarBackend

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into row ``row`` of ``bitmask`` (the backend's layout)."""

    @abstractmethod
    def accept(self, token_id: int) -> bool:
        """Advance by ``token_id``; False if the grammar does not allow it (the matcher is unchanged)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted: nothing more may follow."""


class GrammarBackend(ABC):
    """A grammar library. Made once per engine with its tokenizer; ``compile`` may run on any
    thread (concurrently with the scheduler thread filling masks of other requests)."""

    name: ClassVar[str]

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        # tokenizer: the engine's astrai.model.Tokenizer (not imported: this module is a contract)
        self.tokenizer, self.vocab_size, self.stop_token_ids = tokenizer, vocab_size, tuple(stop_token_ids)

    @classmethod
    def is_available(cls) -> bool:
        """Whether the library imports; the engine uses the first available backend."""
        return True

    @abstractmethod
    def compile(self, spec: GrammarSpec) -> Any:
        """The compiled grammar of ``spec``; raises RequestRejected (``param`` "grammar") with the
        library's reason for a schema, regex or grammar it cannot compile."""

    @abstractmethod
    def matcher(self, compiled: Any) -> GrammarMatcher:
        """A fresh matcher at the start of ``compiled``."""

    # ------------------------------------------------------------ compile workers (optional)
    def export(self) -> Any:
        """Picklable state from which ``restore`` makes this backend again in a compile worker process,
        or None (the default): the backend then compiles on the requesting thread, where a compile can be
        neither bounded in time nor cancelled. A backend that exports must implement ``restore``,
        ``serialize`` and ``deserialize``."""
        return None

    @classmethod
    def restore(cls, state: Any) -> GrammarBackend:
        """The backend that ``export`` described, in a compile worker (no tokenizer object there)."""
        raise PluginError(f"grammar backend {cls.__qualname__} exports no state for compile workers")

    def serialize(self, compiled: Any) -> bytes | str:
        """``compiled`` as bytes or text, sent from a compile worker to the engine's process."""
        raise PluginError(f"grammar backend {type(self).__qualname__} cannot serialize a compiled grammar")

    def deserialize(self, data: bytes | str) -> Any:
        """The compiled grammar ``serialize`` wrote, for ``matcher`` in this process."""
        raise PluginError(f"grammar backend {type(self).__qualname__} cannot deserialize a compiled grammar")

    def compiled_bytes(self, compiled: Any) -> int:
        """Memory ``compiled`` holds, for the cache's byte bound (default: 0, unknown; the cache's count
        bound still holds)."""
        return 0

    @abstractmethod
    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        """A bitmask for a batch of ``rows`` rows over the vocabulary (on the host)."""

    @abstractmethod
    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
        """Set the disallowed logits of ``logits[i]`` to -inf from ``bitmask[i]`` for every ``i`` in ``rows``
        (the other rows untouched), in place, in one operation."""


def check_grammar_backend(name: str, plugin: object, origin: str) -> type[GrammarBackend]:
    """Validate an ``astrai.grammars`` plugin: a ``GrammarBackend`` named ``name``. Raises PluginError."""
    return check_class(GrammarBackend, name, plugin, origin)
