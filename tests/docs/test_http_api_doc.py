"""docs/http-api.md against the server: request tables, mappings, routes, /stats, status codes,
transcripts."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
from docs_pages import Block, all_blocks
from goldens import GOLDENS
from model_fields import default_text, nested_models, range_text, type_text
from pydantic import BaseModel

from astrai_server.protocols.anthropic import AnthropicResponseBuilder
from astrai_server.protocols.completions import CompletionsResponseBuilder
from astrai_server.protocols.openai import OpenAIResponseBuilder
from astrai_server.protocols.responses import ResponsesBuilder

BUILDERS = [OpenAIResponseBuilder, AnthropicResponseBuilder, CompletionsResponseBuilder, ResponsesBuilder]
REQUEST_MODELS = [b.request_model for b in BUILDERS]


def _ids(blocks: list[Block]) -> list[str]:
    return [f"{b.page}:{b.line}:{b.argument or b.kind}" for b in blocks]


def _resolve(argument: str) -> Any:
    module, _, name = argument.partition(":")
    return getattr(importlib.import_module(module), name)


def _one(kind: str) -> Block:
    blocks = all_blocks(kind)
    assert len(blocks) == 1, f"expected one <!-- {kind} --> block, found {_ids(blocks)}"
    return blocks[0]


def test_every_model_a_request_reaches_has_one_table() -> None:
    expected = [f"{b.__module__}:{m.__name__}" for b in BUILDERS for m in nested_models(b.request_model)]
    documented = [b.argument for b in all_blocks("fields")]
    assert sorted(documented) == sorted(expected), (
        "document each request model exactly once, and nothing else"
    )


FIELD_TABLES = all_blocks("fields")


@pytest.mark.parametrize("block", FIELD_TABLES, ids=_ids(FIELD_TABLES))
def test_field_table_matches_the_model(block: Block) -> None:
    model: type[BaseModel] = _resolve(block.argument)
    rows = {r["Field"]: r for r in block.records()}
    fields = model.model_fields
    assert not set(fields) - set(rows), f"{block.where}: fields of {model.__name__} not documented"
    assert not set(rows) - set(fields), f"{block.where}: documented fields {model.__name__} does not have"
    for name, field in fields.items():
        row = rows[name]
        assert row["Type"] == type_text(field.annotation), f"{block.where}: type of {name}"
        assert row["Default"] == default_text(field), f"{block.where}: default of {name}"
        assert row.get("Range", "") == range_text(field), f"{block.where}: range of {name}"
        if model in REQUEST_MODELS:
            assert row["Behaviour"], f"{block.where}: say what {name} does"


MAPPINGS = all_blocks("mapping")


@pytest.mark.parametrize("block", MAPPINGS, ids=_ids(MAPPINGS))
def test_mapping_table_equals_the_code(block: Block) -> None:
    documented = [tuple(r.values()) for r in block.records()]
    assert documented == [(str(k), str(v)) for k, v in _resolve(block.argument).items()], block.where


def test_status_map_is_the_servers() -> None:
    from astrai_server.errors import STATUS_BY_ERROR

    documented = [(r["Error class"], int(r["Status"])) for r in _one("status-map").records()]
    assert documented == [(cls.__name__, status) for cls, status in STATUS_BY_ERROR]


def test_endpoint_table_lists_every_route_the_server_mounts() -> None:
    from astrai.hooks import PluginManager
    from astrai_server import ServerSettings, create_app

    app = create_app(ServerSettings(), None, [b() for b in BUILDERS], plugins=PluginManager())
    mounted = {(method, route.path) for route in app.routes for method in route.methods - {"HEAD"}}
    documented = {(r["Method"], r["Path"]) for r in _one("endpoints").records()}
    assert documented == mounted


def test_stats_table_lists_exactly_what_get_stats_returns(tiny_engine: Any, client: Any) -> None:
    documented = [r["Field"] for r in _one("stats-fields").records()]
    assert len(documented) == len(set(documented))
    assert set(documented) == set(tiny_engine.get_stats())
    r = client.get("/stats")
    assert r.status_code == 200 and set(r.json()) == set(documented)


GOLDEN_BLOCKS = all_blocks("golden")


def test_each_golden_is_shown_once() -> None:
    assert sorted(b.argument for b in GOLDEN_BLOCKS) == sorted(GOLDENS)


@pytest.mark.parametrize("block", GOLDEN_BLOCKS, ids=_ids(GOLDEN_BLOCKS))
def test_golden_block_is_what_the_code_produces(block: Block, client: Any) -> None:
    expected = GOLDENS[block.argument](client)
    assert block.text == expected, f"{block.where} should read:\n{expected}"
