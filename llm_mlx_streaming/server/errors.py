"""HTTP-level pieces: errors in each API's own shape, the body size limit, bodies read
as JSON whatever their label.

Every error the server answers has a one-line message, never a traceback, in the shape
of the API whose route it is: each API's router declares its name and shape (`api_routes`),
OpenAI's `{"error": {"message", "type", "param", "code"}}` being the server's own. An
error raised before routing (the guard, the body limit) finds the route the same way.
"""

from __future__ import annotations

from typing import Callable, Optional

from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import ValidationError
from starlette.routing import Match

from ..errors import MlxStreamError, one_line
from ..options.knobs import BY_NAME
from ..options.settings import SettingsError, first_error, load_settings

REQUEST_ROOM = 8 * 2**20  # a request's text, tools and history, beside its image


def max_body_bytes() -> int:
    """The largest request body taken (a larger one is a 413): room for one image of
    max_image_bytes base64'd (4/3 of it) and the rest of a request. Never below the room
    for the default's image, so an image under it that a lower setting refuses is told
    so by name; read on every request, as the image settings are."""
    default = BY_NAME["max_image_bytes"].default
    try:
        image = max(load_settings().max_image_bytes, default)
    except SettingsError:  # the routes say what is wrong with the file
        image = default
    return REQUEST_ROOM + 4 * -(-image // 3)


class ApiError(Exception):
    """An error answered as OpenAI's error object."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 code: Optional[str] = None, param: Optional[str] = None, headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.param = status, one_line(message), kind, code, param
        self.headers = headers

    def openai_body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self, scope) -> JSONResponse:
        """The error in the shape of the API whose route `scope` is for."""
        return JSONResponse(shape_for(scope)(self), status_code=self.status, headers=self.headers)


ErrorShape = Callable[[ApiError], dict]


def api_routes(api: str, shape: ErrorShape = ApiError.openai_body) -> type[APIRoute]:
    """The route class of an API: its name (the `api` label of /metrics) and the shape
    of its errors, `shape(error)`."""
    return type(f"{api}_route", (APIRoute,), {"api": api, "error_shape": staticmethod(shape)})


def route_for(scope) -> Optional[APIRoute]:
    """The API route `scope` is for, found the same way before routing (the guard, the
    body limit, the request counter) and after; None for the server's other pages."""
    app = scope.get("app")
    for router in getattr(getattr(app, "state", None), "routers", ()):
        for route in router.routes:
            if route.matches(scope)[0] != Match.NONE:
                return route
    return None


def shape_for(scope) -> ErrorShape:
    """The error shape of the route `scope` is for (OpenAI's where none declares one)."""
    return getattr(route_for(scope), "error_shape", ApiError.openai_body)


def _too_large(cap: int) -> ApiError:
    return ApiError(413, f"the request body is larger than {cap} bytes", code="body_too_large")


class BodyLimit:
    """ASGI middleware: refuse bodies over `max_body_bytes()`, declared or streamed.

    The body is read here first (it is small by then) and handed on whole, so a body
    that grows past the limit is refused before any route sees it."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        cap = max_body_bytes()
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > cap:
            return await _too_large(cap).response(scope)(scope, receive, send)
        body, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > cap:
                return await _too_large(cap).response(scope)(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()  # after the body: the disconnect, for streaming responses

        await self.app(scope, replay, send)


def _labelled_json(content_type: bytes) -> bool:
    media = content_type.partition(b";")[0].strip().lower()
    return media == b"application/json" or (media.startswith(b"application/") and media.endswith(b"+json"))


class JsonBody:
    """ASGI middleware: a body is JSON because it parses as JSON, as Ollama and mlx-lm's
    server read theirs. One labelled otherwise or not at all (`curl -d` sends the form
    type; Ollama's docs and litellm's Ollama providers send none) is labelled JSON for the
    routes; one that does not parse is a 400 (`refusal`). What keeps other sites' pages
    out is the guard, not the label: a browser's cross-site POST carries its Origin."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        headers = scope.get("headers") or []
        if scope["type"] == "http" and not _labelled_json(dict(headers).get(b"content-type", b"")):
            kept = [(k, v) for k, v in headers if k != b"content-type"]
            scope = {**scope, "headers": [*kept, (b"content-type", b"application/json")]}
        await self.app(scope, receive, send)


NOT_AN_OBJECT = ("model_attributes_type", "model_type", "dict_type")  # pydantic's, for a body that is no object


def not_json(reason: str) -> ApiError:
    return ApiError(400, f"the request body is not JSON: {reason}", code="invalid_json")


def refusal(error: dict) -> ApiError:
    """The first of a request's validation errors (pydantic's, as FastAPI reports them)
    as a 400 naming the field, or the body when it is not a JSON object."""
    loc = [str(p) for p in error.get("loc", ()) if p != "body"]
    if error.get("type") == "json_invalid":  # loc: the character where parsing failed
        return not_json(f"{error.get('ctx', {}).get('error', 'invalid')} at character {loc[0] if loc else 0}")
    if not loc and error.get("type") == "missing":
        return ApiError(400, "the request has no body: send a JSON object")
    if not loc and error.get("type") in NOT_AN_OBJECT:
        return ApiError(400, "the request body is not a JSON object")
    where = ".".join(loc)
    message = error.get("msg", "invalid request").removeprefix("Value error, ")
    return ApiError(400, f"{where}: {message}" if where else message, param=where or None)


def error_for(exc: BaseException) -> ApiError:
    """What the user can fix (a model error, a bad value) is a 400; anything else a 500."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ValidationError):  # the options a request's fields made (their names)
        return ApiError(400, first_error(exc))
    if isinstance(exc, (MlxStreamError, ValueError)):
        return ApiError(400, one_line(exc))
    return ApiError(500, f"{type(exc).__name__}: {one_line(exc)}", kind="server_error")
