"""The soak's requests: every API's body for one case, sent over a plain socket so a
case can hang up where it likes, and what came back, sorted into one outcome.

An API is declared once in `APIS`, by its path and how its body spells the prompt,
the reply's length, streaming, a tool and a JSON schema; a new route is one entry.
"""

from __future__ import annotations

import http.client
import json
import random
import time
from dataclasses import dataclass
from typing import Callable, Optional

WORDS = ("the list of values a function returns when its arguments are given by keyword and the "
         "module imports each name from a package path string file object class method dictionary "
         "key iterator generator yields items in order while loops break or continue with an "
         "exception raised by the interpreter").split()

ADD = {"name": "add", "description": "Add two numbers",
       "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                      "required": ["a", "b"]}}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "count": {"type": "integer"}},
          "required": ["name", "count"]}

OK, CANCELLED, BUSY = "ok", "cancelled", "503 queue full"
CUTS = ("mid_stream", "before_headers", "prefill")  # where a client hangs up


@dataclass(frozen=True)
class Api:
    path: str
    prompt: Callable[[str], dict]  # the prompt's fields
    limit: Callable[[int], dict]  # the reply-length field
    end: bytes  # the stream's last frame holds this
    text: Callable[[dict], str]  # a whole reply's text
    tools: Optional[Callable[[bool], dict]] = None  # the fields offering `add` (True: a call is required)
    schema: Optional[Callable[[dict], dict]] = None  # the fields constraining the reply to a schema


def _chat(text: str) -> dict:
    return {"messages": [{"role": "user", "content": text}]}


def _openai_tools(required: bool) -> dict:
    return {"tools": [{"type": "function", "function": ADD}], "tool_choice": "required" if required else "auto"}


APIS: dict[str, Api] = {
    "openai_chat": Api("/v1/chat/completions", _chat, lambda n: {"max_tokens": n}, b"[DONE]",
                       lambda b: b["choices"][0]["message"]["content"] or "", _openai_tools,
                       lambda s: {"response_format": {"type": "json_schema",
                                                      "json_schema": {"name": "x", "schema": s}}}),
    "openai_completions": Api("/v1/completions", lambda t: {"prompt": t}, lambda n: {"max_tokens": n}, b"[DONE]",
                              lambda b: b["choices"][0]["text"]),
    "anthropic": Api("/v1/messages", _chat, lambda n: {"max_tokens": n}, b"message_stop",
                     lambda b: "".join(block.get("text", "") for block in b["content"]),
                     lambda r: {"tools": [{"name": ADD["name"], "description": ADD["description"],
                                           "input_schema": ADD["parameters"]}],
                                "tool_choice": {"type": "any" if r else "auto"}},
                     lambda s: {"output_config": {"format": {"type": "json_schema", "schema": s}}}),
    "ollama_chat": Api("/api/chat", _chat, lambda n: {"options": {"num_predict": n}}, b'"done":true',
                       lambda b: b["message"]["content"], lambda r: {"tools": [{"type": "function", "function": ADD}]},
                       lambda s: {"format": s}),
    "ollama_generate": Api("/api/generate", lambda t: {"prompt": t}, lambda n: {"options": {"num_predict": n}},
                           b'"done":true', lambda b: b["response"], None, lambda s: {"format": s}),
}


@dataclass(frozen=True)
class Case:
    api: str
    prompt: str
    max_tokens: int
    stream: bool = False
    tools: bool = False
    schema: bool = False
    cut: Optional[str] = None  # one of CUTS: the client hangs up there
    cut_after: float = 0.0  # frames read (mid_stream) or seconds waited (prefill) before hanging up
    model: str = "mlx-stream"
    keep_alive: Optional[str] = None  # Ollama's field (every API takes it): how long the model stays after

    def body(self) -> dict:
        api = APIS[self.api]
        body = {"model": self.model, "stream": self.stream, **api.prompt(self.prompt), **api.limit(self.max_tokens)}
        if self.keep_alive is not None:
            body["keep_alive"] = self.keep_alive
        if self.tools:
            body.update(api.tools(len(self.prompt) % 2 == 0))
        if self.schema:
            body.update(api.schema(SCHEMA))
        return body


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def send(host: str, port: int, case: Case, timeout: float) -> tuple[str, str]:
    """(outcome, text): OK with the reply (whole) or "" (streamed), CANCELLED where the
    case hung up, BUSY, or an error's kind."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("POST", APIS[case.api].path, json.dumps(case.body()), {"Content-Type": "application/json"})
        if case.cut == "before_headers":
            return CANCELLED, ""
        if case.cut == "prefill":
            time.sleep(case.cut_after)
            return CANCELLED, ""
        resp = conn.getresponse()
        if resp.status == 503 and resp.getheader("Retry-After"):
            return BUSY, ""  # a full queue, by design
        if resp.status != 200:
            return _refusal(resp.status, resp.read(1 << 20)), ""
        if not case.stream:
            return OK, APIS[case.api].text(json.loads(resp.read()))
        return _streamed(resp, case), ""
    except TimeoutError:
        return "timeout", ""
    except (OSError, http.client.HTTPException, ValueError) as e:
        return type(e).__name__, ""
    finally:
        conn.close()


def _streamed(resp, case: Case, most_frames: int = 10_000) -> str:
    end = APIS[case.api].end
    for frame in range(most_frames):
        line = resp.readline(1 << 20)
        if not line:
            return "stream ended early"
        compact = line.replace(b" ", b"")
        if b'"error"' in compact[:40] or compact.startswith(b"event:error"):
            return "error in stream: " + line.decode(errors="replace").strip()[:80]
        if end in compact:
            return OK
        if case.cut == "mid_stream" and frame >= case.cut_after:
            return CANCELLED
    return "stream without end"


def _refusal(status: int, raw: bytes) -> str:
    """An error's kind: the status and the API's code or first words."""
    try:
        body = json.loads(raw)
    except ValueError:
        return f"{status}"
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        code = error.get("code") or error.get("type")
        message = error.get("message", "")
    else:
        code, message = None, str(error)
    return f"{status} {code or ''} {message[:60]}".strip()

