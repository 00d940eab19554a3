"""Every entry-point group of astrai, in order, with its validator (``astrai plugins``, the docs).

Each subsystem names its own group next to its ABC; this module only gathers them, so it sits
above all of them (nothing in core but the command line imports it).
"""

from __future__ import annotations

from astrai.extension.backend.base import ATTENTION_BACKENDS, check_backend_class
from astrai.grammar.base import GRAMMARS, check_grammar_backend
from astrai.hooks import HOOKS, check_hook_plugin
from astrai.model.architecture import MODELS, check_architecture
from astrai.plugins import Validator
from astrai.protocol import PROTOCOLS, check_builder_class
from astrai.reasoning.base import REASONING_PARSERS, check_reasoning_parser
from astrai.sampling.base import SAMPLING, check_strategy_class
from astrai.tool_parsers.base import TOOL_PARSERS, check_tool_parser

#: Validator of each group: ``check(entry-point name, loaded object, origin) -> object``.
VALIDATORS: dict[str, Validator] = {
    ATTENTION_BACKENDS: check_backend_class,
    PROTOCOLS: check_builder_class,
    SAMPLING: check_strategy_class,
    GRAMMARS: check_grammar_backend,
    MODELS: check_architecture,
    HOOKS: check_hook_plugin,
    REASONING_PARSERS: check_reasoning_parser,
    TOOL_PARSERS: check_tool_parser,
}
GROUPS = tuple(VALIDATORS)

__all__ = [
    "ATTENTION_BACKENDS",
    "GRAMMARS",
    "GROUPS",
    "HOOKS",
    "MODELS",
    "PROTOCOLS",
    "REASONING_PARSERS",
    "SAMPLING",
    "TOOL_PARSERS",
    "VALIDATORS",
]
