"""The recording server: every request logged to the raw folder, answered by Replies."""

from __future__ import annotations

import base64
import gzip
import http.server
import json
import re
import threading
import time
import urllib.parse
import zlib
from pathlib import Path

from .replies import Replies, models_list, usage_estimate

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
            return 200, {"input_tokens": usage_estimate(size)}, None
        if method == "POST" and path.endswith("/messages"):
            return self.replies.anthropic(body, label, size)
        if method == "POST" and path.endswith("/responses"):
            return self.replies.responses(body, label, size)
        if method == "POST" and path.endswith("/chat/completions"):
            return self.replies.chat(body, label, size)
        if method == "GET" and path.endswith("/models"):
            return 200, models_list(), None
        if method == "GET" and "/models/" in path:
            return 200, models_list()["data"][0], None
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
