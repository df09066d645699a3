"""The ASGI app: the guard, the body limit, bodies read as JSON, errors in each API's
shape, the server's own routes (health, figures, runtime parameters) and each API's router.

FastAPI, because its routes are typed by pydantic models (the same pydantic llm and the
plugin's Options use), which gives request validation and an OpenAPI schema for free;
the property-based tests are generated from that schema (see docs/server.md).
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Any, Optional

from fastapi import APIRouter, Body, Depends, FastAPI, Request
from fastapi.responses import PlainTextResponse
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException

from ..discovery import public_id
from ..errors import one_line
from . import dashboard
from .anthropic import routes as anthropic
from .errors import ApiError, BodyLimit, JsonBody, api_routes, error_for, not_json, refusal
from .fields import IgnoredHeader
from .guard import Guard
from .ollama import routes as ollama
from .openai import routes as openai
from .responses import routes as responses
from .openai.schemas import ErrorResponse
from .request_log import RequestLog
from .runtime import POOL_KEYS, ConfigError
from .service import Service


def create_app(service: Service) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app):
        service.hosting.start()  # its limits to the engine, its models loaded (a pipeline pins none: its default)
        yield

    app = FastAPI(title="llm-mlx-streaming", summary="The OpenAI, Anthropic and Ollama APIs of `llm mlxs serve`",
                  lifespan=lifespan, docs_url=None, redoc_url=None)  # /docs: served offline by dashboard.attach
    app.state.service = service
    app.add_middleware(JsonBody)
    app.add_middleware(IgnoredHeader)
    app.add_middleware(BodyLimit)
    app.add_middleware(Guard, hosts=service.hosts, origins=service.origins)
    app.add_middleware(RequestLog)  # outside the guard: its refusals are logged too

    @app.exception_handler(ApiError)
    async def _api_error(request, exc: ApiError):
        return exc.response(request.scope)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        return refusal((exc.errors() or [{}])[0]).response(request.scope)

    @app.exception_handler(HTTPException)
    async def _http(request, exc: HTTPException):
        if isinstance(exc.__cause__, ValueError):  # FastAPI could not decode the body
            return not_json(one_line(exc.__cause__)).response(request.scope)
        if exc.status_code == 404 and exc.detail == "Not Found":  # no route: say which, and where they are
            return ApiError(404, f"{request.method} {request.url.path}: no such route on this server (its routes: "
                            "/docs)", code="unknown_route").response(request.scope)
        return ApiError(exc.status_code, str(exc.detail), headers=exc.headers).response(request.scope)

    @app.exception_handler(Exception)
    async def _unexpected(request, exc: Exception):
        return error_for(exc).response(request.scope)

    @app.api_route("/", methods=["GET", "HEAD"], response_class=PlainTextResponse, include_in_schema=False)
    async def root(request: Request) -> str:
        """What answers here, for a person or a script probing the port (Ollama answers "Ollama is running")."""
        return (f"llm-mlx-streaming is running: the dashboard is at {request.base_url}dashboard, the API "
                f"reference at {request.base_url}docs\n")

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "id": public_id(service.policy.secret) if service.policy.secret else None}

    app.state.routers = [_runtime_routes(service), openai.router(service), responses.router(service),
                         anthropic.router(service), ollama.router(service)]  # errors.shape_for reads their routes' shapes
    for router in app.state.routers:
        app.include_router(router)
    dashboard.attach(app, service)  # /dashboard, /metrics, /docs (server/dashboard/, server/metrics.py)
    return app


def _runtime_routes(service: Service) -> APIRouter:
    """The server's own API: its figures and the parameters it runs with."""
    errors = {status: {"model": ErrorResponse} for status in (401, 422)}
    api = APIRouter(dependencies=[Depends(service.policy.check_api_key)], responses=errors,
                    route_class=api_routes("runtime"))

    @api.get("/api/stats")
    async def stats() -> dict:
        return service.stats()

    @api.get("/api/engine/config", description="The runtime parameters (of the model named by ?model=, "
             "its own over every model's)")
    async def get_config(model: Optional[str] = None) -> dict:
        return service.config(service.policy.model_for(model) if model else None)

    @api.post("/api/engine/config", description="Change runtime parameters (null unsets one) for every "
              "model, or with ?model= for that model alone. "
              f"{', '.join(POOL_KEYS)} rebuild the pools of the loaded models they apply to (each within its "
              "share of the memory budget) before the waiting requests run.")
    async def post_config(changes: dict[str, Any] = Body(...), model: Optional[str] = None) -> dict:
        try:
            return await service.change_config(changes, model)
        except ConfigError as e:
            raise ApiError(422, str(e), code="invalid_config") from None

    return api
