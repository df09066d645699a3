"""OpenAI's Responses API: `POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`.

The input items become the server's conversation (conversation.py), as an OpenAI chat
request's messages do (reasoning given back rides on the next assistant message,
function calls on it too, their outputs are tool messages), the tools the same function
specs, in the request's record (turns.Asked) for the same answer pipeline (turns.answer);
shapes.py lays out the answer. A stored response keeps its conversation and reply (with the ids it was
generated as), so `previous_response_id` continues it on the same tokens and the KV
cache is reused.
"""

from __future__ import annotations

import hashlib
from typing import Optional

from fastapi import APIRouter, Depends, Request

from ...prompt.tools import function_spec
from ...reply.events import ToolCall
from ..conversation import ChatMessage, ImagePart, call_arguments, text_message
from ..errors import ApiError, api_routes
from ..openai.schemas import ErrorResponse
from ..response_store import Kept
from ..transcript import Transcript
from ..turns import Asked, answer, count
from .schemas import (CustomTool, CustomToolCallItem, CustomToolCallOutputItem, FilePart, FunctionCallItem,
                      FunctionCallOutputItem, FunctionTool, InputImage, JsonObjectFormat, JsonSchemaFormat, MessageItem,
                      NamespaceTool, ReasoningItem, ResponseRequest, SPELLED, TextPart)
from .shapes import ResponseShape

CUSTOM_INPUT = {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}


def chat_messages(body: ResponseRequest) -> list[ChatMessage]:
    """The input items as the server's conversation; a part or item this server cannot
    take is a 400 naming it."""
    items = [MessageItem(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    out: list[ChatMessage] = []
    reasoning = ""
    for i, item in enumerate(items):
        if isinstance(item, ReasoningItem):
            reasoning += item.text()
        elif isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            if role == "assistant":
                out.append(ChatMessage(role, [_text(item.content, f"input.{i}.content")], reasoning))
                reasoning = ""
            elif role == "user":
                out.append(ChatMessage(role, _user_parts(item.content, f"input.{i}.content")))
            else:
                out.append(text_message(role, _text(item.content, f"input.{i}.content")))
        elif isinstance(item, (FunctionCallItem, CustomToolCallItem)):
            call = ToolCall(item.call_id, item.name, _arguments(item, f"input.{i}.arguments"))
            last = out[-1] if out else None
            if last is not None and last.role == "assistant" and not reasoning:  # calls of one reply
                last.calls.append(call)
            else:
                out.append(ChatMessage("assistant", [""], reasoning, [call]))
                reasoning = ""
        elif isinstance(item, (FunctionCallOutputItem, CustomToolCallOutputItem)):
            out.append(ChatMessage("tool", [_text(item.output, f"input.{i}.output")], tool_call_id=item.call_id))
    return out


def _arguments(item, where: str) -> dict:
    """A call's arguments given back: a function's JSON text, a custom tool's input."""
    if isinstance(item, CustomToolCallItem):
        return {"input": item.input}
    try:
        return call_arguments(item.arguments)
    except ValueError as e:
        raise ApiError(400, f"{where}: {e}", param=where) from None


def _text(content, where: str) -> str:
    """Content that is text only: an image or a file in it is a 400 naming it."""
    if isinstance(content, str):
        return content
    for j, part in enumerate(content):
        if isinstance(part, InputImage):
            raise ApiError(400, f"{where}.{j}: an input_image is taken only in a user message",
                           param=f"{where}.{j}")
        if isinstance(part, FilePart):
            _refuse_file(part, f"{where}.{j}")
    return "".join(part.value() for part in content)


def _user_parts(content, where: str) -> list:
    """A user message's text, or with images its parts in order."""
    if isinstance(content, str) or not any(isinstance(p, InputImage) for p in content):
        return [_text(content, where)]
    return [_user_part(part, f"{where}.{j}") for j, part in enumerate(content)]


def _user_part(part, where: str):
    if isinstance(part, TextPart):
        return part.value()
    if isinstance(part, FilePart):
        _refuse_file(part, where)
    try:
        return ImagePart(part.url())
    except ValueError as e:
        raise ApiError(400, f"{where}.{e}", param=where) from None


def _refuse_file(part: FilePart, where: str):
    raise ApiError(400, f"{where}: an {part.type}: the models served here read text and images", param=where)


class Tools:
    """The request's tools as the template's function specs: a namespace's functions
    flattened (and remembered, for the calls' `namespace`), a custom tool as a function
    of one string `input`, a hosted tool dropped (named back: nothing here can run it)."""

    def __init__(self, body: ResponseRequest) -> None:
        self.specs: list[dict] = []
        self.custom: dict[str, CustomTool] = {}
        self.namespaces: dict[str, str] = {}
        self.dropped: list[str] = []
        for tool in body.tools or []:
            if isinstance(tool, NamespaceTool):
                for inner in tool.tools:
                    self.namespaces[inner.name] = tool.name
                    self._add(inner)
            elif isinstance(tool, (FunctionTool, CustomTool)):
                self._add(tool)
            else:
                self.dropped.append(f"tools.{tool.type}")

    def _add(self, tool) -> None:
        if isinstance(tool, CustomTool):
            self.custom[tool.name] = tool
            self.specs.append(function_spec(tool.name, tool.description, CUSTOM_INPUT))
        else:
            self.specs.append(function_spec(tool.name, tool.description, tool.parameters))


def owner(request: Request) -> Optional[str]:
    """Who a stored response belongs to: a digest of the key the request came with."""
    key = request.headers.get("authorization", "").removeprefix("Bearer ").strip() or request.headers.get("x-api-key")
    return hashlib.sha256(key.encode()).hexdigest() if key else None


def _owner(service, request: Request) -> Optional[str]:
    """Whose responses the request sees: its key's (none where the server has no key)."""
    return owner(request) if service.policy.api_key else None


def kept(service, response_id: str, request: Request, param: Optional[str] = None) -> Kept:
    """The stored response `response_id` the request's key may see; a 404 otherwise."""
    found = service.responses.find(response_id, _owner(service, request))
    if found is None:
        raise ApiError(404, f"no response {response_id!r} is kept here (unknown, made with another key, "
                       "or dropped as the oldest: see the max_responses setting)", code="response_not_found",
                       param=param)
    return found


def asked(service, body: ResponseRequest, request: Request) -> Asked:
    """The request's record: the stored conversation it continues, then its input; its
    hosted tools dropped and named; stored once complete (unless `store` is false)."""
    earlier = kept(service, body.previous_response_id, request, "previous_response_id").messages \
        if body.previous_response_id else []
    tools = Tools(body)
    system = [text_message("system", body.instructions)] if body.instructions else []
    chat = [*earlier, *chat_messages(body)]
    forced = body.forced_custom()

    def shape(model_id: str) -> ResponseShape:
        return ResponseShape(model_id, _echo(body), custom=frozenset(tools.custom), namespaces=tools.namespaces,
                             forced_custom=forced)

    def store(transcript: Transcript, shape: ResponseShape) -> None:
        """The finished response kept, with the conversation it continued and its reply."""
        if body.store is not False:
            service.responses.keep(shape.finished["id"], Kept(_owner(service, request),
                                                              [*chat, _reply_message(transcript)], shape.finished))

    return Asked(body, shape, chat=[*system, *chat], fields=body.plugin_options(),
                 tools=[] if forced is not None else tools.specs,  # a custom tool's input is the whole reply
                 schema=_schema(body), grammar=_grammar(body, tools), ignored=tools.dropped, spelled=SPELLED,
                 done=store)


def delete_response(service, response_id: str, request: Request) -> dict:
    kept(service, response_id, request)
    service.responses.drop(response_id, _owner(service, request))
    return {"id": response_id, "object": "response.deleted", "deleted": True}


def router(service) -> APIRouter:
    errors = {status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 422, 503)}
    api = APIRouter(dependencies=[Depends(service.policy.check_api_key)], tags=["OpenAI Responses"], responses=errors,
                    route_class=api_routes("responses"))

    @api.post("/v1/responses", description="OpenAI's Responses API; with stream: true its event stream")
    async def create(body: ResponseRequest, request: Request):
        return await answer(service, request, asked(service, body, request))

    @api.post("/v1/responses/input_tokens", description="The input's tokens, rendered as /v1/responses would")
    async def input_tokens(body: ResponseRequest, request: Request) -> dict:
        return {"object": "response.input_tokens",
                "input_tokens": await count(service, request, asked(service, body, request))}

    @api.get("/v1/responses/{response_id}", description="A stored response")
    async def retrieve(response_id: str, request: Request) -> dict:
        return kept(service, response_id, request).body

    @api.delete("/v1/responses/{response_id}", description="Forget a stored response")
    async def delete(response_id: str, request: Request) -> dict:
        return delete_response(service, response_id, request)

    return api


def _grammar(body: ResponseRequest, tools: Tools) -> Optional[tuple[str, str]]:
    """The grammar of the custom tool the whole reply is the input of (tool_choice), if it has one."""
    name = body.forced_custom()
    if name is None:
        return None
    tool = tools.custom.get(name)
    if tool is None:
        raise ApiError(400, f"tool_choice: no custom tool is named {name!r}", param="tool_choice")
    fmt = tool.format
    return (fmt.syntax, fmt.definition) if fmt is not None and fmt.type == "grammar" else None


def _schema(body: ResponseRequest) -> Optional[dict]:
    fmt = body.text.format if body.text else None
    if isinstance(fmt, JsonSchemaFormat):
        return fmt.schema_
    return {"type": "object"} if isinstance(fmt, JsonObjectFormat) else None


def _echo(body: ResponseRequest) -> dict:
    """The request's fields a response repeats."""
    return {"instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "tool_choice": body.tool_choice if isinstance(body.tool_choice, str) else
            body.tool_choice.model_dump() if body.tool_choice is not None else "auto", "tools": [t.model_dump(by_alias=True) for t in body.tools or []],
            "temperature": body.temperature, "top_p": body.top_p, "metadata": body.metadata or {},
            "store": body.store is not False, "text": body.text.model_dump(by_alias=True) if body.text else
            {"format": {"type": "text"}}, "reasoning": body.reasoning.model_dump() if body.reasoning else None,
            "truncation": "disabled", "user": body.user}


def _reply_message(transcript: Transcript) -> ChatMessage:
    """The reply as the next request's history: its text, reasoning, calls and token ids."""
    outcome = transcript.outcome
    return ChatMessage("assistant", [transcript.text], transcript.reasoning, outcome.complete_calls(),
                       tokens=outcome.tokens or None)
