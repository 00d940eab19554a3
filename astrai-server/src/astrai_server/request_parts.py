"""The pieces of request models that protocols share, so that each protocol stays one builder file.

A protocol module (``astrai_server/protocols/*.py``, or a third party's copy of one) imports
astrai-core's ``astrai.protocol`` and these, never another protocol module:

- ``Strict``: the base of a request's nested objects; a key the protocol does not define is
  pydantic's ``extra_forbidden``, which the server answers with a 400 naming its location;
- ``text_or_parts`` and ``json_kind``: ``str | list[part]`` told apart by the JSON type, so that an
  error names the member that was meant;
- ``null_is_not_sent``: the request model's validator for JSON null, "not set" in the APIs astrai
  serves: a refused field sent as null is no request for it (null in a declared field is its default:
  ``astrai.protocol.value_or_default``);
- ``select_tools``: which of a request's tools the chat template is shown, from a tool choice in
  neutral terms (``none``, ``auto``, ``required``, ``named``); each protocol maps its own choice
  object and words its own errors;
- ``decode_arguments``: a call's JSON arguments, decoded for a chat template.

Imports pydantic and astrai-core only (no FastAPI): a builder that uses them is still tested
without HTTP. Shapes of one family of APIs live apart (``astrai_server.openai_shapes``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Discriminator, Tag, model_validator

from astrai.errors import RequestRejected

__all__ = [
    "MAX_ARGUMENT_DEPTH",
    "Strict",
    "decode_arguments",
    "json_kind",
    "null_is_not_sent",
    "select_tools",
    "text_or_parts",
]

T = TypeVar("T")


class Strict(BaseModel):
    """A nested object of the request: a key the protocol does not define is refused (400 naming it)."""

    model_config = ConfigDict(extra="forbid")


def json_kind(value: Any) -> str | None:
    """The JSON type of a value to validate, as the tag of a union member: ``"str"``, ``"list"`` or
    ``"dict"`` (a model instance too). Error locations leave these tags out (``app._union_label``), so
    a union told apart by them reports the member that was meant
    (``messages.0.content.0.text: Field required``), not one error per member."""
    if isinstance(value, str):
        return "str"
    if isinstance(value, list):
        return "list"
    return "dict" if isinstance(value, (dict, BaseModel)) else None


def text_or_parts(part: type[BaseModel]) -> Any:
    """``str | list[part]``, told apart by the JSON type (see ``json_kind``)."""
    return Annotated[
        Annotated[str, Tag("str")] | Annotated[list[part], Tag("list")],
        Discriminator(
            json_kind,
            custom_error_type="content",
            custom_error_message="Input should be a string or a list of content parts",
        ),
    ]


def null_is_not_sent(refused: Mapping[str, str]) -> Any:
    """A request model's ``model_validator(mode="before")`` that drops a top-level field of ``refused``
    sent as JSON null, as if it had not been sent: the handler refuses an undeclared field whatever
    its value, and null asks for nothing. Other keys are kept (null in a declared field is its
    default). In the class body: ``_null_is_not_sent = null_is_not_sent(REFUSED)``."""

    def drop(cls: type[BaseModel], data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items() if v is not None or k in cls.model_fields or k not in refused}

    return model_validator(mode="before")(classmethod(drop))


def select_tools(
    tools: Sequence[T] | None,
    mode: Literal["none", "auto", "required", "named"],
    name: str | None = None,
    *,
    to_template: Callable[[Sequence[T]], list[dict[str, Any]]],
    requires: str = "tool_choice requires tools",
    requires_param: str | None = "tool_choice",
    noun: str = "function",
    name_param: str = "tool_choice",
) -> list[dict[str, Any]]:
    """The tools the chat template is shown, in the form ``chat_prompt_ids`` takes
    (``{"type": "function", "function": {"name", ...}}``).

    ``mode``: ``none`` shows none; ``auto`` all (the model may call one); ``required`` all (it must);
    ``named`` only the tool called ``name`` (it must call that one). ``to_template`` turns the
    protocol's tool objects into that form (it may refuse one: RequestRejected); it runs only when
    tools are shown. Raises RequestRejected with the protocol's words: ``requires`` (param
    ``requires_param``) when a call is demanded of a request without tools; "tool_choice names
    <noun> <name>, which is not in tools" (param ``name_param``) when ``name`` is none of them.
    """
    if not tools and mode in ("required", "named"):
        raise RequestRejected(requires, param=requires_param)
    if not tools or mode == "none":
        return []
    shown = to_template(tools)
    if mode == "named":
        shown = [t for t in shown if t["function"]["name"] == name]
        if not shown:
            raise RequestRejected(
                f"tool_choice names {noun} {name!r}, which is not in tools", param=name_param
            )
    return shown


#: How deep a call's decoded arguments may nest before they go to the template as text instead: a
#: string may hold JSON the body's own depth bound never saw, and rendering it re-encodes it recursively.
MAX_ARGUMENT_DEPTH = 64


def decode_arguments(arguments: str) -> Any:
    """A call's JSON arguments decoded for a chat template (the text itself when it is not JSON, or
    when it nests deeper than ``MAX_ARGUMENT_DEPTH``)."""
    try:
        value = json.loads(arguments)
    except (ValueError, RecursionError):
        return arguments  # templates render it as given
    return arguments if _deeper_than(value, MAX_ARGUMENT_DEPTH) else value


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether lists and objects in ``value`` nest more than ``limit`` levels (iterative: no recursion)."""
    level = [value] if isinstance(value, (list, dict)) else []
    for _ in range(limit):  # ``level``: the lists and objects one level further in
        level = [
            v
            for c in level
            for v in (c.values() if isinstance(c, dict) else c)
            if isinstance(v, (list, dict))
        ]
        if not level:
            return False
    return True
