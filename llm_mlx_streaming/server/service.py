"""The ASGI app: OpenAI-compatible routes, the runtime API, and the server's state.

FastAPI, because its routes are typed by pydantic models (the same pydantic llm and the
plugin's Options use), which gives request validation and an OpenAPI schema for free;
the property-based tests are generated from that schema (see docs/server.md).
"""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager
from typing import Any, Optional

from fastapi import APIRouter, Body, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError

from ..client.discovery import public_id
from ..errors import one_line
from ..run_config import resolve
from . import anthropic, dashboard, ollama
from .catalog import model_ids
from .gate import Gate
from ..messages import llm_messages
from .guard import Guard, key_accepted
from .openai_tools import llm_tools
from .http_layer import ApiError, BodyLimit, error_for
from .reply_memory import ReplyMemory
from .runtime import POOL_KEYS, ConfigError, RuntimeConfig, touches_pools
from .schemas import (
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ErrorResponse,
    ModelList,
    engine_option_names,
)
from .shapes import ChatShape, TextShape
from .turns import answer, take_turn
from ..messages import raw_message

class Service:
    """The server's state: the gate, the runtime parameters, the replies it gave."""

    def __init__(self, *, default_model: Optional[str] = None, api_key: Optional[str] = None,
                 secret: Optional[str] = None, max_queue: int = 8, hosts: tuple[str, ...] = (),
                 origins: tuple[str, ...] = (), max_batch: int = 1) -> None:
        self.default_model = default_model
        self.hosts, self.origins = tuple(hosts), tuple(origins)  # server/guard.py
        self.api_key, self.secret = api_key, secret
        self.gate = Gate(max_queue, capacity=max_batch)
        self.runtime = RuntimeConfig()
        self.replies = ReplyMemory()
        self.model_id: Optional[str] = None  # the model last loaded or asked for
        self.served = 0
        self.rebuilds = 0  # rebuilds queued or running
        self.rebuild_error: Optional[str] = None
        self.disconnects = 0  # clients that went before their reply was complete
        self._tasks: set = set()
        self._unload_timer: Optional[asyncio.TimerHandle] = None  # Ollama's keep_alive
        self.unload_due: Optional[float] = None  # when it unloads the model (a time.time())

    # -- requests -------------------------------------------------------------
    def check_api_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        if not key_accepted(request.headers, (self.api_key, self.secret)):
            raise ApiError(401, "missing or wrong API key: send Authorization: Bearer KEY (or x-api-key: KEY)",
                           code="invalid_api_key")

    def model_for(self, name: Optional[str]) -> str:
        import llm

        from ..model import MlxStreamModel
        from ..registry import MODEL_PREFIX

        name = name or self.default_model or MODEL_PREFIX
        try:
            model = llm.get_model(name)
        except llm.UnknownModelError:
            model = None
        if not isinstance(model, MlxStreamModel):
            raise ApiError(404, f"the model {name!r} is not served here; see /v1/models",
                           code="model_not_found", param="model")
        return model.model_id

    async def generate(self, request: Request, body, model_id: str, messages: list, chat: bool, tools=()):
        """Answer `body` (its `engine_fields(names)` give the plugin's options, among them
        tool_choice and parallel_tool_calls) with `messages` (llm's) and `tools` (llm `Tool`s)."""
        shape = (ChatShape if chat else TextShape)(model_id, body)
        schema = body.response_format.schema_dict() if body.response_format else None
        return await answer(self, request, shape, model_id, messages, body.engine_fields(engine_option_names()),
                            schema, body.stream, tools)

    async def load(self, model_id: str) -> None:
        """Load `model_id` in its turn, and return once it is loaded."""
        await take_turn(self)
        self.keep_loaded()
        try:
            self.model_id = model_id
            await asyncio.to_thread(self._load_blocking, model_id)
        finally:
            self.gate.release()

    async def unload(self, first: bool = False) -> None:
        """Unload the model in its turn (`first`: right after the run now going)."""
        await take_turn(self, first=first)
        try:
            await asyncio.to_thread(_engine().unload)
        finally:
            self.gate.release()

    def schedule_unload(self, first: bool = True) -> None:
        self._spawn(self.unload(first=first))

    def unload_after(self, seconds: float) -> None:
        """Unload once `seconds` have passed without another request (Ollama's keep_alive)."""
        self.keep_loaded()
        self._unload_timer = asyncio.get_running_loop().call_later(seconds, self.schedule_unload, False)
        self.unload_due = time.time() + seconds

    def keep_loaded(self) -> None:
        """A request came: an unload timed by an earlier one's keep_alive is off."""
        if self._unload_timer is not None:
            self._unload_timer.cancel()
        self._unload_timer = self.unload_due = None

    # -- runtime config -------------------------------------------------------
    def config(self) -> dict:
        from ..settings import load_settings

        return {**self.runtime.shown(load_settings()), "rebuilding": self.rebuilds > 0}

    async def change_config(self, changes: Any) -> dict:
        values = self.runtime.validate(changes)
        pools = touches_pools(changes)
        if pools:  # planned with the model the next request would get
            await asyncio.to_thread(self._check_plan, self.model_id or self.model_for(None), values)
        self.runtime.values = values
        if pools and self.model_id and _engine().state == "loaded":
            self.schedule_load(self.model_id)
        return self.config()

    def _check_plan(self, model_id: str, values: dict) -> None:
        """Resolve the pools as a request would, so a budget too small is refused now."""
        import llm

        from ..model import Options
        from ..settings import load_settings

        try:
            resolve(llm.get_model(model_id).name, Options.model_validate(values), load_settings())
        except llm.ModelError as e:
            raise ConfigError(str(e)) from None

    def schedule_load(self, model_id: str) -> None:
        """Load `model_id` with the runtime parameters (or rebuild its pools) in the
        background, ahead of the requests already waiting."""
        self.rebuilds += 1  # counted now: /api/stats says so from this moment
        self._spawn(self._load(model_id))

    async def _load(self, model_id: str) -> None:
        try:
            await self.gate.acquire(first=True)
            try:
                self.model_id = model_id
                await asyncio.to_thread(self._load_blocking, model_id)
                self.rebuild_error = None
            except Exception as e:
                self.rebuild_error = one_line(e)
            finally:
                self.gate.release()
        finally:
            self.rebuilds -= 1

    def _load_blocking(self, model_id: str) -> None:
        import llm

        from ..settings import load_settings

        settings = load_settings()
        run = resolve(llm.get_model(model_id).name, self.runtime.options(), settings)
        for _ in _engine().queue_load(run.load):
            pass

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- figures --------------------------------------------------------------
    def stats(self) -> dict:
        from ..engine.figures import layer_figures

        engine = _engine()
        out = engine.metrics()
        out.update({
            "model": self.model_id,
            "rebuilding": self.rebuilds > 0,
            "rebuild_error": self.rebuild_error,
            "server": {"running": self.gate.busy, "queued": self.gate.waiting,
                       "max_queue": self.gate.max_waiting, "served": self.served,
                       "disconnects": self.disconnects},
            "layers": layer_figures(engine.loaded),
        })
        return out


def _engine():
    from ..engine.manager import get_manager

    return get_manager()


ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 422, 503)}


def create_app(service: Service) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app):
        if service.default_model:  # load at start, so the first request finds it warm
            service.schedule_load(service.model_for(service.default_model))
        yield

    app = FastAPI(title="llm-mlx-streaming", summary="OpenAI-compatible API of `llm mlxs serve`",
                  lifespan=lifespan, docs_url=None, redoc_url=None)  # /docs: served offline by dashboard.attach
    app.state.service = service
    app.add_middleware(BodyLimit)
    app.add_middleware(Guard, hosts=service.hosts, origins=service.origins)  # outermost

    @app.exception_handler(ApiError)
    async def _api_error(request, exc: ApiError):
        return exc.response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        err = (exc.errors() or [{}])[0]
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        where = ".".join(loc)
        message = err.get("msg", "invalid request").removeprefix("Value error, ")
        if err.get("type") == "extra_forbidden":
            message = "not a field this server knows (docs/server.md lists the fields)"
        refusal = ApiError(400, f"{where}: {message}" if where else message, param=where or None)
        return refusal.response(request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request, exc: Exception):
        return error_for(exc).response(request.url.path)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "id": public_id(service.secret) if service.secret else None}

    api = APIRouter(dependencies=[Depends(service.check_api_key)], responses=ERRORS)

    @api.get("/v1/models", response_model=ModelList)
    async def models() -> dict:
        created = int(time.time())
        return {"object": "list", "data": [{"id": i, "object": "model", "created": created, "owned_by": "mlx-stream"}
                                           for i in model_ids()]}

    @api.post("/v1/chat/completions", responses={200: {"model": ChatCompletion, "description":
              "The reply, or with stream: true an SSE stream of chat.completion.chunk objects"}})
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        model_id = service.model_for(body.model)
        return await service.generate(request, body, model_id, llm_messages(body.messages, service.replies.known),
                                      chat=True, tools=llm_tools(body.tools))

    @api.post("/v1/completions", responses={200: {"model": Completion, "description":
              "The text, or with stream: true an SSE stream of text_completion objects"}})
    async def completions(body: CompletionRequest, request: Request):
        model_id = service.model_for(body.model)
        return await service.generate(request, body, model_id, [raw_message(body.text())], chat=False)

    @api.get("/api/stats")
    async def stats() -> dict:
        return service.stats()

    @api.get("/api/engine/config")
    async def get_config() -> dict:
        return service.config()

    @api.post("/api/engine/config", description="Change runtime parameters (null unsets one). "
              f"{', '.join(POOL_KEYS)} rebuild the pools before the waiting requests run.")
    async def post_config(changes: dict[str, Any] = Body(...)) -> dict:
        try:
            return await service.change_config(changes)
        except ConfigError as e:
            raise ApiError(422, str(e), code="invalid_config") from None

    app.include_router(api)
    app.include_router(anthropic.router(service))
    app.include_router(ollama.router(service))
    dashboard.attach(app, service)  # /dashboard, /metrics, /docs (server/dashboard/, server/metrics.py)
    return app
