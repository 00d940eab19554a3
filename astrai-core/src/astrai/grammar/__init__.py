"""Constrained decoding: grammar specs, the ``astrai.grammars`` backend ABC, and the compile cache."""

from __future__ import annotations

from astrai.grammar.base import (
    GRAMMARS,
    KINDS,
    GrammarBackend,
    GrammarConfig,
    GrammarMatcher,
    GrammarSpec,
    check_grammar_backend,
)
from astrai.grammar.cache import GrammarCache

__all__ = [
    "GRAMMARS",
    "KINDS",
    "GrammarBackend",
    "GrammarCache",
    "GrammarConfig",
    "GrammarMatcher",
    "GrammarSpec",
    "check_grammar_backend",
]
