"""OpenAI's routes: /v1/models, /v1/chat/completions and /v1/completions.

Each route builds the request's record (turns.Asked: its conversation, options, tools,
schema, shape) for the one answer pipeline (turns.answer); shapes.py lays out the answer.
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Depends, Request

from ...options.registry import model_ids
from ..errors import api_routes
from ..turns import Asked, answer
from .schemas import ChatCompletion, ChatCompletionRequest, Completion, CompletionRequest, ErrorResponse, ModelList
from .shapes import ChatCompletionShape, CompletionShape
from .tools import function_specs


def router(service) -> APIRouter:
    errors = {status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 422, 503)}
    api = APIRouter(dependencies=[Depends(service.policy.check_api_key)], tags=["OpenAI"], responses=errors,
                    route_class=api_routes("openai"))

    @api.get("/v1/models", response_model=ModelList)
    async def models() -> dict:
        created, loaded = int(time.time()), {i for h in service.hosting.models() for i in h.ids}
        return {"object": "list", "data": [{"id": i, "object": "model", "created": created, "owned_by": "mlx-stream",
                                            "loaded": i in loaded} for i in model_ids()]}

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


def _schema(body):
    return body.response_format.schema_dict() if body.response_format else None
