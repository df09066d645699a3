"""Ollama's API: /api/chat and /api/generate (NDJSON streams by default), /api/tags,
/api/show, /api/ps, /api/version; what does not map onto this engine (pull, push,
create, copy, delete, embed) is a 400 in Ollama's error shape.

A request becomes the server's conversation (conversation.py) and the engine options,
as an OpenAI request does, and runs the same gated path (turns.py); shapes.py lays out
the answer, errors included.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib.metadata import version
from typing import Any

from fastapi import APIRouter, Depends, Request

from ...options.registry import model_ids
from ...prompt.messages import raw_message
from ...reply.events import ToolCall
from ..catalog import LATEST, Checkpoint, checkpoint
from ..conversation import ChatMessage, ImagePart, llm_chain, text_message
from ..errors import ApiError, api_routes
from ..openai.tools import function_specs
from ..keep_alive import after_reply
from ..turns import answer
from .schemas import ChatRequest, GenerateRequest, OllamaError, ShowRequest
from .shapes import GenerateShape, OllamaChatShape, error_body, stamp

# The Ollama release whose routes and fields this server follows (tools, thinking, logprobs), answered
# by /api/version: clients refuse a server older than they need (VS Code's Copilot: 0.6.4)
OLLAMA_VERSION = "0.13.0"
# Ollama's routes that do not map onto this engine: refused in Ollama's error shape.
REFUSED = ("pull", "push", "create", "copy", "delete", "embed", "embeddings")


def chat_messages(messages) -> list[ChatMessage]:
    """Ollama's messages as the server's conversation. Ollama's calls have no ids: each
    gets one, and a tool message answers the earliest open call of its tool_name."""
    out, open_calls = [], []
    for i, m in enumerate(messages):
        if m.role == "tool":
            call = next((c for c in open_calls if m.tool_name in (None, c.name)), None)
            if call is None:
                raise ApiError(400, f"messages.{i}: a tool result that answers no call of an earlier assistant "
                               "message", param=f"messages.{i}")
            open_calls.remove(call)
            out.append(ChatMessage("tool", [m.content], tool_call_id=call.id))
            continue
        calls = [ToolCall(f"call_{i}_{j}", c.function.name, c.function.arguments)
                 for j, c in enumerate(m.tool_calls or [])]
        if m.role == "assistant":
            open_calls = list(calls)
        out.append(ChatMessage(m.role, with_images(m.content, m.images), m.thinking or "", calls))
    return out


def with_images(text: str, images) -> list:
    """A message's text with Ollama's base64 images before it (their type is read off
    their bytes: Ollama gives none)."""
    return [*(ImagePart(f"data:;base64,{data}") for data in images or []), text]


def details(found: Checkpoint | None) -> dict:
    if found is None:
        return {"format": "safetensors"}
    return {"format": "safetensors", "family": found.family, "families": [found.family],
            "parameter_size": found.parameter_size, "quantization_level": found.quantization}


def listed(model_id: str) -> dict:
    """A model as /api/tags and /api/ps list it: named with Ollama's default tag, as Ollama does."""
    found = checkpoint(model_id)
    entry = {"name": model_id + LATEST, "model": model_id + LATEST, "details": details(found)}
    if found is not None:
        entry.update(modified_at=stamp(found.modified_at), size=found.size, digest=found.digest)
    return entry


@dataclass
class Prompted:
    """What an Ollama generation request asks of the core: llm's messages (none: load the
    model, or unload it with keep_alive 0), the tools' function specs, the reply's shape."""

    shape: Any
    messages: list
    tools: list = field(default_factory=list)


async def run(service, request: Request, body, prompted: Prompted):
    """Answer `prompted`; with no messages, load the model or unload it (Ollama's way)."""
    model_id, shape = service.model_for(body.model), prompted.shape
    if not prompted.messages:
        if body.unloads():
            await service.unload(model_id)
            return shape.status("unload")
        await service.load(model_id)
        reply = shape.status("load")
    else:
        reply = await answer(service, request, shape, model_id, prompted.messages, body.plugin_options(),
                             body.schema_dict(), body.stream, prompted.tools)
    await after_reply(service, model_id, body, body.stream)
    return reply


async def chat_prompted(service, body: ChatRequest) -> Prompted:
    messages = await llm_chain(service, service.model_for(body.model), chat_messages(body.messages))
    return Prompted(OllamaChatShape(body.model), messages, function_specs(body.tools))


async def generate_prompted(service, body: GenerateRequest) -> Prompted:
    """The prompt as it is (`raw`), or in the chat template after the system prompt."""
    if not body.prompt:
        messages = []
    elif body.raw:
        messages = [raw_message(body.prompt)]
    else:
        system = [text_message("system", body.system)] if body.system else []
        chat = [*system, ChatMessage("user", with_images(body.prompt, body.images))]
        messages = await llm_chain(service, service.model_for(body.model), chat)
    return Prompted(GenerateShape(body.model), messages)


def shown(service, body: ShowRequest) -> dict:
    """What a model's checkpoint says about it, as Ollama's /api/show does."""
    found = checkpoint(service.model_for(body.model))
    template = found.template if found else ""
    capabilities = ["completion"] + [c for c, mark in (("tools", "tools"), ("thinking", "think"))
                                     if mark in template]  # what the chat template reads
    if service.takes_images(service.model_for(body.model)):
        capabilities.append("vision")
    info = {"general.architecture": found.family if found else ""}
    if found is not None and found.context_length:
        info[f"{found.family}.context_length"] = found.context_length
    return {"modelfile": f"FROM {service.model_for(body.model)}{LATEST}\n", "parameters": "", "template": template,
            "details": details(found),
            "model_info": info, "capabilities": capabilities,
            **({"modified_at": stamp(found.modified_at)} if found else {})}


async def loaded(service) -> dict:
    """The models loaded now, as Ollama's /api/ps lists them, with this engine's figures."""
    models = []
    for model_id, resident in service.resident().items():
        due = service.unload_due.get(model_id)
        held = resident.held_bytes()
        models.append({**listed(model_id), "size_vram": 0, "context_length": await service.context(model_id),
                       "expires_at": stamp(due) if due is not None else "9999-12-31T23:59:59Z",  # until told
                       "memory_bytes": held, "expert_slots": resident.slots, "pinned": resident.pinned})
    return {"models": models}


def router(service) -> APIRouter:
    errors = {status: {"model": OllamaError} for status in (400, 401, 403, 404, 413, 503)}
    api = APIRouter(dependencies=[Depends(service.check_api_key)], tags=["Ollama"], responses=errors,
                    route_class=api_routes("ollama", error_body))

    @api.post("/api/chat", description="Ollama's chat; NDJSON chunks unless stream is false")
    async def chat(body: ChatRequest, request: Request):
        service.accept(request, body)
        return await run(service, request, body, await chat_prompted(service, body))

    @api.post("/api/generate", description="Ollama's completion; NDJSON chunks unless stream is false")
    async def generate(body: GenerateRequest, request: Request):
        service.accept(request, body)
        return await run(service, request, body, await generate_prompted(service, body))

    @api.get("/api/tags", description="The models served, as Ollama lists them")
    async def tags() -> dict:
        return {"models": [listed(i) for i in model_ids()]}

    @api.post("/api/show", description="What a model's checkpoint says about it")
    async def show(body: ShowRequest, request: Request) -> dict:
        service.accept(request, body)
        return shown(service, body)

    @api.get("/api/ps", description="The models loaded now: memory, expert slots per layer, expiry")
    async def ps() -> dict:
        return await loaded(service)

    @api.get("/api/version", description=f"The Ollama version whose API this server follows ({OLLAMA_VERSION}), "
             "for clients' minimum-version checks; mlx_stream_version: this plugin's")
    async def ollama_version() -> dict:
        return {"version": OLLAMA_VERSION, "mlx_stream_version": version("llm-mlx-streaming")}

    for name in REFUSED:
        api.add_api_route(f"/api/{name}", _refusal(name), methods=["POST", "DELETE"] if name == "delete" else ["POST"],
                          include_in_schema=False)
    return api


def _refusal(name: str):
    async def refuse() -> None:
        raise ApiError(400, f"/api/{name} is not served: this server runs the models added with `llm mlxs add` "
                       "(see /api/tags)")

    return refuse
