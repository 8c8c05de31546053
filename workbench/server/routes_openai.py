"""The OpenAI-compatible router: a thin layer over serving_chat.py and serving_completion.py.

Owns: the paths `/v1/completions`, `/v1/chat/completions`, `/v1/models`, `/v1/models/{id}`,
`/health` and `/metrics`. Does not own: request handling (serving*.py) or errors (errors.py).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from workbench.server.errors import APIError
from workbench.server.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from workbench.server.serving import ServerState
from workbench.server.serving_chat import create_chat_completion
from workbench.server.serving_completion import create_completion

router = APIRouter()


def _state(request: Request) -> ServerState:
    return request.app.state.workbench


def _inline(node: Any, defs: dict[str, Any]) -> Any:
    """`node` with every `{"$ref": "#/$defs/X"}` replaced by X's schema (the models are not recursive)."""
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            return _inline(defs[ref.rsplit("/", 1)[-1]], defs)
        return {k: _inline(v, defs) for k, v in node.items() if k != "$defs"}
    if isinstance(node, list):
        return [_inline(v, defs) for v in node]
    return node


def _body_doc(model: type) -> dict:
    """OpenAPI request body for handlers that parse the body themselves (strictly, in serving.py)."""
    schema = model.model_json_schema()
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": _inline(schema, schema.get("$defs", {}))}}}}


@router.post("/v1/completions", openapi_extra=_body_doc(CompletionRequest))
async def completions(request: Request) -> Response:
    return await create_completion(_state(request), request)


@router.post("/v1/chat/completions", openapi_extra=_body_doc(ChatCompletionRequest))
async def chat_completions(request: Request) -> Response:
    return await create_chat_completion(_state(request), request)


def _card(state: ServerState) -> ModelCard:
    return ModelCard(id=state.model_name, created=state.created, max_model_len=state.engine.max_context_len())


@router.get("/v1/models")
async def list_models(request: Request) -> JSONResponse:
    return JSONResponse(ModelList(data=[_card(_state(request))]).model_dump(mode="json"))


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> JSONResponse:
    state = _state(request)
    if model_id != state.model_name:
        raise APIError(404, f"The model `{model_id}` does not exist", param="model", code="model_not_found")
    return JSONResponse(_card(state).model_dump(mode="json"))


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 while the engine thread runs and requests are accepted; 503 while shutting down."""
    loop = _state(request).loop
    if loop.accepting and loop.running:
        return JSONResponse({"status": "ok"})
    return APIError(503, "the server is shutting down", code="shutting_down").response()


@router.get("/metrics")
async def metrics(request: Request) -> PlainTextResponse:
    state = _state(request)
    openmetrics = "application/openmetrics-text" in request.headers.get("accept", "")
    text = state.metrics.render(state.loop.stats, state.hub.dropped_total, state.loop.failures,
                                model_name=state.model_name, openmetrics=openmetrics,
                                grammar=state.engine.grammars.status())
    return PlainTextResponse(text, media_type="application/openmetrics-text; version=1.0.0; charset=utf-8"
                             if openmetrics else "text/plain; version=0.0.4; charset=utf-8")
