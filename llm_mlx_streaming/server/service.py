"""The ASGI app: OpenAI-compatible routes, the runtime API, and the server's state.

FastAPI, because its routes are typed by pydantic models (the same pydantic llm and the
plugin's Options use), which gives request validation and an OpenAPI schema for free;
the property-based tests are generated from that schema (see docs/server.md).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from contextlib import asynccontextmanager
from typing import Any, Optional

from fastapi import APIRouter, Body, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import StreamingResponse

from ..client.discovery import public_id
from ..errors import one_line
from ..run_config import resolve
from .bridge import Result, Run
from .gate import Gate, QueueFull
from ..messages import llm_messages
from .guard import Guard
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
from ..messages import raw_message

RETRY_AFTER_SECONDS = 2


class Turn:
    """A request's hold on the gate and its run: finishing cancels the run if it is
    still going and passes the turn on, once."""

    def __init__(self, service: "Service", run: Run) -> None:
        self.service, self.run = service, run
        self._done = False

    @property
    def finished(self) -> bool:
        return self._done

    def finish(self, served: bool = False) -> None:
        if self._done:
            return
        self._done = True
        if not self.run.finished:
            self.run.cancel()
        self.service.served += served
        self.service.gate.release()


class GatedStream(StreamingResponse):
    """A stream that gives back its turn however it ends (done, error, disconnect)."""

    def __init__(self, turn: Turn, content, **kwargs) -> None:
        super().__init__(content, **kwargs)
        self.turn = turn

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self.turn.finished:  # the client went before the end
                self.turn.service.disconnects += 1
            self.turn.finish()


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

    # -- requests -------------------------------------------------------------
    def check_api_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        token = header[7:].strip() if header[:7].lower() == "bearer " else ""
        keys = [k for k in (self.api_key, self.secret) if k]
        if not token or not any(secrets.compare_digest(token.encode(), k.encode()) for k in keys):
            raise ApiError(401, "missing or wrong API key: send Authorization: Bearer KEY",
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

    def request_options(self, body) -> dict:
        names = engine_option_names()
        fields = {k: getattr(body, k) for k in body.model_fields_set if k in names}
        if body.max_completion_tokens is not None and "max_tokens" not in fields:
            fields["max_tokens"] = body.max_completion_tokens
        options = self.runtime.for_request({k: v for k, v in fields.items() if v is not None})
        options.setdefault("max_batch", self.gate.capacity)  # the requests it admits at once may batch
        return options

    async def generate(self, request: Request, body, model_id: str, messages: list, chat: bool):
        try:
            await self.gate.acquire()
        except QueueFull:
            raise ApiError(503, f"the server is busy: {self.gate.waiting} requests already wait; retry later",
                           kind="server_error", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
        try:
            options = self.request_options(body)  # now: a config change made while it waited applies
            schema = body.response_format.schema_dict() if body.response_format else None
            run = Run(model_id, messages, options, schema).start()
        except BaseException:
            self.gate.release()
            raise
        self.model_id = model_id
        turn = Turn(self, run)
        # A client that goes away cancels the run; once a stream has started, the
        # streaming response watches for that itself.
        watcher = asyncio.get_running_loop().create_task(self._cancel_on_disconnect(request, run))
        try:
            events = turn.run.events()
            first = await _first(events)  # a load or prompt error is still an HTTP error
            shape = (ChatShape if chat else TextShape)(model_id, body)
            if body.stream:
                watcher.cancel()
                return GatedStream(turn, self._stream(turn, events, first, shape), media_type="text/event-stream")
            return await self._whole(turn, events, first, shape)
        except Exception as e:
            turn.finish()
            raise error_for(e) from None
        except BaseException:
            turn.finish()
            raise
        finally:
            watcher.cancel()

    async def _whole(self, turn: Turn, events, first, shape) -> dict:
        text, reasoning, result = [], [], Result()
        try:
            async for kind, value in _chain(first, events):
                if kind == "done":
                    result = value
                else:
                    (reasoning if kind == "reasoning" else text).append(value)
        finally:
            turn.finish(served=not turn.run.cancelled)
        self.replies.remember("".join(text), "".join(reasoning), result.tokens)
        return shape.whole("".join(text), "".join(reasoning), result.finish_reason, result)

    async def _stream(self, turn: Turn, events, first, shape):
        text, reasoning, result = [], [], Result()
        try:
            yield _sse(shape.opening())
            async for kind, value in _chain(first, events):
                if kind == "done":
                    result = value
                    break
                (reasoning if kind == "reasoning" else text).append(value)
                yield _sse(shape.delta(**{kind: value}))
            self.replies.remember("".join(text), "".join(reasoning), result.tokens)
            turn.finish(served=True)
            yield _sse(shape.closing(result.finish_reason, result))
            if shape.include_usage:
                yield _sse(shape.usage_chunk(result))
        except Exception as e:  # the status line is sent: the error goes in the stream
            yield _sse(error_for(e).response_body())
        yield "data: [DONE]\n\n"

    async def _cancel_on_disconnect(self, request: Request, run: Run) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        self.disconnects += 1
        run.cancel()

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


async def _first(events):
    try:
        return await events.__anext__()
    except StopAsyncIteration:  # pragma: no cover - a run always ends with "done"
        return ("done", Result())


async def _chain(first, events):
    yield first
    if first[0] == "done":
        return
    async for item in events:
        yield item


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"


ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 422, 503)}


def create_app(service: Service) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app):
        if service.default_model:  # load at start, so the first request finds it warm
            service.schedule_load(service.model_for(service.default_model))
        yield

    app = FastAPI(title="llm-mlx-streaming", summary="OpenAI-compatible API of `llm mlxs serve`",
                  lifespan=lifespan)
    app.state.service = service
    app.add_middleware(BodyLimit)
    app.add_middleware(Guard, hosts=service.hosts, origins=service.origins)  # outermost

    @app.exception_handler(ApiError)
    async def _api_error(request, exc: ApiError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        err = (exc.errors() or [{}])[0]
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        where = ".".join(loc)
        message = err.get("msg", "invalid request").removeprefix("Value error, ")
        if err.get("type") == "extra_forbidden":
            message = "not a field this server knows (docs/server.md lists the fields)"
        return ApiError(400, f"{where}: {message}" if where else message, param=where or None).response()

    @app.exception_handler(Exception)
    async def _unexpected(request, exc: Exception):
        return error_for(exc).response()

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "id": public_id(service.secret) if service.secret else None}

    api = APIRouter(dependencies=[Depends(service.check_api_key)], responses=ERRORS)

    @api.get("/v1/models", response_model=ModelList)
    async def models() -> dict:
        import llm

        from ..model import MlxStreamModel

        ids = [m.model.model_id for m in llm.get_models_with_aliases() if isinstance(m.model, MlxStreamModel)]
        created = int(time.time())
        return {"object": "list", "data": [{"id": i, "object": "model", "created": created, "owned_by": "mlx-stream"}
                                           for i in ids]}

    @api.post("/v1/chat/completions", responses={200: {"model": ChatCompletion, "description":
              "The reply, or with stream: true an SSE stream of chat.completion.chunk objects"}})
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        model_id = service.model_for(body.model)
        return await service.generate(request, body, model_id, llm_messages(body.messages, service.replies.known),
                                      chat=True)

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
    return app
