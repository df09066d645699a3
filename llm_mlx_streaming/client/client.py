"""The `llm` side: send a prompt, a setting or a stats request to a running server.

Imported by the plugin on every prompt, so it stays light: the standard library's
http.client, no server packages. A prompt routed here reads the server's stream back
as the reply core's own events (text, reasoning, tool calls, then the outcome with the
reply's token ids and the server's figures plus `served_by`), so llm logs the same row.
"""

from __future__ import annotations

import http.client
import json
import socket
from typing import Iterator, Optional
from urllib.parse import quote, urlsplit


from .. import discovery
from ..errors import MlxStreamError, one_line
from ..prompt.messages import openai_messages
from ..prompt.tools import AUTO, NONE, REQUIRED
from ..reply.events import CallArguments, CallBegins, Chunk, Finished, Outcome, ToolCall


def running_server(options, settings) -> Optional["ServerClient"]:
    """The server a prompt with these options (None: a command that is no prompt) should
    go to, or None for in-process (`server off`, as a setting or for one prompt with -o
    server off)."""
    if (getattr(options, "server", None) or settings.server) == "off":
        return None
    info = discovery.read()
    if info is None:
        return None
    client = ServerClient(info)
    return client if client.is_ours() else None


IDENTIFY_TIMEOUT = 5.0  # seconds for /health to answer before a prompt is sent


class ServerGone(MlxStreamError):
    pass


class ServerClient:
    def __init__(self, info: discovery.ServerInfo, timeout: float = 600.0) -> None:
        self.info = info
        self.url = info.url
        self.timeout = timeout

    def is_ours(self) -> bool:
        """Whether the mlx-stream server of the discovery file answers at its address
        (ServerGone when nothing does); a file whose pid and port now belong to some
        other program is removed. A pipeline's stand-in answers 503 with its id: it is
        ours, and its refusals say why (server/process/standin.py)."""
        status, data = self._json("GET", "/health", timeout=IDENTIFY_TIMEOUT)
        if status in (200, 503) and data.get("id") == discovery.public_id(self.info.secret):
            return True
        discovery.forget(discovery.discovery_path(),
                         f"{self.url} (pid {self.info.pid}) is not the mlx-stream server it names")
        return False

    # -- plumbing -------------------------------------------------------------
    def _request(self, method: str, path: str, body: Optional[dict] = None, timeout: Optional[float] = None):
        parts = urlsplit(self.url)
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout or self.timeout)
        headers = {"Authorization": f"Bearer {self.info.secret}"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        try:
            conn.request(method, path, body=data, headers=headers)
            return conn, conn.getresponse()
        except OSError as e:
            conn.close()
            raise ServerGone(
                f"The mlx-stream server at {self.url} (pid {self.info.pid}) is not answering "
                f"({one_line(e)}); stop it (or delete {discovery.discovery_path()} if none runs), "
                "or run in-process with -o server off"
            ) from None

    def _json(self, method: str, path: str, body: Optional[dict] = None,
              timeout: Optional[float] = None) -> tuple[int, dict]:
        conn, resp = self._request(method, path, body, timeout)
        try:
            raw = resp.read()
        except (OSError, http.client.HTTPException) as e:
            raise self._gone(e) from None
        finally:
            conn.close()
        try:
            return resp.status, json.loads(raw or b"{}")
        except ValueError:
            return resp.status, {"error": {"message": raw.decode(errors="replace")[:200]}}

    def _gone(self, exc) -> ServerGone:
        return ServerGone(f"The mlx-stream server at {self.url} stopped during the request ({one_line(exc) or type(exc).__name__})")

    def stats(self) -> dict:
        status, data = self._json("GET", "/api/stats")
        if status != 200:
            raise MlxStreamError(_message(data, status))
        return data

    def snapshot(self) -> dict:
        """One frame of the server's dashboard (server/dashboard/feed.py)."""
        status, data = self._json("GET", "/dashboard/snapshot")
        if status != 200:
            raise MlxStreamError(_message(data, status))
        return data

    def load(self, model_id: str, timeout: float) -> None:
        """Have the server load `model_id`; returns once it is loaded (Ollama's way: a
        generate request with no prompt)."""
        status, data = self._json("POST", "/api/generate", {"model": model_id, "stream": False}, timeout=timeout)
        if status != 200:
            raise MlxStreamError(f"The server at {self.url} could not load {model_id}: {_message(data, status)}")

    def configure(self, changes: dict, model: Optional[str] = None) -> dict:
        """Change the server's runtime parameters, for every model or for `model` alone."""
        where = "/api/engine/config" + (f"?model={quote(model, safe='')}" if model else "")
        status, data = self._json("POST", where, changes)
        if status != 200:
            raise MlxStreamError(f"The server at {self.url} refused it: {_message(data, status)}")
        return data

    # -- a prompt -------------------------------------------------------------
    def answer(self, model_id: str, ask, on_handle=None) -> Iterator:
        """Stream `ask` (reply/build.py) from the server as the core's events; `on_handle`
        is told a handle whose `cancel()` hangs up, which the server takes as a
        disconnect and cancels the generation (the async model cancels through it)."""
        options = ask.options.model_dump(exclude_none=True)
        options.pop("server", None)
        body = {"model": model_id, "messages": openai_messages(ask.messages), "stream": True,
                "stream_options": {"include_usage": True}, **options, **_tool_fields(ask.tools, options)}
        if ask.schema is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "schema", "schema": ask.schema}}
        conn, resp = self._request("POST", "/v1/chat/completions", body)
        if on_handle is not None:
            on_handle(_HangUp(conn))
        extension = None
        calls = ToolDeltas()
        try:
            if resp.status != 200:
                raise MlxStreamError(_message(_read_json(resp), resp.status))
            for chunk in _sse(resp):
                if "error" in chunk:
                    raise MlxStreamError(_message(chunk, 500))
                extension = chunk.get("mlx_stream") or extension
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    if delta.get("reasoning_content"):
                        yield Chunk("reasoning", delta["reasoning_content"])
                    if delta.get("content"):
                        yield Chunk("text", delta["content"])
                    yield from calls.feed(delta.get("tool_calls") or [])
        except (OSError, EOFError, ValueError, http.client.HTTPException) as e:
            raise self._gone(e) from None
        finally:
            conn.close()
        if extension is None:
            raise self._gone(EOFError("the stream ended early"))
        figures = {**(extension.get("stats") or {}), "served_by": self.url}
        yield Finished(Outcome(figures, list(extension.get("tokens") or []), calls.finished(),
                               extension.get("resolved_model")))


def _tool_fields(tools: list[dict], options: dict) -> dict:
    """The ask's tools and the tool options in the API's terms."""
    fields = {}
    if tools:
        fields["tools"] = list(tools)
    choice = options.get("tool_choice")
    if choice not in (None, AUTO, NONE, REQUIRED):
        fields["tool_choice"] = {"type": "function", "function": {"name": choice}}
    if "top_logprobs" in options:
        fields["logprobs"] = True
    return fields


class ToolDeltas:
    """The tool calls of a streamed reply: events while they come, calls at the end."""

    def __init__(self) -> None:
        self.calls: dict[int, dict] = {}

    def feed(self, deltas: list) -> Iterator:
        for delta in deltas:
            function = delta.get("function") or {}
            call = self.calls.get(delta.get("index"))
            if call is None:
                call = self.calls[delta.get("index")] = {"id": delta.get("id"), "name": function.get("name") or "",
                                                          "arguments": ""}
                yield CallBegins(call["id"], call["name"])
            if function.get("arguments"):
                call["arguments"] += function["arguments"]
                yield CallArguments(call["id"], function["arguments"])

    def finished(self) -> list[ToolCall]:
        out = []
        for call in self.calls.values():
            try:
                arguments, complete = json.loads(call["arguments"] or "{}"), True
            except ValueError:
                arguments, complete = {"_raw": call["arguments"]}, False
            out.append(ToolCall(call["id"], call["name"], arguments, complete))
        return out


class _HangUp:
    def __init__(self, conn: http.client.HTTPConnection) -> None:
        self.conn = conn

    def cancel(self) -> None:
        try:
            self.conn.sock.shutdown(socket.SHUT_RDWR)  # wakes the reading thread too
        except (AttributeError, OSError):
            pass


def _sse(resp) -> Iterator[dict]:
    """The JSON payloads of a server-sent event stream, up to [DONE]."""
    while True:
        line = resp.readline()
        if not line:
            raise EOFError("the stream ended early")
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        yield json.loads(data)


def _read_json(resp) -> dict:
    try:
        return json.loads(resp.read() or b"{}")
    except ValueError:
        return {}


def _message(data: dict, status: int) -> str:
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])
    if isinstance(error, str) and error:  # Ollama's routes
        return error
    return f"the server answered HTTP {status}"
