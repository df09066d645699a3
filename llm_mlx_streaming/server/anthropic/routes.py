"""The Anthropic Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`.

A request becomes its record (turns.Asked: its conversation, options, tools, schema,
shape), as an OpenAI request does, for the same answer pipeline (turns.answer); only the
layout of the answer is Anthropic's (shapes.py), errors included.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from ...prompt.tools import function_spec
from ...reply.events import ToolCall
from ..conversation import ChatMessage, ImagePart, text_message
from ..errors import ApiError, api_routes
from ..turns import Asked, answer, count
from .schemas import AnthropicError, CountTokensRequest, MessagesRequest
from .shapes import MessageShape, error_body


def chat_messages(body) -> list[ChatMessage]:
    """The system prompt and the messages as the server's conversation (a user message's
    tool results become tool messages); a block this server cannot take is a 400 naming it."""
    out = [text_message("system", system)] if (system := body.system_text()) else []
    for i, message in enumerate(body.messages):
        parts, reasoning, calls, results = [], [], [], []
        for j, block in enumerate(message.blocks()):
            where = f"messages.{i}.content.{j}"
            if block.type == "text":
                parts.append(block.text)
            elif block.type == "image" and message.role == "user":
                parts.append(_image(block, where))
            elif block.type == "thinking" and message.role == "assistant":
                reasoning.append(block.thinking)
            elif block.type == "tool_use" and message.role == "assistant":
                calls.append(ToolCall(block.id, block.name, block.input))
            elif block.type == "tool_result" and message.role == "user" and not block.images():
                results.append(ChatMessage("tool", [block.text()], tool_call_id=block.tool_use_id))
            elif block.type == "tool_result" and message.role == "user":
                raise ApiError(400, f"{where}: an image in a tool result is not taken (send it in the user "
                               "message's content)", param=where)
            else:
                raise ApiError(400, f"{where}: a {block.type} block is not taken in a {message.role} message",
                               param=where)
        out.extend(results)
        if message.role == "assistant" or parts or not results:
            out.append(ChatMessage(message.role, parts, "".join(reasoning), calls))
    if body.messages[-1].role == "assistant":
        raise ApiError(400, "messages: the last message must be the user's (an assistant prefill is not "
                       "continued by this server)", param="messages")
    return out


def asked(body) -> Asked:
    """The request's record; the billing line is named among the hints that change nothing."""
    return Asked(body, MessageShape, chat=chat_messages(body), fields=body.plugin_options(),
                 tools=function_specs(body), schema=body.schema_dict(),
                 ignored=[BILLING_HINT] if body.billing_line() else [])


BILLING_HINT = "system.x-anthropic-billing-header"


def _image(block, where: str) -> ImagePart:
    try:
        return ImagePart(block.url())
    except ValueError as e:
        raise ApiError(400, f"{where}: {e}", param=where) from None


def function_specs(body) -> list[dict]:
    """The request's tools as the chat template's function specs (the server never runs them)."""
    return [function_spec(t.name, t.description, t.input_schema) for t in body.tools or []]


def router(service) -> APIRouter:
    errors = {status: {"model": AnthropicError} for status in (400, 401, 403, 404, 413, 503)}
    api = APIRouter(dependencies=[Depends(service.policy.check_api_key)], tags=["Anthropic"], responses=errors,
                    route_class=api_routes("anthropic", error_body))

    @api.post("/v1/messages", description="Anthropic's Messages API; with stream: true its event stream")
    async def messages(body: MessagesRequest, request: Request):
        return await answer(service, request, asked(body))

    @api.post("/v1/messages/count_tokens", description="The prompt's tokens, rendered as /v1/messages would")
    async def count_tokens(body: CountTokensRequest, request: Request) -> dict:
        return {"input_tokens": await count(service, request, asked(body))}

    return api
