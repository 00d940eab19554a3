"""``GET /openapi.json`` is a valid OpenAPI document: schema-driven clients and fuzzers read it whole.

Checked with ``openapi-spec-validator`` over the routes every installed protocol mounts, and over
an in-memory builder whose GET routes take path parameters of their own (a builder's GET routes
read them by keyword, so the app declares them; FastAPI never sees them in a signature).
"""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient
from openapi_spec_validator import validate

from astrai_server import ServerSettings, create_app
from astrai_server.protocols.openai import OpenAIResponseBuilder


class PathsBuilder(OpenAIResponseBuilder):
    """OpenAI's chat, with GET routes whose path parameters have other names and converters."""

    def get_routes(self) -> dict[str, Any]:
        return {
            **super().get_routes(),
            "/things/{kind}/{number:int}": lambda engine, kind, number: {"kind": kind, "number": number},
        }


def _document(app: Any) -> dict[str, Any]:
    with TestClient(app) as client:
        r = client.get("/openapi.json")
    assert r.status_code == 200, r.text
    return r.json()


def test_the_document_of_the_installed_protocols_validates(fake_engine: Any) -> None:
    document = _document(create_app(ServerSettings(), fake_engine))
    validate(document)  # raises OpenAPIValidationError naming the first problem
    (parameter,) = document["paths"]["/v1/models/{model}"]["get"]["parameters"]
    assert parameter == {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}


def test_path_parameters_of_any_name_are_declared_and_passed(fake_engine: Any) -> None:
    app = create_app(ServerSettings(), fake_engine, builders=[PathsBuilder()])
    document = _document(app)
    validate(document)
    parameters = document["paths"]["/things/{kind}/{number}"]["get"]["parameters"]
    types = [(p["name"], p["schema"]["type"]) for p in parameters]
    assert types == [("kind", "string"), ("number", "integer")]
    with TestClient(app) as client:
        assert client.get("/things/a/7").json() == {"kind": "a", "number": 7}
        assert client.get("/v1/models/astrai").json()["id"] == "astrai"
        assert client.get("/v1/models/HuggingFaceTB/SmolLM2-135M").status_code == 404  # {model:path}: a slash
