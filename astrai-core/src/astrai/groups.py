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
from astrai.sampling.base import SAMPLING, check_strategy_class

#: Validator of each group: ``check(entry-point name, loaded object, origin) -> object``.
VALIDATORS: dict[str, Validator] = {
    ATTENTION_BACKENDS: check_backend_class,
    PROTOCOLS: check_builder_class,
    SAMPLING: check_strategy_class,
    GRAMMARS: check_grammar_backend,
    MODELS: check_architecture,
    HOOKS: check_hook_plugin,
}
GROUPS = tuple(VALIDATORS)

__all__ = [
    "ATTENTION_BACKENDS",
    "GRAMMARS",
    "GROUPS",
    "HOOKS",
    "MODELS",
    "PROTOCOLS",
    "SAMPLING",
    "VALIDATORS",
]
