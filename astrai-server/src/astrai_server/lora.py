"""LoRA adapters while serving: vLLM's ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``,
and the adapters' ``/v1/models`` cards.

Load: ``{"lora_name": ..., "lora_path": ...}`` (a PEFT folder, a GGUF LoRA file or a Hub id), read on
a worker thread (the scheduler never waits for it); 200 and vLLM's text once it serves, 400 for an
adapter that cannot be loaded (the message names the problem: no such path, not a LoRA, a rank
over ``--max-lora-rank``, a module the model has not, another base model, a name in use), 409
when every slot of ``--max-loras`` has requests in flight (an idle one is evicted otherwise).
Unload: ``{"lora_name": ...}``; 200 at once, 404 for a name not loaded. The requests in flight on
it finish on its weights; new ones get 404 ``model_not_found``. Both routes need a key when keys
are set, an operator's (``--admin-api-key``) when operator keys are set; 400 where adapters are
not enabled (``--enable-lora``).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from astrai.errors import EngineNotReady, RequestRejected
from astrai_server.request_parts import Strict

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["LoadLora", "UnloadLora", "adapter_cards", "lora_routes"]


class LoadLora(Strict):
    lora_name: str
    lora_path: str
    load_inplace: bool = False  # vLLM's: replace an adapter of that name (refused: unload it first)


class UnloadLora(Strict):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's; the name decides


def adapter_cards(engine: Any, parent: str, created: int) -> list[dict[str, Any]]:
    """``/v1/models`` entries of the loaded adapters (vLLM's: ``root`` the path, ``parent`` the model)."""
    loras = getattr(engine, "loras", None)
    if loras is None:
        return []
    limit = engine.context_limit
    return [
        {
            "id": a.name,
            "object": "model",
            "created": int(a.created) or created,
            "owned_by": "astrai",
            "root": a.path,
            "parent": parent,
            "context_length": limit,
            "max_model_len": limit,
            "lora_rank": a.rank,
        }
        for a in loras.adapters
    ]


def lora_routes(check_key: Callable[[Any], None]) -> dict[str, Any]:
    """Path -> endpoint of the two adapter routes."""
    from fastapi import Request
    from fastapi.responses import PlainTextResponse, Response

    from astrai_server.body import read_body
    from astrai_server.embeddings import error_response

    def manager(request: Any) -> Any:
        check_key(request)
        engine = request.app.state.engine
        if engine is None:
            raise EngineNotReady("the model is still loading")
        if getattr(engine, "loras", None) is None:
            raise RequestRejected("LoRA adapters are not enabled: start the server with --enable-lora")
        return engine.loras

    def route(model: type[Strict], act: Callable[[Any, Any], str]) -> Callable[..., Any]:
        async def endpoint(request: Request) -> Response:
            try:
                loras = manager(request)
                raw = await read_body(request, request.app.state.settings.max_request_bytes)
                body = model.model_validate_json(bytes(raw))
                text = await asyncio.get_running_loop().run_in_executor(None, act, loras, body)
                return PlainTextResponse(text)
            except (
                Exception
            ) as exc:  # a key refused, a bad body or adapter: OpenAI's error shape, never a bare 500
                return error_response(exc)

        endpoint.__annotations__.update({"request": Request, "return": Response})
        return endpoint

    def load(loras: Any, body: LoadLora) -> str:
        from astrai.lora import resolve_adapter

        if body.load_inplace:
            raise RequestRejected(
                "load_inplace is not supported: unload the adapter first", param="load_inplace"
            )
        loras.load(body.lora_name, resolve_adapter(body.lora_path), time.time())
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    def unload(loras: Any, body: UnloadLora) -> str:
        loras.unload(body.lora_name)
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."

    return {
        "/v1/load_lora_adapter": route(LoadLora, load),
        "/v1/unload_lora_adapter": route(UnloadLora, unload),
    }
