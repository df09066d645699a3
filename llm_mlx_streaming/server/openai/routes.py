"""OpenAI's routes: /v1/models, /v1/chat/completions and /v1/completions.

A request becomes the server's conversation (conversation.py), llm's messages and the
plugin's options, and runs the gated path (turns.py); shapes.py lays out the answer.
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Depends, Request

from ...options.registry import model_ids
from ...prompt.messages import raw_message
from ..errors import ApiError, api_routes
from ..conversation import llm_chain
from ..keep_alive import after_reply
from ..turns import answer
from .schemas import (ChatCompletion, ChatCompletionRequest, Completion, CompletionRequest, ErrorResponse, ModelCard,
                      ModelList)
from .shapes import ChatCompletionShape, CompletionShape
from .tools import function_specs


def router(service) -> APIRouter:
    errors = {status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 422, 503)}
    api = APIRouter(dependencies=[Depends(service.check_api_key)], tags=["OpenAI"], responses=errors,
                    route_class=api_routes("openai"))

    async def generate(request: Request, body, shape, messages: list, tools=(), suffix=None):
        """Answer `body` (its plugin options, among them tool_choice and parallel_tool_calls)
        with `messages` (llm's) and `tools` (function specs)."""
        model_id = service.model_for(body.model)
        schema = body.response_format.schema_dict() if body.response_format else None
        reply = await answer(service, request, shape(model_id, body), model_id, messages,
                             body.plugin_options(), schema, body.stream, tools, suffix=suffix)
        await after_reply(service, model_id, body, body.stream)
        return reply

    @api.get("/v1/models", response_model=ModelList)
    async def models() -> dict:
        created, loaded = int(time.time()), service.loaded_ids()
        return {"object": "list", "data": [card(i, created, loaded) for i in model_ids()]}

    @api.get("/v1/models/{model:path}", response_model=ModelCard, description="One model (the openai client's "
             "models.retrieve): an id of /v1/models, or any name a request's model field may give")
    async def model(model: str) -> dict:
        return card(service.model_for(model), int(time.time()), service.loaded_ids())

    @api.post("/v1/embeddings", include_in_schema=False)
    async def embeddings() -> None:
        raise ApiError(404, "/v1/embeddings is not supported by this server: its models generate text "
                       "(/v1/chat/completions, /v1/completions, /v1/responses)", code="unsupported_endpoint")

    @api.post("/v1/chat/completions", responses={200: {"model": ChatCompletion, "description":
              "The reply, or with stream: true an SSE stream of chat.completion.chunk objects"}})
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        service.accept(request, body)
        messages = await llm_chain(service, service.model_for(body.model), [m.message() for m in body.messages])
        return await generate(request, body, ChatCompletionShape, messages, function_specs(body.tools))

    @api.post("/v1/completions", responses={200: {"model": Completion, "description":
              "The text, or with stream: true an SSE stream of text_completion objects"}})
    async def completions(body: CompletionRequest, request: Request):
        service.accept(request, body)
        return await generate(request, body, CompletionShape, [raw_message(body.text())], suffix=body.suffix)

    return api


def card(model_id: str, created: int, loaded: set[str]) -> dict:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "mlx-stream", "loaded": model_id in loaded}
