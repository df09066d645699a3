"""HTTP-level pieces: error objects in each API's own shape, the body size limit.

Every error the server answers has a one-line message, never a traceback, in the shape
of the API the path belongs to: OpenAI's `{"error": {"message", "type", "param", "code"}}`,
Anthropic's `{"type": "error", "error": {"type", "message"}}` under /v1/messages, and
Ollama's `{"error": "..."}` under its /api/ routes.
"""

from __future__ import annotations

from typing import Optional

from fastapi.responses import JSONResponse
from pydantic import ValidationError

from ..errors import one_line

MAX_BODY_BYTES = 8 * 2**20  # a request body larger than this is refused (413)


class ApiError(Exception):
    """An error answered as OpenAI's error object."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 code: Optional[str] = None, param: Optional[str] = None, headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.param = status, one_line(message), kind, code, param
        self.headers = headers

    def response_body(self, path: str = "") -> dict:
        """The error object of the API `path` belongs to."""
        if path.startswith(ANTHROPIC_PATHS):
            return {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(self.status, "api_error"),
                                               "message": self.message}}
        if path in OLLAMA_PATHS:
            return {"error": self.message}
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self, path: str = "") -> JSONResponse:
        return JSONResponse(self.response_body(path), status_code=self.status, headers=self.headers)


ANTHROPIC_PATHS = ("/v1/messages",)
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 413: "request_too_large", 422: "invalid_request_error",
                   503: "overloaded_error"}
OLLAMA_SERVED = ("chat", "generate", "tags", "show", "ps", "version")
OLLAMA_REFUSED = ("pull", "push", "create", "copy", "delete", "embed", "embeddings")  # in Ollama's shape
OLLAMA_PATHS = frozenset(f"/api/{name}" for name in OLLAMA_SERVED + OLLAMA_REFUSED)


def _too_large() -> ApiError:
    return ApiError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes", code="body_too_large")


class BodyLimit:
    """ASGI middleware: refuse bodies over MAX_BODY_BYTES, declared or streamed.

    The body is read here first (it is small by then) and handed on whole, so a body
    that grows past the limit is refused before any route sees it."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            return await _too_large().response(scope["path"])(scope, receive, send)
        body, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > MAX_BODY_BYTES:
                return await _too_large().response(scope["path"])(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()  # after the body: the disconnect, for streaming responses

        await self.app(scope, replay, send)


def error_for(exc: BaseException) -> ApiError:
    """What the user can fix (a model error, a bad value) is a 400; anything else a 500."""
    import llm

    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, (llm.ModelError, ValidationError, ValueError)):
        return ApiError(400, one_line(exc))
    return ApiError(500, f"{type(exc).__name__}: {one_line(exc)}", kind="server_error")
