"""OpenAI's routes: /v1/models, /v1/chat/completions and /v1/completions.

Each route builds the request's record (turns.Asked: its conversation, options, tools,
schema, shape) for the one answer pipeline (turns.answer); shapes.py lays out the answer.
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Depends, Request

from ...options.registry import model_ids
from ..errors import ApiError, api_routes
from ..turns import Asked, answer
from .schemas import (ChatCompletion, ChatCompletionRequest, Completion, CompletionRequest, ErrorResponse, ModelCard,
                      ModelList)
from .shapes import ChatCompletionShape, CompletionShape
from .tools import function_specs


def router(service) -> APIRouter:
    errors = {status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 422, 503)}
    api = APIRouter(dependencies=[Depends(service.policy.check_api_key)], tags=["OpenAI"], responses=errors,
                    route_class=api_routes("openai"))

    @api.get("/v1/models", response_model=ModelList)
    async def models() -> dict:
        created, loaded = int(time.time()), _loaded(service)
        return {"object": "list", "data": [card(i, created, loaded) for i in model_ids()]}

    @api.get("/v1/models/{model:path}", response_model=ModelCard, description="One model (the openai client's "
             "models.retrieve): an id of /v1/models, or any name a request's model field may give")
    async def model(model: str) -> dict:
        return card(service.policy.model_for(model), int(time.time()), _loaded(service))

    @api.post("/v1/embeddings", include_in_schema=False)
    async def embeddings() -> None:
        raise ApiError(404, "/v1/embeddings is not supported by this server: its models generate text "
                       "(/v1/chat/completions, /v1/completions, /v1/responses)", code="unsupported_endpoint")

    @api.post("/v1/chat/completions", responses={200: {"model": ChatCompletion, "description":
              "The reply, or with stream: true an SSE stream of chat.completion.chunk objects"}})
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await answer(service, request, Asked(
            body, lambda model_id: ChatCompletionShape(model_id, body), chat=[m.message() for m in body.messages],
            fields=body.plugin_options(), tools=function_specs(body.tools), schema=_schema(body)))

    @api.post("/v1/completions", responses={200: {"model": Completion, "description":
              "The text, or with stream: true an SSE stream of text_completion objects"}})
    async def completions(body: CompletionRequest, request: Request):
        return await answer(service, request, Asked(
            body, lambda model_id: CompletionShape(model_id, body), raw=body.text(), fields=body.plugin_options(),
            schema=_schema(body), suffix=body.suffix))

    return api


def card(model_id: str, created: int, loaded: set[str]) -> dict:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "mlx-stream", "loaded": model_id in loaded}


def _loaded(service) -> set[str]:
    """The ids of the models loaded now."""
    return {i for h in service.hosting.models() for i in h.ids}


def _schema(body):
    return body.response_format.schema_dict() if body.response_format else None
