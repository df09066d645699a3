"""Record what real agent clients send: Claude Code, Codex, the openai-agents SDK and
the official openai / anthropic Python SDKs, each pointed at a recording server on
127.0.0.1, then scrub the requests into tests/data/traffic/ (one JSON file a request).

Not run in CI: it installs the CLIs from the npm registry and takes a minute or so.

    python benchmarks/record_agents.py [--clients claude,codex,agents,sdk]
        [--claude-version latest] [--codex-version latest] [--no-install] [--scrub-only]
        [--runs claude_code.session2,claude_code.interactive,claude_code.first_party]

What it does:

1. `npm install @anthropic-ai/claude-code@V @openai/codex@V` into benchmarks/.cache/npm
   (benchmarks/agent_clis.py, shared with benchmarks/agents.py), and `openai-agents`
   into a throwaway venv benchmarks/.cache/agents-venv.
2. Starts the recorder: a stdlib HTTP server on a free port of 127.0.0.1 that writes
   every request (method, path with query, headers, body) to
   benchmarks/.cache/traffic-raw/NNN-....json and answers with minimal, scripted,
   well-formed replies in each API's shape (Anthropic Messages, streamed or whole,
   and count_tokens; OpenAI Responses and chat completions, streamed or whole; model
   lists; 200 to HEAD/GET probes). A first turn whose prompt carries CUE is answered
   with a tool call (Claude Code's Bash, Codex's shell tool, the SDKs' function
   tool); a request that carries the tool's result is answered with text that ends
   the turn; anything else with one line of text.
3. Runs each client for two turns in a scratch HOME (a temp dir outside any git
   repository, removed afterwards), the second continuing the first session (`claude -p
   --continue`, `codex exec resume --last`), with the clients' telemetry, update checks
   and nonessential traffic switched off; then Claude Code once more as most users run
   it (a Claude model name, nonessential traffic on), and the EXTRA_RUNS, each in a
   scratch HOME of its own: a second `claude -p` session with another task, and one turn
   of an interactive session driven in tmux (as is, and taking the recorder for
   Anthropic's own API). `--runs` records only some of those and adds their files to
   what is there, rewriting nothing else. Every client talks only to the
   recorder (the CLIs get no other base URL), and each runs under a timeout in its own
   process group, killed at the end.
4. Scrubs the requests (auth values, scratch paths, host name, ids, dates, unix times,
   kernel release) into tests/data/traffic/<client>_<turn>.json, index.json (the runs,
   the files, their sizes) and the generated part of tests/data/traffic/README.md (the
   file list and the field inventory: every header, query parameter, body field and
   tool-schema keyword each client sent). Re-recording gives the same request files.
"""

from __future__ import annotations

import argparse
import base64
import gzip
import http.server
import json
import os
import platform
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import urllib.parse
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # beside it, also when loaded by path (the tests)
from agent_clis import (BIN, CACHE, ROOT, base_env, claude_quiet, codex_flags, make_scratch,  # noqa: E402
                        npm_install, run, versions)

AGENTS_VENV = CACHE / "agents-venv"
RAW = CACHE / "traffic-raw"
OUT = ROOT / "tests" / "data" / "traffic"

MODEL = "mlx-stream/tiny"
CLAUDE_MODEL = "claude-sonnet-4-5"  # what Claude Code sends when left to its own names
CUE = "(use a tool)"
PROMPT_TOOL = f"List the files in the current directory {CUE}, then say done."
PROMPT_LATER = "Thanks. Now say goodbye in one word."
PROMPT_WEATHER = f"What is the weather in Paris? {CUE}"
PROMPT_SESSION2 = f"Print today's date {CUE}, then say done."  # its 5th, 8th, 21st characters differ from PROMPT_TOOL's
FINAL_TEXT = "Done: the listing came back."
PLAIN_TEXT = "Hello from the recorder."


# -- scripted replies ------------------------------------------------------------


def _texts(content) -> list[str]:
    """Every text in a message's content (a string or a list of blocks/parts)."""
    if isinstance(content, str):
        return [content]
    out = []
    for block in content or []:
        if isinstance(block, dict):
            for key in ("text", "content"):
                if isinstance(block.get(key), str):
                    out.append(block[key])
    return out


def _blocks(content) -> list[dict]:
    if isinstance(content, list):
        return [b for b in content if isinstance(b, dict)]
    return [{"type": "text", "text": content or ""}]


def _trailing(messages: list[dict], stop_role: str) -> list[dict]:
    """The messages after the last one whose role is `stop_role`."""
    out = []
    for m in reversed(messages):
        if not isinstance(m, dict) or m.get("role") == stop_role:
            break
        out.append(m)
    return out[::-1]


def _sample(name: str, schema: dict):
    """A plausible value for a tool argument, from its name and JSON schema."""
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "string")
    if name in ("command", "cmd"):
        return ["ls"] if kind == "array" else "ls"
    if name == "description":
        return "List the files in the current directory"
    if name in ("city", "location"):
        return "Paris"
    if "enum" in schema:
        return schema["enum"][0]
    return {"string": "x", "integer": 1, "number": 1, "boolean": False, "array": [],
            "object": {}}.get(kind, "x")


def _arguments(parameters: dict) -> dict:
    props = (parameters or {}).get("properties") or {}
    required = (parameters or {}).get("required") or []
    return {k: _sample(k, props[k]) for k in props if k in required or k in ("command", "cmd")}


# Tool names to prefer for the scripted call, in order; else the first function tool.
PREFERRED_TOOLS = ("Bash", "exec_command", "shell_command", "shell", "get_weather")


def _pick_tool(tools: list[dict]) -> tuple[str, dict, str | None] | None:
    """(name, parameters schema, namespace) of the tool to call, from a request's tools
    in either API's shape (namespace tools are looked into)."""
    found = {}
    for tool in tools or []:
        if tool.get("type") == "namespace":
            for inner in tool.get("tools") or []:
                if inner.get("name"):
                    found.setdefault(inner["name"], (inner.get("parameters") or {}, tool.get("name")))
            continue
        if tool.get("type") == "function" and isinstance(tool.get("function"), dict):  # chat
            fn = tool["function"]
            found.setdefault(fn["name"], (fn.get("parameters") or {}, None))
        elif tool.get("name") and tool.get("type") in (None, "function", "custom"):
            schema = tool.get("input_schema") or tool.get("parameters") or {}
            found.setdefault(tool["name"], (schema, None))
    for name in PREFERRED_TOOLS:
        if name in found:
            return name, *found[name]
    for name, (schema, ns) in found.items():
        return name, schema, ns
    return None


def _usage_estimate(body_bytes: int) -> int:
    return max(1, body_bytes // 4)


class Replies:
    """Builds each API's scripted reply; ids are numbered per label, so they repeat."""

    def __init__(self):
        self.counts: dict[str, int] = {}

    def next_id(self, label: str, kind: str) -> str:
        key = f"{label}/{kind}"
        self.counts[key] = self.counts.get(key, 0) + 1
        return f"{kind}_rec_{re.sub(r'[^a-z0-9]', '', label.lower())}_{self.counts[key]:02d}"

    # Anthropic Messages ---------------------------------------------------------

    def anthropic(self, body: dict, label: str, size: int):
        # This turn's new input: the messages after the last assistant message (Claude
        # Code puts a `system` message after the user's).
        blocks = [b for m in _trailing(body.get("messages") or [], "assistant")
                  for b in _blocks(m.get("content"))]
        model = body.get("model") or MODEL
        content, stop = [], "end_turn"
        if any(b.get("type") == "tool_result" for b in blocks):
            content = [{"type": "text", "text": FINAL_TEXT}]
        else:
            tool = _pick_tool(body.get("tools") or [])
            if tool and any(CUE in t for t in _texts(blocks)):
                name, schema, _ = tool
                content = [
                    {"type": "text", "text": "Let me call a tool."},
                    {"type": "tool_use", "id": self.next_id(label, "toolu"), "name": name,
                     "input": _arguments(schema)},
                ]
                stop = "tool_use"
            else:
                content = [{"type": "text", "text": PLAIN_TEXT}]
        usage = {"input_tokens": _usage_estimate(size), "output_tokens": 12,
                 "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
        message = {"id": self.next_id(label, "msg"), "type": "message", "role": "assistant",
                   "model": model, "content": content, "stop_reason": stop,
                   "stop_sequence": None, "usage": usage}
        if not body.get("stream"):
            return 200, message, None
        events = [("message_start", {"type": "message_start", "message": {
            **message, "content": [], "stop_reason": None, "usage": {**usage, "output_tokens": 1}}})]
        for i, block in enumerate(content):
            if block["type"] == "text":
                events.append(("content_block_start", {"type": "content_block_start", "index": i,
                                                       "content_block": {"type": "text", "text": ""}}))
                if i == 0:
                    events.append(("ping", {"type": "ping"}))
                events.append(("content_block_delta", {"type": "content_block_delta", "index": i,
                               "delta": {"type": "text_delta", "text": block["text"]}}))
            else:
                events.append(("content_block_start", {"type": "content_block_start", "index": i,
                               "content_block": {**block, "input": {}}}))
                events.append(("content_block_delta", {"type": "content_block_delta", "index": i,
                               "delta": {"type": "input_json_delta",
                                         "partial_json": json.dumps(block["input"])}}))
            events.append(("content_block_stop", {"type": "content_block_stop", "index": i}))
        events.append(("message_delta", {"type": "message_delta",
                                         "delta": {"stop_reason": stop, "stop_sequence": None},
                                         "usage": {"output_tokens": 12}}))
        events.append(("message_stop", {"type": "message_stop"}))
        return 200, None, events

    # OpenAI Responses -------------------------------------------------------------

    def responses(self, body: dict, label: str, size: int):
        items = body.get("input")
        items = [{"type": "message", "role": "user", "content": items}] if isinstance(items, str) else (items or [])
        # The trailing run of user/developer messages: this turn's new input.
        trailing = []
        for item in reversed(items):
            if item.get("type", "message") == "message" and item.get("role") in ("user", "developer", "system"):
                trailing.append(item)
            else:
                break
        rid = self.next_id(label, "resp")
        output = []
        if items and items[-1].get("type") in ("function_call_output", "custom_tool_call_output"):
            output = [self._message(label, FINAL_TEXT)]
        else:
            tool = _pick_tool(body.get("tools") or [])
            if tool and any(CUE in t for item in trailing for t in _texts(item.get("content"))):
                name, schema, namespace = tool
                call = {"type": "function_call", "id": self.next_id(label, "fc"),
                        "call_id": self.next_id(label, "call"), "name": name,
                        "arguments": json.dumps(_arguments(schema)), "status": "completed"}
                if namespace:
                    call["namespace"] = namespace
                output = [call]
            else:
                output = [self._message(label, PLAIN_TEXT)]
        usage = {"input_tokens": _usage_estimate(size), "output_tokens": 12, "total_tokens": 0,
                 "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                 "output_tokens_details": {"reasoning_tokens": 0}}
        usage["total_tokens"] = usage["input_tokens"] + usage["output_tokens"]
        response = {
            "id": rid, "object": "response", "created_at": 1700000000, "status": "completed",
            "model": body.get("model") or MODEL, "output": output, "error": None,
            "incomplete_details": None, "instructions": None, "metadata": {},
            "parallel_tool_calls": bool(body.get("parallel_tool_calls", True)),
            "temperature": 1.0, "top_p": 1.0, "tool_choice": "auto", "tools": [],
            "text": {"format": {"type": "text"}}, "usage": usage,
            "previous_response_id": body.get("previous_response_id"),
            "store": body.get("store", True),
        }
        if not body.get("stream"):
            return 200, response, None
        seq = iter(range(10_000))
        events = []

        def emit(kind, **fields):
            events.append((kind, {"type": kind, "sequence_number": next(seq), **fields}))

        pending = {**response, "status": "in_progress", "output": [], "usage": None}
        emit("response.created", response=pending)
        emit("response.in_progress", response=pending)
        for index, item in enumerate(output):
            if item["type"] == "message":
                text = item["content"][0]["text"]
                emit("response.output_item.added", output_index=index,
                     item={**item, "status": "in_progress", "content": []})
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                emit("response.content_part.added", item_id=item["id"], output_index=index,
                     content_index=0, part=part)
                emit("response.output_text.delta", item_id=item["id"], output_index=index,
                     content_index=0, delta=text, logprobs=[])
                emit("response.output_text.done", item_id=item["id"], output_index=index,
                     content_index=0, text=text, logprobs=[])
                emit("response.content_part.done", item_id=item["id"], output_index=index,
                     content_index=0, part={**part, "text": text})
            else:
                emit("response.output_item.added", output_index=index,
                     item={**item, "status": "in_progress", "arguments": ""})
                emit("response.function_call_arguments.delta", item_id=item["id"],
                     output_index=index, delta=item["arguments"])
                emit("response.function_call_arguments.done", item_id=item["id"],
                     output_index=index, arguments=item["arguments"], name=item["name"])
            emit("response.output_item.done", output_index=index, item=item)
        emit("response.completed", response=response)
        return 200, None, events

    def _message(self, label: str, text: str) -> dict:
        return {"type": "message", "id": self.next_id(label, "msg"), "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}

    # OpenAI chat completions ---------------------------------------------------------

    def chat(self, body: dict, label: str, size: int):
        messages = body.get("messages") or [{}]
        last = messages[-1]
        message = {"role": "assistant", "content": PLAIN_TEXT}
        finish = "stop"
        if last.get("role") == "tool":
            message["content"] = FINAL_TEXT
        else:
            tool = _pick_tool(body.get("tools") or [])
            if tool and last.get("role") == "user" and any(CUE in t for t in _texts(last.get("content"))):
                name, schema, _ = tool
                message = {"role": "assistant", "content": None, "tool_calls": [{
                    "id": self.next_id(label, "call"), "type": "function",
                    "function": {"name": name, "arguments": json.dumps(_arguments(schema))}}]}
                finish = "tool_calls"
        usage = {"prompt_tokens": _usage_estimate(size), "completion_tokens": 12,
                 "total_tokens": _usage_estimate(size) + 12}
        cid = self.next_id(label, "chatcmpl")
        model = body.get("model") or MODEL
        if not body.get("stream"):
            return 200, {"id": cid, "object": "chat.completion", "created": 1700000000,
                         "model": model, "choices": [{"index": 0, "message": message,
                                                      "finish_reason": finish, "logprobs": None}],
                         "usage": usage}, None
        base = {"id": cid, "object": "chat.completion.chunk", "created": 1700000000, "model": model}
        delta = {"role": "assistant", "content": message["content"]}
        if message.get("tool_calls"):
            delta = {"role": "assistant", "content": None,
                     "tool_calls": [{"index": 0, **message["tool_calls"][0]}]}
        events = [(None, {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}),
                  (None, {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})]
        if (body.get("stream_options") or {}).get("include_usage"):
            events.append((None, {**base, "choices": [], "usage": usage}))
        events.append((None, "[DONE]"))
        return 200, None, events


def _models_list() -> dict:
    """One model, in the OpenAI and the Anthropic list shape at once."""
    model = {"id": MODEL, "object": "model", "created": 1700000000, "owned_by": "recorder",
             "type": "model", "display_name": MODEL, "created_at": "2025-01-01T00:00:00Z"}
    return {"object": "list", "data": [model], "has_more": False, "first_id": MODEL, "last_id": MODEL}


# -- the recording server ---------------------------------------------------------------


class Recorder:
    """A threaded HTTP/1.1 server on 127.0.0.1 that logs every request to `raw`."""

    def __init__(self, raw: Path):
        self.raw = raw
        self.raw.mkdir(parents=True, exist_ok=True)
        self.label = "idle"
        self.seq = 0
        self.lock = threading.Lock()
        self.replies = Replies()
        self.summary: list[dict] = []
        self.started = time.monotonic()
        recorder = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _handle(self):
                recorder.handle(self)

            do_GET = do_POST = do_HEAD = do_PUT = do_DELETE = do_OPTIONS = do_PATCH = _handle

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()

    # --

    def handle(self, h: http.server.BaseHTTPRequestHandler):
        raw = self._read_body(h)
        encoding = (h.headers.get("content-encoding") or "").lower()
        decoded, note = _decode(raw, encoding)
        body: object
        try:
            body = json.loads(decoded) if decoded else None
        except ValueError:
            body = {"_text": decoded.decode("utf-8", "replace")} if decoded else None
        with self.lock:
            self.seq += 1
            seq, label = self.seq, self.label
        split = urllib.parse.urlsplit(h.path)
        status, payload, events = self.route(h.command, split.path, body if isinstance(body, dict) else {},
                                             label, len(decoded))
        record = {
            "seq": seq, "label": label, "t": round(time.monotonic() - self.started, 3),
            "method": h.command, "path": h.path, "http_version": h.request_version,
            "headers": [[k.lower(), v] for k, v in h.headers.items()],
            "body_bytes": len(raw), "body_decoded_bytes": len(decoded), "body_note": note,
            "body": body, "reply": {"status": status, "streamed": events is not None,
                                    "kind": _reply_kind(payload, events)},
        }
        slug = re.sub(r"[^A-Za-z0-9]+", "-", split.path).strip("-")[:60] or "root"
        (self.raw / f"{seq:03d}-{label}-{h.command}-{slug}.json").write_text(
            json.dumps(record, indent=1, ensure_ascii=False))
        self.summary.append({k: record[k] for k in ("seq", "label", "method", "path", "body_bytes")}
                            | {"reply": record["reply"]["kind"], "status": status})
        try:
            self._respond(h, status, payload, events)
        except (BrokenPipeError, ConnectionResetError):
            pass

    @staticmethod
    def _read_body(h) -> bytes:
        if "chunked" in (h.headers.get("transfer-encoding") or "").lower():
            out = b""
            while True:
                size = int(h.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while h.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return out
                out += h.rfile.read(size)
                h.rfile.readline()
        n = int(h.headers.get("content-length") or 0)
        return h.rfile.read(n) if n else b""

    def route(self, method: str, path: str, body: dict, label: str, size: int):
        if method == "HEAD":
            return 200, None, None
        if method == "POST" and path.endswith("/messages/count_tokens"):
            return 200, {"input_tokens": _usage_estimate(size)}, None
        if method == "POST" and path.endswith("/messages"):
            return self.replies.anthropic(body, label, size)
        if method == "POST" and path.endswith("/responses"):
            return self.replies.responses(body, label, size)
        if method == "POST" and path.endswith("/chat/completions"):
            return self.replies.chat(body, label, size)
        if method == "GET" and path.endswith("/models"):
            return 200, _models_list(), None
        if method == "GET" and "/models/" in path:
            return 200, _models_list()["data"][0], None
        if method == "GET":
            return 200, {}, None
        message = f"the recorder has no route {method} {path}"
        return 404, {"type": "error", "error": {"type": "not_found_error", "message": message,
                                                 "code": "not_found"}}, None

    @staticmethod
    def _respond(h, status: int, payload, events):
        if events is None:
            data = b"" if payload is None else json.dumps(payload).encode()
            h.send_response(status)
            h.send_header("content-type", "application/json")
            h.send_header("content-length", str(len(data)))
            h.send_header("request-id", "req_recorder")
            h.end_headers()
            if h.command != "HEAD":
                h.wfile.write(data)
            return
        h.send_response(status)
        h.send_header("content-type", "text/event-stream")
        h.send_header("cache-control", "no-cache")
        h.send_header("transfer-encoding", "chunked")
        h.end_headers()
        for name, data in events:
            text = data if isinstance(data, str) else json.dumps(data)
            frame = (f"event: {name}\n" if name else "") + f"data: {text}\n\n"
            chunk = frame.encode()
            h.wfile.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
            h.wfile.flush()
        h.wfile.write(b"0\r\n\r\n")
        h.wfile.flush()


def _decode(raw: bytes, encoding: str) -> tuple[bytes, str | None]:
    if not raw or encoding in ("", "identity"):
        return raw, None
    try:
        if encoding == "gzip":
            return gzip.decompress(raw), "gzip"
        if encoding == "deflate":
            return zlib.decompress(raw), "deflate"
        if encoding == "zstd":
            import zstandard  # noqa: PLC0415 (optional)

            return zstandard.ZstdDecompressor().decompressobj().decompress(raw), "zstd"
    except Exception as exc:  # noqa: BLE001 (record what we could not decode)
        return base64.b64encode(raw), f"{encoding} not decoded ({exc.__class__.__name__}); base64"
    return base64.b64encode(raw), f"{encoding} not decoded; base64"


def _reply_kind(payload, events) -> str:
    if events:
        kinds = [e[1].get("type") for e in events if isinstance(e[1], dict)]
        if any(k in ("content_block_start",) for k in kinds):
            blocks = [e[1]["content_block"]["type"] for e in events
                      if isinstance(e[1], dict) and e[1].get("type") == "content_block_start"]
            return "sse:" + "+".join(blocks)
        items = [e[1]["item"]["type"] for e in events
                 if isinstance(e[1], dict) and e[1].get("type") == "response.output_item.done"]
        if items:
            return "sse:" + "+".join(items)
        return "sse:chat"
    if isinstance(payload, dict):
        if payload.get("type") == "message":
            return "json:" + "+".join(b["type"] for b in payload["content"])
        if payload.get("object") == "response":
            return "json:" + "+".join(i["type"] for i in payload["output"])
        if payload.get("object") == "chat.completion":
            return "json:chat:" + payload["choices"][0]["finish_reason"]
        return "json:" + ",".join(sorted(payload)[:4])
    return "empty"


# -- running the clients ------------------------------------------------------------------


def agents_venv() -> Path:
    python = AGENTS_VENV / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(AGENTS_VENV)], check=True, timeout=300)
    probe = subprocess.run([str(python), "-c", "import agents"], capture_output=True)
    if probe.returncode:
        subprocess.run([str(python), "-m", "pip", "install", "-q", "openai-agents"], check=True,
                       timeout=900)
    return python


def pip_version(python: Path | str, dist: str) -> str | None:
    r = subprocess.run([str(python), "-c", f"import importlib.metadata as m; print(m.version({dist!r}))"],
                       capture_output=True, text=True)
    return r.stdout.strip() or None


def claude_env(rec: Recorder, scratch: dict) -> dict:
    return base_env(scratch["home"]) | claude_quiet(scratch["home"]) | {
        "ANTHROPIC_BASE_URL": f"http://127.0.0.1:{rec.port}",
        "ANTHROPIC_API_KEY": "sk-ant-recorder-dummy",
    }


def record_claude(rec: Recorder, scratch: dict) -> list[dict]:
    claude = BIN / "claude"
    env = claude_env(rec, scratch)
    results = []
    for label, args in (("claude_code.turn1", ["-p", PROMPT_TOOL, "--model", MODEL]),
                        ("claude_code.turn2", ["-p", PROMPT_LATER, "--continue", "--model", MODEL])):
        rec.label = label
        results.append({"label": label, **run([str(claude), *args, "--dangerously-skip-permissions"],
                                              env=env, cwd=scratch["project"])})
    # As most users run it: one of Claude's own model names (the request differs: a
    # fixed thinking budget, longer tool descriptions) and the nonessential traffic
    # left on (it probes the server with HEAD /api/hello). A fresh project directory,
    # so it does not continue the session above.
    rec.label = "claude_code.sonnet"
    project = scratch["home"] / "project2"
    shutil.copytree(scratch["project"], project)
    env = {k: v for k, v in env.items() if k != "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"}
    results.append({"label": rec.label, **run(
        [str(claude), "-p", PROMPT_TOOL, "--model", CLAUDE_MODEL, "--dangerously-skip-permissions"],
        env=env, cwd=project)})
    return results


def record_claude_session2(rec: Recorder, scratch: dict) -> list[dict]:
    """A second, separate `claude -p` session (its own scratch HOME) with another task:
    the billing line's per-session hash (`cc_version=<version>.<3 hex>`) may differ."""
    rec.label = "claude_code.session2"
    return [{"label": rec.label, **run(
        [str(BIN / "claude"), "-p", PROMPT_SESSION2, "--model", MODEL, "--dangerously-skip-permissions"],
        env=claude_env(rec, scratch), cwd=scratch["project"])}]


def record_claude_interactive(rec: Recorder, scratch: dict, first_party: bool = False,
                              timeout: float = 60) -> list[dict]:
    """One turn of an interactive session (no -p), typed into Claude Code in a private
    tmux server (the first-run dialogs: theme, the API key, trusting the folder, bypassing
    permissions, answered in its config). Its billing line says `cc_entrypoint=cli`. The
    per-request nonce (`cch=<5 hex>;`) and the prompt/turn fields come only with a base URL
    Claude Code takes for Anthropic's own (api.anthropic.com, -p or not): `first_party` makes
    it take the recorder's so (its internal `_CLAUDE_CODE_ASSUME_FIRST_PARTY_BASE_URL=1`)."""
    label = rec.label = "claude_code.first_party" if first_party else "claude_code.interactive"
    tmux = shutil.which("tmux")
    if not tmux:
        return [{"label": label, "rc": None, "error": "tmux not found"}]
    key = "sk-ant-recorder-dummy"
    env = claude_env(rec, scratch) | {"TERM": "xterm-256color"}
    if first_party:
        env["_CLAUDE_CODE_ASSUME_FIRST_PARTY_BASE_URL"] = "1"
    env.pop("NO_COLOR")
    config = Path(env["CLAUDE_CONFIG_DIR"])
    config.mkdir(parents=True, exist_ok=True)
    (config / ".claude.json").write_text(json.dumps({
        "hasCompletedOnboarding": True, "theme": "dark", "numStartups": 1,
        "customApiKeyResponses": {"approved": [key[-20:]], "rejected": []},
        "projects": {str(scratch["project"]): {"hasTrustDialogAccepted": True,
                                                "hasCompletedProjectOnboarding": True}}}))
    (config / "settings.json").write_text(json.dumps({"skipDangerousModePermissionPrompt": True}))
    cmd = [str(BIN / "claude"), "--model", MODEL, "--dangerously-skip-permissions"]
    socket_name = f"record-agents-{os.getpid()}"
    t = [tmux, "-L", socket_name, "-f", "/dev/null"]
    start = time.monotonic()

    def screen() -> str:
        return subprocess.run([*t, "capture-pane", "-p", "-t", "rec"], capture_output=True, text=True).stdout

    def main_requests() -> list[dict]:
        return [s for s in rec.summary if s["label"] == label and s["method"] == "POST"
                and s["path"].split("?")[0].endswith("/messages")]

    def wait(until) -> bool:
        while time.monotonic() - start < timeout:
            if until():
                return True
            time.sleep(0.5)
        return False

    subprocess.run([*t, "new-session", "-d", "-s", "rec", "-x", "160", "-y", "50", "-c", str(scratch["project"]),
                    # the pane stays after an exit, to be read
                    shlex.join(["env", "-i", *(f"{k}={v}" for k, v in env.items()), *cmd]) + "; sleep 600"],
                   check=True)
    try:
        ready = wait(lambda: "bypass permissions on" in screen())
        subprocess.run([*t, "send-keys", "-t", "rec", "-l", PROMPT_TOOL], check=True)
        time.sleep(0.5)
        subprocess.run([*t, "send-keys", "-t", "rec", "Enter"], check=True)
        # the turn: its request, the tool call, the request with the result, the answer
        done = wait(lambda: FINAL_TEXT in screen())
        time.sleep(1)
        last = screen()
        subprocess.run([*t, "send-keys", "-t", "rec", "-l", "/exit"])
        subprocess.run([*t, "send-keys", "-t", "rec", "Enter"])
        time.sleep(2)
    finally:
        subprocess.run([*t, "kill-server"], capture_output=True)
    return [{"label": label, "cmd": [*(["_CLAUDE_CODE_ASSUME_FIRST_PARTY_BASE_URL=1"] if first_party else []),
                                     *cmd, f"(in tmux, typed: {PROMPT_TOOL!r}, then /exit)"],
             "rc": 0 if done else 1, "timed_out": not done, "ready": ready,
             "seconds": round(time.monotonic() - start, 1), "requests": len(main_requests()),
             "stdout": last[-4000:], "stderr": ""}]


# The runs that --runs can pick, each in a fresh scratch HOME: their files are added to
# the recording in --out (index.json and README.md updated) and nothing else is rewritten.
EXTRA_RUNS = {"claude_code.session2": record_claude_session2,
              "claude_code.interactive": record_claude_interactive,
              "claude_code.first_party": lambda rec, scratch: record_claude_interactive(rec, scratch, True)}


CODEX_CONFIG = """\
model = "{model}"
model_provider = "mlxs"
check_for_update_on_startup = false

[model_providers.mlxs]
name = "mlx-streaming recorder"
base_url = "http://127.0.0.1:{port}/v1"
wire_api = "responses"
env_key = "MLXS_API_KEY"

[analytics]
enabled = false

[feedback]
enabled = false
"""


def record_codex(rec: Recorder, scratch: dict, sandbox: str) -> list[dict]:
    codex = BIN / "codex"
    codex_home = scratch["home"] / ".codex"
    codex_home.mkdir(parents=True, exist_ok=True)
    (codex_home / "config.toml").write_text(CODEX_CONFIG.format(model=MODEL, port=rec.port))
    env = base_env(scratch["home"]) | {"CODEX_HOME": str(codex_home), "MLXS_API_KEY": "recorder-dummy"}
    flags, resume_flags = codex_flags(sandbox)
    results = []
    for label, args in (("codex.turn1", ["exec", *flags, PROMPT_TOOL]),
                        ("codex.turn2", ["exec", "resume", "--last", *resume_flags, PROMPT_LATER])):
        rec.label = label
        results.append({"label": label, **run([str(codex), *args], env=env, cwd=scratch["project"])})
    return results


AGENTS_SCRIPT = textwrap.dedent("""\
    import asyncio, sys
    from openai import AsyncOpenAI
    from agents import Agent, Runner, function_tool, set_tracing_disabled, OpenAIResponsesModel

    set_tracing_disabled(True)

    @function_tool
    def get_weather(city: str) -> str:
        '''The current weather in a city.'''
        return f"It is sunny in {city}."

    async def main(base_url, mode):
        client = AsyncOpenAI(base_url=base_url, api_key="sk-recorder-dummy")
        agent = Agent(name="Assistant", instructions="You are a helpful assistant. Use tools when useful.",
                      tools=[get_weather], model=OpenAIResponsesModel(model=sys.argv[3], openai_client=client))
        if mode == "streamed":
            result = Runner.run_streamed(agent, sys.argv[4])
            async for _ in result.stream_events():
                pass
        elif mode == "chained":  # the server keeps the history: previous_response_id
            result = await Runner.run(agent, sys.argv[4], auto_previous_response_id=True)
        else:
            result = await Runner.run(agent, sys.argv[4])
        print(result.final_output)

    asyncio.run(main(sys.argv[1], sys.argv[2]))
    """)


def record_agents(rec: Recorder, scratch: dict, python: Path) -> list[dict]:
    env = base_env(scratch["home"]) | {"OPENAI_AGENTS_DISABLE_TRACING": "1",
                                       "OPENAI_API_KEY": "sk-recorder-dummy"}
    results = []
    for mode in ("run", "streamed", "chained"):
        rec.label = f"openai_agents.{mode}"
        results.append({"label": rec.label, **run(
            [str(python), "-c", AGENTS_SCRIPT, f"http://127.0.0.1:{rec.port}/v1", mode, MODEL,
             PROMPT_WEATHER], env=env, cwd=scratch["project"], timeout=120)})
    return results


WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string"}},
                  "required": ["city"], "additionalProperties": False}


def record_sdks(rec: Recorder) -> list[dict]:
    """The official openai and anthropic Python clients, in this process: each API once
    whole with a tool round trip and once streamed (the first turn)."""
    import anthropic
    import openai

    results = []
    oa = openai.OpenAI(base_url=f"http://127.0.0.1:{rec.port}/v1", api_key="sk-recorder-dummy",
                       max_retries=0)
    an = anthropic.Anthropic(base_url=f"http://127.0.0.1:{rec.port}", api_key="sk-ant-recorder-dummy",
                             max_retries=0)
    chat_tool = {"type": "function", "function": {"name": "get_weather",
                                                   "description": "The current weather in a city.",
                                                   "parameters": WEATHER_PARAMS}}
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": PROMPT_WEATHER}]

    def step(label, fn):
        rec.label = label
        start = time.monotonic()
        try:
            fn()
            results.append({"label": label, "rc": 0, "seconds": round(time.monotonic() - start, 2)})
        except Exception as exc:  # noqa: BLE001 (reported, the other steps still run)
            results.append({"label": label, "rc": 1, "error": repr(exc)[:500]})

    def chat_whole():
        first = oa.chat.completions.create(model=MODEL, messages=messages, tools=[chat_tool])
        call = first.choices[0].message.tool_calls[0]
        oa.chat.completions.create(model=MODEL, tools=[chat_tool], messages=[
            *messages, first.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "It is sunny in Paris."}])

    def chat_streamed():
        for _ in oa.chat.completions.create(model=MODEL, messages=messages, tools=[chat_tool],
                                            stream=True, stream_options={"include_usage": True}):
            pass

    resp_tool = {"type": "function", "name": "get_weather", "description": "The current weather in a city.",
                 "parameters": WEATHER_PARAMS, "strict": True}

    def responses_whole():
        first = oa.responses.create(model=MODEL, instructions="You are a helpful assistant.",
                                    input=PROMPT_WEATHER, tools=[resp_tool])
        call = next(o for o in first.output if o.type == "function_call")
        oa.responses.create(model=MODEL, instructions="You are a helpful assistant.", tools=[resp_tool],
                            previous_response_id=first.id,
                            input=[{"type": "function_call_output", "call_id": call.call_id,
                                    "output": "It is sunny in Paris."}])

    def responses_streamed():
        with oa.responses.stream(model=MODEL, input=PROMPT_WEATHER, tools=[resp_tool]) as stream:
            for _ in stream:
                pass
            stream.get_final_response()

    an_tool = {"name": "get_weather", "description": "The current weather in a city.",
               "input_schema": WEATHER_PARAMS}

    def anthropic_whole():
        ask = [{"role": "user", "content": PROMPT_WEATHER}]
        first = an.messages.create(model=MODEL, max_tokens=256, system="You are a helpful assistant.",
                                   messages=ask, tools=[an_tool])
        use = next(b for b in first.content if b.type == "tool_use")
        an.messages.create(model=MODEL, max_tokens=256, system="You are a helpful assistant.",
                           tools=[an_tool], messages=[
                               *ask, {"role": "assistant", "content": first.content},
                               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                             "content": "It is sunny in Paris."}]}])

    def anthropic_streamed():
        with an.messages.stream(model=MODEL, max_tokens=256, tools=[an_tool],
                                messages=[{"role": "user", "content": PROMPT_WEATHER}]) as stream:
            stream.get_final_message()

    step("openai_sdk.chat", chat_whole)
    step("openai_sdk.chat_stream", chat_streamed)
    step("openai_sdk.responses", responses_whole)
    step("openai_sdk.responses_stream", responses_streamed)
    step("anthropic_sdk.messages", anthropic_whole)
    step("anthropic_sdk.messages_stream", anthropic_streamed)
    return results


# -- scrubbing ---------------------------------------------------------------------------------

# Headers dropped: transport-level (host, lengths, connection, encodings of the wire).
DROP_HEADERS = {"host", "content-length", "connection", "accept-encoding", "transfer-encoding",
                "keep-alive"}
AUTH_HEADERS = {"authorization", "x-api-key", "proxy-authorization", "cookie"}
# Ids are often prefixed (msg_<uuid>, fco_<uuid>): hex boundaries, not word boundaries.
UUID = re.compile(r"(?<![0-9a-fA-F])[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-"
                  r"[0-9a-fA-F]{12}(?![0-9a-fA-F])")
LONG_HEX = re.compile(r"(?<![0-9a-fA-F])[0-9a-f]{32,}(?![0-9a-fA-F])")
# Codex's exec_command output header: a random chunk id and the wall time
RUN_NOISE = [(re.compile(r"(Chunk ID: )[0-9a-f]+"), r"\g<1>000000"),
             (re.compile(r"(Wall time: )[0-9.]+( seconds)"), r"\g<1>0.0000\g<2>")]
EPOCH_MS = re.compile(r"(?<!\d)1[6-9]\d{11}(?!\d)")  # unix time in ms (turn_started_at_unix_ms)
TIME = re.compile(r"\b20\d\d-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?(?:Z|[+-]\d\d:?\d\d)?")


class Scrubber:
    """Replaces machine- and run-specific strings, the same way in every file."""

    def __init__(self, scratch: dict | list[dict], port: int | None, meta_dates: list[str] | None = None,
                 first_uuid: int = 1):
        self.uuids: dict[str, str] = {}
        self.first_uuid = first_uuid
        pairs = []
        for one in scratch if isinstance(scratch, list) else [scratch] if scratch else []:
            work = Path(one["work"])
            for real, fake in ((work / "home" / "project", "/home/user/project"),
                               (work / "home", "/home/user"), (work, "/home/user/work")):
                for path in {str(real.resolve()), str(real)}:
                    # and as Claude Code names a project's directory (-tmp-x-home-project)
                    pairs += [(path, fake), (_slug(path), _slug(fake))]
        pairs += [(str(ROOT), "/home/user/src")]
        tmp = tempfile.gettempdir()
        self.pairs = [(a, b) for a, b in dict(pairs).items() if a not in ("/", "")]
        self.pairs.sort(key=lambda p: -len(p[0]))
        self.regexes = [(re.compile(re.escape(tmp) + r"/[A-Za-z0-9._-]+"), "/tmp/scratch")]
        days = meta_dates or []
        self.dates = re.compile("|".join(re.escape(d) for d in days)) if days else None
        # This machine's own home, only as a path prefix (Codex's agent_name "/root" is
        # not a path, and "</root>" is XML).
        home = str(Path.home())
        if home not in ("/", ""):
            self.regexes.append((re.compile(rf"(?<![<\w/]){re.escape(home)}(?=/)"), "/home/user"))
        host = socket.gethostname()
        if len(host) >= 4:
            self.regexes.append((re.compile(re.escape(host)), "host"))
        release = platform.release()
        if release:
            self.regexes.append((re.compile(re.escape(release)), "6.1.0-generic"))
        if port:
            self.regexes.append((re.compile(rf"127\.0\.0\.1:{port}\b"), "127.0.0.1:8080"))
            self.regexes.append((re.compile(rf"localhost:{port}\b"), "localhost:8080"))

    def text(self, s: str) -> str:
        for a, b in self.pairs:
            s = s.replace(a, b)
        for rx, b in self.regexes:
            s = rx.sub(b, s)
        s = UUID.sub(self._uuid, s)
        s = LONG_HEX.sub(lambda m: "0" * len(m.group(0)), s)
        s = TIME.sub("2025-01-01T00:00:00Z", s)
        s = EPOCH_MS.sub("1700000000000", s)
        for rx, b in RUN_NOISE:
            s = rx.sub(b, s)
        # Only the recording's own dates: beta names and API versions carry dates too.
        return self.dates.sub(lambda m: "2025-01-01" if "-" in m.group(0) else "2025/01/01", s) \
            if self.dates else s

    def _uuid(self, m) -> str:
        key = m.group(0).lower()
        if key not in self.uuids:
            self.uuids[key] = f"00000000-0000-4000-8000-{len(self.uuids) + self.first_uuid:012d}"
        return self.uuids[key]

    def value(self, v):
        if isinstance(v, str):
            return self.text(v)
        if isinstance(v, list):
            return [self.value(x) for x in v]
        if isinstance(v, dict):
            return {self.text(k): self.value(x) for k, x in v.items()}
        if isinstance(v, int) and not isinstance(v, bool):  # unix times, s or ms
            if 1_600_000_000_000 <= v < 2_100_000_000_000:
                return 1_700_000_000_000
            if 1_600_000_000 <= v < 2_100_000_000:
                return 1_700_000_000
        return v

    def headers(self, pairs: list) -> dict:
        out = {}
        for k, v in pairs:
            if k in DROP_HEADERS:
                continue
            out[k] = "<redacted>" if k in AUTH_HEADERS else self.text(v)
        return dict(sorted(out.items()))


def _slug(path: str) -> str:
    return re.sub(r"[^A-Za-z0-9]", "-", path)


def _is_main_claude(body: dict) -> bool:
    names = {t.get("name") for t in (body or {}).get("tools") or []}
    return "Bash" in names


def _last_has_tool_result(body: dict) -> bool:
    """Whether this turn's new input (after the last assistant message) has a tool_result."""
    return any(b.get("type") == "tool_result"
               for m in _trailing((body or {}).get("messages") or [], "assistant")
               for b in _blocks(m.get("content")))


def _last_is_tool_output(body: dict) -> bool:
    items = (body or {}).get("input")
    return isinstance(items, list) and bool(items) and items[-1].get("type") == "function_call_output"


def name_requests(records: list[dict]) -> list[tuple[str, dict]]:
    """(file stem, record) for every recorded request: the key turns get the names the
    tests use, everything else `<client>_<run>_<nn>_<method>_<path>`."""
    named, others = [], {}

    def other(client, r, what):
        run = r["label"].split(".", 1)[1]
        others[run] = others.get(run, 0) + 1
        named.append((f"{client}_{run}_{others[run]:02d}_{what}", r))

    def what(r):
        path = urllib.parse.urlsplit(r["path"]).path
        slug = re.sub(r"[^a-z0-9]+", "_", path.lower()).strip("_").removeprefix("v1_") or "root"
        return f"{r['method'].lower()}_{slug}"

    for client, prefix in (("claude_code", "claude_code"), ("codex", "codex"),
                           ("openai_agents", "openai_agents"), ("openai_sdk", "openai_sdk"),
                           ("anthropic_sdk", "anthropic_sdk")):
        mine = [r for r in records if r["label"].split(".")[0] == client]
        seen = set()
        for r in mine:
            run_name = r["label"].split(".", 1)[1]
            body = r["body"] if isinstance(r["body"], dict) else {}
            stem = None
            if client == "claude_code" and r["method"] == "POST" and r["path"].split("?")[0].endswith("/v1/messages") \
                    and _is_main_claude(body):
                result = _last_has_tool_result(body)
                if run_name == "turn1":
                    stem = "claude_code_tool_result" if result else "claude_code_turn1"
                elif run_name == "turn2":
                    stem = "claude_code_turn2_tool_result" if result else "claude_code_turn2"
                else:
                    stem = f"claude_code_{run_name}_{'tool_result' if result else 'turn1'}"
            elif client == "codex" and r["method"] == "POST" and r["path"].endswith("/responses"):
                if run_name == "turn1":
                    stem = "codex_tool_output" if _last_is_tool_output(body) else "codex_turn1"
                else:
                    stem = "codex_turn2_tool_output" if _last_is_tool_output(body) else "codex_turn2"
            elif client == "openai_agents" and r["method"] == "POST" and r["path"].endswith("/responses"):
                kind = "tool_output" if _last_is_tool_output(body) else "turn1"
                stem = f"openai_agents_{kind}" if run_name == "run" else f"openai_agents_{run_name}_{kind}"
            elif client in ("openai_sdk", "anthropic_sdk") and r["method"] == "POST":
                turn = "tool_result" if (_last_has_tool_result(body) or _last_is_tool_output(body) or
                                         any(m.get("role") == "tool" for m in body.get("messages") or [])) \
                    else "turn1"
                stem = f"{prefix}_{run_name}_{turn}"
            if stem and stem not in seen:
                seen.add(stem)
                named.append((stem, r))
            else:
                other(client, r, what(r))
    return named


def scrub(raw: Path, out: Path, meta: dict) -> dict:
    """The raw recording into `out`; a recording of only some runs (`added_runs`, from
    --runs) replaces those runs' files and leaves every other file as it is, its ids
    and `seq` numbered on from theirs."""
    records = [json.loads(p.read_text()) for p in sorted(raw.glob("*.json"))]
    records = [r for r in records if "seq" in r]
    added = meta.get("added_runs")
    kept, first_uuid, first_seq = None, 1, 0
    out.mkdir(parents=True, exist_ok=True)
    if added:
        kept = json.loads((out / "index.json").read_text())
        gone = [f["file"] for f in kept["files"] if f["run"] in added]
        kept["files"] = [f for f in kept["files"] if f["run"] not in added]
        kept["runs"] = [r for r in kept["runs"] if r["label"] not in added]
        for name in gone:
            (out / name).unlink(missing_ok=True)
        texts = [(out / f["file"]).read_text() for f in kept["files"]]
        first_uuid = 1 + max((int(n) for t in texts for n in re.findall(r"00000000-0000-4000-8000-(\d{12})", t)),
                             default=0)
        first_seq = max(json.loads(t)["seq"] for t in texts)
    else:
        for stale in out.glob("*.json"):
            stale.unlink()
    scrubber = Scrubber(meta.get("scratch") or {}, meta.get("port"), meta.get("dates"), first_uuid)
    client_versions = meta.get("versions", {})
    index = {"recorded_with": meta.get("recorded_with"), "clients": client_versions,
             "runs": scrubber.value(meta.get("runs")), "files": []}
    if kept:
        index = kept | {"runs": kept["runs"] + index["runs"]}
    for stem, r in name_requests(records):
        client = r["label"].split(".")[0]
        doc = {
            "client": client, "client_version": client_versions.get(client),
            "run": r["label"], "seq": r["seq"] + first_seq,
            "method": r["method"], "path": scrubber.text(r["path"]),
            "headers": scrubber.headers(r["headers"]),
            "body": scrubber.value(r["body"]),
            "recorder_reply": r["reply"],
        }
        body = doc["body"]
        if isinstance(body, dict) and isinstance(body.get("client_metadata"), dict):
            # Codex fills it from a hash map: its order changes from run to run
            body["client_metadata"] = dict(sorted(body["client_metadata"].items()))
        if r.get("body_note"):
            doc["body_note"] = r["body_note"]
        text = json.dumps(doc, indent=1, ensure_ascii=False) + "\n"
        (out / f"{stem}.json").write_text(text)
        index["files"].append({"file": f"{stem}.json", "client": client, "run": r["label"],
                               "method": r["method"], "path": doc["path"], "bytes": len(text.encode()),
                               "body_bytes": r["body_decoded_bytes"], "reply": r["reply"]["kind"]})
    index["total_bytes"] = sum(f["bytes"] for f in index["files"])
    (out / "index.json").write_text(json.dumps(index, indent=1) + "\n")
    write_readme_inventory(out)
    return index


# -- the field inventory (tests/data/traffic/README.md) ------------------------------------------

API_OF = {"/v1/messages": "Anthropic Messages", "/v1/responses": "OpenAI Responses",
          "/v1/chat/completions": "OpenAI chat completions"}
CLIENT_NAMES = {"claude_code": "Claude Code", "codex": "Codex", "openai_agents": "openai-agents",
                "openai_sdk": "openai SDK", "anthropic_sdk": "anthropic SDK"}
LISTED_HEADERS = {"anthropic-beta", "openai-beta", "x-codex-beta-features"}  # shown in full
NOT_WALKED = {"input_schema", "parameters", "properties", "user_id", "input"}  # schemas, tool inputs
ID_LIKE = re.compile(r"^(?:[a-z]+_)?(?:rec_|0{8}-)|^(?:toolu|call|resp|fc|msg|fco)_")

# A suggestion per field, from issue 33's policy (honour what changes the reply; accept
# and name hints and bookkeeping; refuse what cannot be done). The server decides.
SUGGESTED = [
    (r"^(model|messages|system|max_tokens|max_output_tokens|stream|stream_options|instructions|input"
     r"|tools|tool_choice|parallel_tool_calls|previous_response_id)$", "honour"),
    (r"^messages\[\]\.role$", "honour (Claude Code sends `system` turns inside `messages`)"),
    (r"cache_control", "accept, ignore"),
    (r"\{tool_use\}\.id$|\.tool_use_id$|call_id$|\.tool_call_id$|tool_calls\[\]\{function\}\.id$",
     "honour: pairs a call with its result"),
    (r"^metadata|^client_metadata|^include$|\.id$|\.status$|\.annotations$|\.logprobs$",
     "accept, ignore"),
    (r"^thinking", "honour: the template's thinking switch (`display`: accept)"),
    (r"^context_management", "accept: thinking is not kept between turns anyway (name it)"),
    (r"^output_config", "accept, ignore (name it)"),
    (r"^reasoning", "honour: thinking switch; summary: accept"),
    (r"^store$", "honour (false: keep nothing)"),
    (r"^prompt_cache_key$", "honour: picks the KV cache to reuse"),
    (r"defer_loading", "accept: render the tool or leave it out, on purpose"),
    (r"\{web_search\}", "drop the hosted tool and name it"),
    (r"\{namespace\}", "honour: flatten to its functions"),
    (r"\.strict$", "honour (constrained arguments)"),
    (r"is_error$", "honour (render it)"),
    (r"^messages|^system|^input|^tools", "honour"),
]


def _suggest(path: str) -> str:
    return next((policy for rx, policy in SUGGESTED if re.search(rx, path)), "")


def _summary(x) -> str:
    if isinstance(x, list) and all(isinstance(i, str) for i in x) and len(json.dumps(x)) <= 80:
        return json.dumps(x)  # e.g. include: ["reasoning.encrypted_content"]
    if isinstance(x, str):
        if ID_LIKE.search(x):
            return "id"
        return json.dumps(x) if len(x) <= 32 else f"str ({len(x):,d} chars)" if len(x) > 200 else "str"
    if isinstance(x, (bool, int, float)) or x is None:
        return json.dumps(x)
    return "list" if isinstance(x, list) else "object"


def _walk(v, path: str, out: dict, client: str) -> None:
    if isinstance(v, dict):
        disc = v.get("type") if isinstance(v.get("type"), str) else None
        for k, x in v.items():
            p = (f"{path}{{{disc}}}.{k}" if disc and path else f"{path}.{k}" if path else k)
            out.setdefault(p, {}).setdefault(client, set()).add(_summary(x))
            if k not in NOT_WALKED or (k == "input" and path == ""):
                _walk(x, p, out, client)
    elif isinstance(v, list):
        for x in v:
            _walk(x, path + "[]", out, client)


def _schema_keywords(schema, out: set) -> None:
    if isinstance(schema, dict):
        for k, x in schema.items():
            if k == "properties" and isinstance(x, dict):
                for sub in x.values():
                    _schema_keywords(sub, out)
                continue
            out.add(k)
            _schema_keywords(x, out)
    elif isinstance(schema, list):
        for x in schema:
            _schema_keywords(x, out)


def _tool_schemas(body: dict):
    for tool in body.get("tools") or []:
        for inner in [tool, *(tool.get("tools") or [])]:
            schema = inner.get("input_schema") or inner.get("parameters") or \
                (inner.get("function") or {}).get("parameters")
            if schema:
                yield schema


def _cell(values: set | None) -> str:
    if not values:
        return ""
    values = sorted(values)
    shown = ", ".join(v.replace("|", "\\|") for v in values[:3])
    return shown + (f" (+{len(values) - 3})" if len(values) > 3 else "")


def inventory(out_dir: Path) -> str:
    """Markdown tables: every header, query parameter, body field (with block/item types
    in braces) and tool-schema keyword each client sent, per API."""
    paths = [p for p in sorted(out_dir.glob("*.json")) if p.name != "index.json"]
    docs = [json.loads(p.read_text()) for p in paths]
    lines = ["### Files", "", "| file | client | run | request | bytes | the recorder's reply |",
             "|---|---|---|---|---:|---|"]
    for p, d in sorted(zip(paths, docs), key=lambda x: x[1]["seq"]):
        lines.append(f"| `{p.name}` | {CLIENT_NAMES[d['client']]} {d['client_version']} | `{d['run']}` "
                     f"| `{d['method']} {d['path']}` | {p.stat().st_size:,d} | {d['recorder_reply']['kind']} |")
    lines += ["", f"Total: {sum(p.stat().st_size for p in paths):,d} bytes in {len(paths)} files.", ""]
    for route, api in API_OF.items():
        mine = [d for d in docs if d["path"].split("?")[0] == route]
        if not mine:
            continue
        clients = [c for c in CLIENT_NAMES if any(d["client"] == c for d in mine)]
        head = "| {} | " + " | ".join(CLIENT_NAMES[c] for c in clients) + " | suggested |"
        rule = "|---|" + "---|" * (len(clients) + 1)
        lines += [f"### {api}: `POST {route}`", "", f"Files: {len(mine)} "
                  f"({', '.join(sorted({d['client'] for d in mine}))}).", ""]
        # headers and query
        fields: dict = {}
        for d in mine:
            for k, v in d["headers"].items():
                shown = ("<redacted>" if v == "<redacted>" else
                         " ".join(f"`{b}`" for b in v.split(",")) if k in LISTED_HEADERS else _summary(v))
                fields.setdefault(k, {}).setdefault(d["client"], set()).add(shown)
            for k, v in urllib.parse.parse_qsl(urllib.parse.urlsplit(d["path"]).query):
                fields.setdefault(f"?{k}", {}).setdefault(d["client"], set()).add(json.dumps(v))
        lines += ["Headers and query parameters (transport headers dropped; auth values redacted):", "",
                  head.format("header / ?query"), rule]
        for k in sorted(fields):
            note = ("honour (the key check)" if k in ("authorization", "x-api-key") else
                    "accept, ignore" if k.startswith("?") or k not in ("content-type", "accept") else "")
            lines.append(f"| `{k}` | " + " | ".join(_cell(fields[k].get(c)) for c in clients) + f" | {note} |")
        lines.append("")
        fields = {}
        for d in mine:
            _walk(d["body"] or {}, "", fields, d["client"])
        lines += ["Body fields (`a[]{t}.b`: field b of the elements of a whose type is t):", "",
                  head.format("field"), rule]
        for k in sorted(fields, key=lambda p: (p.split(".")[0].split("[")[0].split("{")[0], p)):
            lines.append(f"| `{k}` | " + " | ".join(_cell(fields[k].get(c)) for c in clients)
                         + f" | {_suggest(k)} |")
        lines.append("")
        keywords: dict = {}
        for d in mine:
            kw: set = set()
            for schema in _tool_schemas(d["body"] or {}):
                _schema_keywords(schema, kw)
            if kw:
                keywords.setdefault(d["client"], set()).update(kw)
        if keywords:
            lines += ["JSON Schema keywords in the tools' schemas (what constrained decoding must compile):", ""]
            for c in clients:
                if keywords.get(c):
                    lines.append(f"- {CLIENT_NAMES[c]}: " + ", ".join(f"`{k}`" for k in sorted(keywords[c])))
            lines.append("")
    return "\n".join(lines)


def write_readme_inventory(out_dir: Path) -> None:
    """Replace the generated part of README.md (between the markers) with `inventory`."""
    readme = out_dir / "README.md"
    start, end = "<!-- inventory: generated by benchmarks/record_agents.py -->", "<!-- inventory end -->"
    text = readme.read_text() if readme.exists() else f"# Recorded client traffic\n\n{start}\n{end}\n"
    if start not in text:
        text += f"\n{start}\n{end}\n"
    before, rest = text.split(start, 1)
    after = rest.split(end, 1)[1] if end in rest else ""
    readme.write_text(f"{before}{start}\n\n{inventory(out_dir)}\n{end}{after}")


# -- main ------------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", default="claude,codex,agents,sdk")
    ap.add_argument("--claude-version", default="latest")
    ap.add_argument("--codex-version", default="latest")
    ap.add_argument("--codex-sandbox", default="workspace-write",
                    help="read-only | workspace-write | danger-full-access | bypass")
    ap.add_argument("--no-install", action="store_true", help="use what benchmarks/.cache holds")
    ap.add_argument("--scrub-only", action="store_true", help="re-scrub the last raw recording")
    ap.add_argument("--keep-scratch", action="store_true")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--runs", help="record only these runs and add their files to --out, leaving the "
                    f"others as they are (comma-separated: {', '.join(EXTRA_RUNS)})")
    args = ap.parse_args()
    clients = set(args.clients.split(","))
    added = args.runs.split(",") if args.runs else None
    if added:
        unknown = set(added) - set(EXTRA_RUNS)
        if unknown:
            ap.error(f"--runs: no run {', '.join(sorted(unknown))} (there are {', '.join(EXTRA_RUNS)})")
        clients = {"claude"}
    meta_path = RAW / "meta.json"

    if args.scrub_only:
        meta = json.loads(meta_path.read_text())
        index = scrub(RAW, args.out, meta)
        _report(index, meta)
        return 0

    start = time.monotonic()
    if ({"claude", "codex"} & clients) and not args.no_install:
        npm_install(args.claude_version, args.codex_version)
    vers = versions()
    python = agents_venv() if "agents" in clients else None
    vers["openai_agents"] = pip_version(python, "openai-agents") if python else None
    vers["openai_sdk"] = pip_version(sys.executable, "openai")
    vers["anthropic_sdk"] = pip_version(sys.executable, "anthropic")
    setup_s = time.monotonic() - start

    if RAW.exists():
        shutil.rmtree(RAW)
    scratch = make_scratch("record-agents-")
    scratches = [scratch]
    runs = []
    record_start = time.monotonic()
    with Recorder(RAW) as rec:
        print(f"recorder on 127.0.0.1:{rec.port}, raw requests in {RAW}", flush=True)
        if "claude" in clients and not added:
            runs += record_claude(rec, scratch)
        if "codex" in clients and not added:
            runs += record_codex(rec, scratch, args.codex_sandbox)
        if "agents" in clients and not added:
            runs += record_agents(rec, scratch, python)
        if "sdk" in clients and not added:
            runs += record_sdks(rec)
        for name in added or (EXTRA_RUNS if "claude" in clients else ()):
            scratches.append(make_scratch("record-agents-"))  # each a session of its own
            runs += EXTRA_RUNS[name](rec, scratches[-1])
        rec.label = "after"
        time.sleep(0.5)  # a straggling request still lands in the log
        port = rec.port
        summary = rec.summary
    record_s = time.monotonic() - record_start
    for r in runs:
        tail = (r.get("stderr") or r.get("error") or "").strip().splitlines()[-3:]
        print(f"{r['label']:32s} rc={r['rc']} {r.get('seconds', '')}s"
              f"{' TIMED OUT' if r.get('timed_out') else ''}  {' | '.join(tail)[:300]}")
    print("\nrequests:")
    for s in summary:
        print(f"  {s['seq']:3d} {s['label']:28s} {s['method']:5s} {s['path'][:60]:60s} "
              f"{s['body_bytes']:8d} B -> {s['status']} {s['reply']}")
    meta = {"versions": vers, "port": port, "dates": _recording_dates(),
            "scratch": [{k: str(v) for k, v in one.items()} for one in scratches],
            "recorded_with": {"node": _cmd_out(["node", "--version"]), "npm": _cmd_out(["npm", "--version"]),
                              "python": platform.python_version(), "setup_seconds": round(setup_s, 1),
                              "record_seconds": round(record_s, 1)},
            "runs": [{k: r.get(k) for k in ("label", "cmd", "rc", "timed_out", "seconds", "error")}
                     for r in runs]}
    if added:
        meta["added_runs"] = added
    for r in meta["runs"]:
        if r.get("cmd"):
            r["cmd"] = [c if not c.startswith(("/", "import")) else _short(c) for c in r["cmd"]]
    (RAW / "runs.log").write_text(json.dumps(runs, indent=1))
    meta_path.write_text(json.dumps(meta, indent=1))
    index = scrub(RAW, args.out, meta)
    _report(index, meta)
    if not args.keep_scratch:
        for one in scratches:
            shutil.rmtree(one["work"], ignore_errors=True)
    return 0


def _recording_dates() -> list[str]:
    """Today, yesterday and tomorrow (UTC and local), as YYYY-MM-DD and YYYY/MM/DD."""
    import datetime as dt

    days = set()
    for now in (dt.datetime.now(dt.timezone.utc), dt.datetime.now()):
        for delta in (-1, 0, 1):
            day = (now + dt.timedelta(days=delta)).date()
            days |= {day.isoformat(), day.strftime("%Y/%m/%d")}
    return sorted(days)


def _short(arg: str) -> str:
    if arg.startswith("import"):
        return "<openai-agents script, see record_agents.py AGENTS_SCRIPT>"
    return Path(arg).name


def _cmd_out(cmd) -> str | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
    except OSError:
        return None


def _report(index: dict, meta: dict) -> None:
    print(f"\nclients: {meta['versions']}")
    print(f"timing: {meta['recorded_with']}")
    for f in index["files"]:
        print(f"  {f['file']:52s} {f['bytes']:9,d} B  {f['method']} {f['path']}  -> {f['reply']}")
    print(f"total {index['total_bytes']:,d} bytes in {len(index['files'])} files")


if __name__ == "__main__":
    sys.exit(main())
