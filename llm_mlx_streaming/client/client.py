"""The `llm` side: send a prompt, a setting or a stats request to a running server.

Imported by the plugin on every prompt, so it stays light: the standard library's
http.client, no server packages. A prompt routed here streams the same events the
in-process path would (text, reasoning, tool calls, then the reply's token ids), and the
response records the server's figures plus `served_by`, so llm logs the same row.
"""

from __future__ import annotations

import http.client
import json
import socket
from typing import Iterator, Optional
from urllib.parse import urlsplit

import click

from ..constrained import cut_short_notice
from ..errors import MlxStreamError, one_line
from ..messages import openai_messages
from . import discovery
from ..messages import reply_metadata
from ..prompting import stream_event
from ..tools import AUTO, NONE, REQUIRED, function_tools, template_tools

def running_server(options, settings, prompt=None) -> Optional["ServerClient"]:
    """The server a prompt with these options should go to, or None for in-process (the
    server's own prompts say no_server)."""
    if getattr(options, "no_server", None) or getattr(settings, "server", "auto") == "off":
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
        ours, and its refusals say why (server/standin.py)."""
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
                "or run in-process with -o no_server 1"
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

    def configure(self, changes: dict) -> dict:
        status, data = self._json("POST", "/api/engine/config", changes)
        if status != 200:
            raise MlxStreamError(f"The server at {self.url} refused it: {_message(data, status)}")
        return data

    # -- a prompt -------------------------------------------------------------
    def answer(self, model_id: str, prompt, response, on_generation=None) -> Iterator:
        """Stream `prompt` from the server as the plugin's own events; `on_generation`
        is told a handle whose `cancel()` hangs up, which the server takes as a
        disconnect and cancels the generation (the async model cancels through it)."""
        options = {k: v for k, v in prompt.options.model_dump(exclude_none=True).items() if k != "no_server"}
        body = {"model": model_id, "messages": openai_messages(prompt), "stream": True,
                "stream_options": {"include_usage": True}, **options, **_tool_fields(prompt, options)}
        if prompt.schema:
            schema = prompt.schema
            if hasattr(schema, "model_json_schema"):
                schema = schema.model_json_schema()
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "schema", "schema": schema}}
        conn, resp = self._request("POST", "/v1/chat/completions", body)
        if on_generation is not None:
            on_generation(_HangUp(conn))
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
                        yield stream_event("reasoning", delta["reasoning_content"])
                    if delta.get("content"):
                        yield stream_event("text", delta["content"])
                    yield from calls.feed(delta.get("tool_calls") or [])
        except (OSError, EOFError, ValueError, http.client.HTTPException) as e:
            raise self._gone(e) from None
        finally:
            conn.close()
        if extension is None:
            raise self._gone(EOFError("the stream ended early"))
        yield from calls.finish(response, reply_metadata(extension.get("tokens") or []))
        yield stream_event("text", "", reply_metadata(extension.get("tokens") or []))
        stats = dict(extension.get("stats") or {})
        stats["served_by"] = self.url
        if notice := cut_short_notice(stats):
            click.echo(notice, err=True)
        response.response_json = stats
        response.set_usage(input=stats.get("prompt_tokens"), output=stats.get("generated_tokens"))
        if extension.get("resolved_model"):
            response.set_resolved_model(extension["resolved_model"])


def _tool_fields(prompt, options: dict) -> dict:
    """The prompt's tools and the tool options in the API's terms."""
    fields = {}
    if tools := template_tools(function_tools(prompt)):
        fields["tools"] = tools
    choice = options.get("tool_choice")
    if choice not in (None, AUTO, NONE, REQUIRED):
        fields["tool_choice"] = {"type": "function", "function": {"name": choice}}
    if "top_logprobs" in options:
        fields["logprobs"] = True
    return fields


class ToolDeltas:
    """The tool calls of a streamed reply, as llm's events while they come, and as
    llm tool calls at the end."""

    def __init__(self) -> None:
        self.calls: dict[int, dict] = {}

    def feed(self, deltas: list) -> Iterator:
        from llm.parts import StreamEvent

        for delta in deltas:
            function = delta.get("function") or {}
            call = self.calls.get(delta.get("index"))
            if call is None:
                call = self.calls[delta.get("index")] = {"id": delta.get("id"), "name": function.get("name") or "",
                                                          "arguments": ""}
                yield StreamEvent(type="tool_call_name", chunk=call["name"], tool_call_id=call["id"])
            if function.get("arguments"):
                call["arguments"] += function["arguments"]
                yield StreamEvent(type="tool_call_args", chunk=function["arguments"], tool_call_id=call["id"])

    def finish(self, response, metadata: dict) -> Iterator:
        """Hand the calls to `response`; the reply's ids ride on the last (a reply that
        ends in calls has no text part to carry them)."""
        import llm
        from llm.parts import StreamEvent

        for call in self.calls.values():
            try:
                arguments = json.loads(call["arguments"] or "{}")
            except ValueError:
                arguments = {"_raw": call["arguments"]}
            response.add_tool_call(llm.ToolCall(name=call["name"], arguments=arguments, tool_call_id=call["id"]))
        if self.calls:
            last = list(self.calls.values())[-1]
            yield StreamEvent(type="tool_call_args", chunk="", tool_call_id=last["id"], provider_metadata=metadata)


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
    return f"the server answered HTTP {status}"
