"""How a pydantic field is written in the docs' parameter tables: type, default and range.

The docs tests compare each documented row with what these functions derive from the
request model, so the tables cannot drift from the code.
"""

from __future__ import annotations

import json
import types
import typing
from typing import Any, Literal, Union

import annotated_types as at
from pydantic import BaseModel
from pydantic.fields import FieldInfo

_SCALARS = {str: "string", int: "integer", float: "number", bool: "boolean", type(None): "null", Any: "any"}


def type_text(tp: Any) -> str:
    """``str | list[TextPart] | None`` -> ``"string or array of TextPart or null"``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Annotated:
        return type_text(args[0])
    if origin in (Union, types.UnionType):
        return " or ".join(type_text(a) for a in args)
    if origin is Literal:
        return " or ".join(json.dumps(a) for a in args)
    if origin is list:
        inner = type_text(args[0])
        return f"array of ({inner})" if " or " in inner else f"array of {inner}"
    if origin is dict or tp is dict:
        return "object"
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return tp.__name__
    return _SCALARS[tp]


def default_text(field: FieldInfo) -> str:
    """``required``, or the default as JSON (a default factory is called)."""
    if field.is_required():
        return "required"
    return json.dumps(field.get_default(call_default_factory=True))


def _bounds(metadata: list[Any]) -> str:
    lo = next((m.ge for m in metadata if isinstance(m, at.Ge)), None)
    hi = next((m.le for m in metadata if isinstance(m, at.Le)), None)
    gt = next((m.gt for m in metadata if isinstance(m, at.Gt)), None)
    if lo is not None and hi is not None:
        return f"[{lo}, {hi}]"
    if gt is not None:
        return f"> {gt}"
    if lo is not None:
        return f">= {lo}"
    return ""


def _lengths(metadata: list[Any], tp: Any) -> str:
    lo = next((m.min_length for m in metadata if isinstance(m, at.MinLen)), None)
    hi = next((m.max_length for m in metadata if isinstance(m, at.MaxLen)), None)
    if lo is None and hi is None:
        return ""
    if str in (tp, *typing.get_args(tp)):
        return f"{lo or 0} to {hi} characters" if hi is not None else f"at least {lo} characters"
    return f"at least {lo} item" + "s" * (lo != 1)


def _value_metadata(tp: Any) -> list[Any]:
    """Constraints on the values of a ``dict[K, Annotated[V, Field(...)]]`` (possibly optional)."""
    for arg in (tp, *typing.get_args(tp)):
        if typing.get_origin(arg) is dict:
            value = typing.get_args(arg)[1]
            if typing.get_origin(value) is typing.Annotated:
                return [m for info in typing.get_args(value)[1:] for m in getattr(info, "metadata", [info])]
    return []


def range_text(field: FieldInfo) -> str:
    """``[0.0, 2.0]``, ``> 0``, ``>= 0``, ``at least 1 item``, ``1 to 64 characters``,
    ``values [-100.0, 100.0]`` (constraints on an object's values), or empty."""
    own = _bounds(field.metadata) or _lengths(field.metadata, field.annotation)
    values = _bounds(_value_metadata(field.annotation))
    return own or (f"values {values}" if values else "")


def nested_models(model: type[BaseModel]) -> list[type[BaseModel]]:
    """``model`` and every model its fields reach, in first-seen order."""
    seen: list[type[BaseModel]] = []

    def visit(tp: Any) -> None:
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            if tp not in seen:
                seen.append(tp)
                for f in tp.model_fields.values():
                    visit(f.annotation)
            return
        for arg in typing.get_args(tp):
            visit(arg)

    visit(model)
    return seen
