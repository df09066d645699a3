"""Ollama's API: /api/chat and /api/generate (NDJSON streams by default), /api/tags,
/api/show, /api/ps, /api/version; what does not map onto this engine (pull, push,
create, copy, delete, embed) is a 400 in Ollama's error shape.

A request becomes its record (turns.Asked), as an OpenAI request does, for the same
answer pipeline (turns.answer); one without messages loads the model, or with keep_alive
0 unloads it (Ollama's way); shapes.py lays out the answer, errors included.
"""

from __future__ import annotations

from importlib.metadata import version

from fastapi import APIRouter, Depends, Request

from ...options.registry import model_ids
from ...prompt.messages import raw_message
from ...reply.events import ToolCall
from ..catalog import LATEST, Checkpoint, checkpoint
from ..conversation import ChatMessage, ImagePart, text_message
from ..errors import ApiError, api_routes
from ..openai.tools import function_specs
from ..turns import Asked, answer
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


async def run(service, request: Request, asked: Asked):
    """Answer `asked`; with no messages, load the model or unload it (Ollama's way)."""
    if asked.chat or asked.raw is not None:
        return await answer(service, request, asked)
    body = asked.body
    service.policy.accept(request, body)
    model_id = service.policy.model_for(body.model)
    if body.unloads():
        await service.hosting.unload(model_id)
        return asked.shape(model_id).status("unload")
    await service.hosting.load(model_id, body.keep_seconds())
    return asked.shape(model_id).status("load")


def chat_asked(body: ChatRequest) -> Asked:
    return Asked(body, lambda _: OllamaChatShape(body.model), chat=chat_messages(body.messages),
                 fields=body.plugin_options(), tools=function_specs(body.tools), schema=body.schema_dict())


def generate_asked(body: GenerateRequest) -> Asked:
    """The prompt as it is (`raw`), or in the chat template after the system prompt."""
    shape = lambda _: GenerateShape(body.model)  # noqa: E731
    fields, schema = body.plugin_options(), body.schema_dict()
    if not body.prompt:
        return Asked(body, shape, fields=fields, schema=schema)
    if body.raw:
        return Asked(body, shape, raw=body.prompt, fields=fields, schema=schema)
    system = [text_message("system", body.system)] if body.system else []
    return Asked(body, shape, chat=[*system, ChatMessage("user", with_images(body.prompt, body.images))],
                 fields=fields, schema=schema)


def shown(service, body: ShowRequest) -> dict:
    """What a model's checkpoint says about it, as Ollama's /api/show does."""
    model_id = service.policy.model_for(body.model)
    found = checkpoint(model_id)
    template = found.template if found else ""
    capabilities = ["completion"] + [c for c, mark in (("tools", "tools"), ("thinking", "think"))
                                     if mark in template]  # what the chat template reads
    if service.policy.takes_images(model_id):
        capabilities.append("vision")
    info = {"general.architecture": found.family if found else ""}
    if found is not None and found.context_length:
        info[f"{found.family}.context_length"] = found.context_length
    return {"modelfile": f"FROM {model_id}{LATEST}\n", "parameters": "", "template": template,
            "details": details(found),
            "model_info": info, "capabilities": capabilities,
            **({"modified_at": stamp(found.modified_at)} if found else {})}


async def loaded(service) -> dict:
    """The models loaded now, as Ollama's /api/ps lists them, with this engine's figures
    (service.models_figures: each model's share, slots, pin and the options set for it here)."""
    models = []
    for figures in service.models_figures():
        model_id, due = figures["model"], figures["expires_at"]
        models.append({**listed(model_id), "size_vram": 0, "context_length": await service.context(model_id),
                       "expires_at": stamp(due) if due is not None else "9999-12-31T23:59:59Z",  # until told
                       **{k: figures[k] for k in ("memory_bytes", "expert_slots", "pinned", "options")}})
    return {"models": models}


def router(service) -> APIRouter:
    errors = {status: {"model": OllamaError} for status in (400, 401, 403, 404, 413, 503)}
    api = APIRouter(dependencies=[Depends(service.policy.check_api_key)], tags=["Ollama"], responses=errors,
                    route_class=api_routes("ollama", error_body))

    @api.post("/api/chat", description="Ollama's chat; NDJSON chunks unless stream is false")
    async def chat(body: ChatRequest, request: Request):
        return await run(service, request, chat_asked(body))

    @api.post("/api/generate", description="Ollama's completion; NDJSON chunks unless stream is false")
    async def generate(body: GenerateRequest, request: Request):
        return await run(service, request, generate_asked(body))

    @api.get("/api/tags", description="The models served, as Ollama lists them")
    async def tags() -> dict:
        return {"models": [listed(i) for i in model_ids()]}

    @api.post("/api/show", description="What a model's checkpoint says about it")
    async def show(body: ShowRequest, request: Request) -> dict:
        service.policy.accept(request, body)
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
