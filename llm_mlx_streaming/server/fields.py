"""What the server does with a request's fields, the same for every API.

A field that changes what the reply must be (tools, formats, stops, sampling, limits,
thinking) is honoured, or refused with a 400 that names it. Every other field is
accepted: a hint the engine cannot use is declared with `hint(...)`, and a field no
model here declares (a client's newer field) is taken as one too; both are named back
in the `x-mlx-stream-ignored` header and once each in the server's log, so a client
release that adds a field never breaks on this server. `llm mlxs serve --strict`
refuses the undeclared ones instead.

A request's plugin options (what the reply core takes) are made one way on every API:
the request schema's `plugin_options()`, from the engine option fields it declares
(`options_model`, `options_set`) and what its own fields mean in the plugin's terms.
Whether the thinking fields apply to the model is decided once, in turns.py.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ..options.knobs import build_options
from ..options.settings import Options

IGNORED_HEADER = "x-mlx-stream-ignored"
HEADER_LENGTH = 2000  # characters of the header at most (a client may invent any number of fields)
_HINT = "x-hint"
_UNSAFE = re.compile(r"[^A-Za-z0-9_.$@:/+-]")


class RequestModel(BaseModel):
    """A request body (or a part of one): undeclared fields are kept, to be named."""

    model_config = ConfigDict(extra="allow")


# Options fields that mean nothing inside the server (it always runs in-process).
SERVER_ONLY = ("server",)


def engine_option_names() -> list[str]:
    """The plugin options a request or the runtime config may set, read off `Options`."""
    return [name for name in Options.model_fields if name not in SERVER_ONLY]


def options_model(model_name: str, exclude: tuple[str, ...] = ()) -> type[BaseModel]:
    """The engine options as body fields of an API's request (a base model), less those
    that API has under its own name."""
    names = tuple(n for n in engine_option_names() if n not in exclude)
    return build_options(RequestModel, names=names, model_name=model_name)


def options_set(body: BaseModel, names) -> dict:
    """The engine options `body` sets among `names` (None: not set)."""
    return {k: getattr(body, k) for k in body.model_fields_set if k in names and getattr(body, k) is not None}


def hint(description: str, **kwargs) -> Any:
    """A declared field that is accepted and changes nothing here: `description` says why."""
    return Field(None, description=f"Accepted, not acted on: {description}", json_schema_extra={_HINT: True},
                 **kwargs)


def unused(body: BaseModel) -> tuple[list[str], list[str]]:
    """(the hints `body` gives, its undeclared fields), as dotted paths without list indices."""
    hints: list[str] = []
    unknown: list[str] = []
    _walk(body, "", hints, unknown)
    return _unique(hints), _unique(unknown)


def header_value(names: list[str]) -> bytes:
    """The names as one header value: characters a header cannot carry as ?, cut at HEADER_LENGTH."""
    value = ", ".join(_UNSAFE.sub("?", name) or "?" for name in names)
    return (value if len(value) <= HEADER_LENGTH else value[:HEADER_LENGTH] + " ...").encode()


def _walk(value, path: str, hints: list, unknown: list) -> None:
    if isinstance(value, BaseModel):
        fields = type(value).model_fields
        for name in value.model_fields_set:
            info = fields.get(name)
            if info is None:
                continue
            where = f"{path}{info.alias or name}"
            extra = info.json_schema_extra
            if isinstance(extra, dict) and extra.get(_HINT):
                if getattr(value, name) is not None:
                    hints.append(where)
            else:
                _walk(getattr(value, name), f"{where}.", hints, unknown)
        unknown.extend(f"{path}{name}" for name in (value.model_extra or {}))
    elif isinstance(value, (list, tuple)):
        for item in value:
            _walk(item, path, hints, unknown)
    elif isinstance(value, dict):
        for item in value.values():
            _walk(item, path, hints, unknown)


def _unique(names: list[str]) -> list[str]:
    return list(dict.fromkeys(names))


class IgnoredHeader:
    """ASGI middleware: the fields a route did not act on (set in `scope["state"]` by
    Service.accept) named in the response's `x-mlx-stream-ignored` header."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def named(message):
            ignored = (scope.get("state") or {}).get("ignored")
            if message["type"] == "http.response.start" and ignored:
                header = (IGNORED_HEADER.encode(), header_value(ignored))
                message = {**message, "headers": [*message.get("headers", []), header]}
            await send(message)

        await self.app(scope, receive, named)
