"""Structured-output request fields of every protocol, turned into one ``astrai.grammar.GrammarSpec``.

- OpenAI ``response_format``: ``{"type": "text"}`` (none), ``{"type": "json_object"}``,
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``;
- vLLM's ``structured_outputs``: exactly one of ``json`` (a schema, object or JSON text),
  ``regex``, ``choice``, ``grammar`` (EBNF, as xgrammar reads it), ``structural_tag``,
  ``json_object: true``;
- the Responses API's ``text.format`` (``{"type": "json_schema", "name", "schema", "strict"}``);
- Anthropic's ``output_config.format`` (``{"type": "json_schema", "schema"}``).

A malformed value is a RequestRejected naming the field; the grammar library's own verdict on
the schema comes when it is compiled (also a 400).
"""

from __future__ import annotations

from typing import Any

from astrai.errors import RequestRejected
from astrai.grammar import GrammarSpec

__all__ = [
    "STRUCTURED_OUTPUT_KEYS",
    "anthropic_format",
    "one_of",
    "openai_response_format",
    "responses_text_format",
    "vllm_structured_outputs",
]

STRUCTURED_OUTPUT_KEYS = {
    "json": "json_schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "structural_tag": "structural_tag",
}
"""vLLM's ``structured_outputs`` keys -> ``GrammarSpec`` kinds (``json_object: true`` too)."""
COMPACT = "disable_any_whitespace"  # vLLM's key for JSON without whitespace between tokens


def _spec(kind: str, value: Any, param: str, compact: bool = False) -> GrammarSpec:
    try:
        return GrammarSpec.of(kind, value, compact=compact)
    except RequestRejected as e:
        raise RequestRejected(f"{param}: {e}", param=param) from None


def _schema(container: dict[str, Any], param: str) -> GrammarSpec:
    schema = container.get("schema")
    if schema is None:
        raise RequestRejected(f"{param}.schema is required", param=f"{param}.schema")
    return _spec("json_schema", schema, f"{param}.schema")


def openai_response_format(
    value: dict[str, Any] | None, param: str = "response_format"
) -> GrammarSpec | None:
    """The spec of an OpenAI ``response_format`` (None for text or absent)."""
    if value is None:
        return None
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec.of("json_object")
    if kind == "json_schema":
        inner = value.get("json_schema")
        if not isinstance(inner, dict):
            raise RequestRejected(
                f"{param}.json_schema must be an object with a schema", param=f"{param}.json_schema"
            )
        return _schema(inner, f"{param}.json_schema")
    raise RequestRejected(
        f"{param}.type must be text, json_object or json_schema, got {kind!r}", param=f"{param}.type"
    )


def responses_text_format(value: dict[str, Any] | None, param: str = "text.format") -> GrammarSpec | None:
    """The spec of a Responses ``text.format`` (None for text or absent)."""
    if value is None or value.get("type", "text") == "text":
        return None
    if value.get("type") == "json_object":
        return GrammarSpec.of("json_object")
    if value.get("type") == "json_schema":
        return _schema(value, param)
    raise RequestRejected(f"{param}.type must be text, json_object or json_schema", param=f"{param}.type")


def anthropic_format(value: dict[str, Any] | None, param: str = "output_config.format") -> GrammarSpec | None:
    """The spec of Anthropic's ``output_config.format``."""
    if value is None:
        return None
    if value.get("type") != "json_schema":
        raise RequestRejected(f"{param}.type must be json_schema", param=f"{param}.type")
    return _schema(value, param)


def vllm_structured_outputs(
    value: dict[str, Any] | None, param: str = "structured_outputs"
) -> GrammarSpec | None:
    """The spec of vLLM's ``structured_outputs``: exactly one constraint, and ``disable_any_whitespace``
    (true: JSON without whitespace between its tokens; it applies to ``json`` and ``json_object``).
    Other keys vLLM accepts (``disable_fallback``, ``whitespace_pattern``, ...) are refused."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise RequestRejected(f"{param} must be an object", param=param)
    unknown = set(value) - set(STRUCTURED_OUTPUT_KEYS) - {"json_object", COMPACT}
    if unknown:
        name = sorted(unknown)[0]
        raise RequestRejected(f"{param}.{name} is not supported", param=f"{param}.{name}")
    compact = value.get(COMPACT)
    if compact not in (None, True, False):
        raise RequestRejected(f"{param}.{COMPACT} must be a boolean", param=f"{param}.{COMPACT}")
    chosen = [k for k, v in value.items() if v not in (None, False) and k != COMPACT]
    if len(chosen) != 1:
        raise RequestRejected(
            f"{param} must set exactly one of {', '.join([*STRUCTURED_OUTPUT_KEYS, 'json_object'])}",
            param=param,
        )
    key = chosen[0]
    if compact and key not in ("json", "json_object"):
        raise RequestRejected(
            f"{param}.{COMPACT} applies to json and json_object only", param=f"{param}.{COMPACT}"
        )
    if key == "json_object":
        return GrammarSpec.of("json_object", compact=bool(compact))
    return _spec(STRUCTURED_OUTPUT_KEYS[key], value[key], f"{param}.{key}", bool(compact))


def one_of(*specs: tuple[str, GrammarSpec | None]) -> GrammarSpec | None:
    """The one spec set among ``(field, spec)`` pairs; RequestRejected when two fields constrain."""
    set_ = [(name, s) for name, s in specs if s is not None]
    if len(set_) > 1:
        raise RequestRejected(
            f"{set_[0][0]} and {set_[1][0]} both constrain the output: send one", param=set_[1][0]
        )
    return set_[0][1] if set_ else None
