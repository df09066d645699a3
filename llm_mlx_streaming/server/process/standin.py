"""What answers at a pipeline server's address while its ranks restart.

Between a failure and the new rank 0 listening, a client should learn what happened,
not find nothing (or, worse, load the model on its own): the stand-in answers
`/api/stats` with the failure, `/health` with 503 and this server's id (so the `llm`
client knows it is ours and shows the error), everything else with 503, Retry-After and
the error in the OpenAI shape; it points the discovery file at itself. The standard
library's http.server on a thread: it serves seconds at a time, to few clients.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from ... import discovery
from ..guard import key_accepted

RETRY_AFTER_SECONDS = 10


class StandIn:
    """Serve `state` (pipeline_error, pipeline_state, pipeline_restarts) on host:port
    until `close()`; `api_key`, when set, guards every path but /health as the server does."""

    def __init__(self, host: str, port: int, state: dict, api_key: str | None = None) -> None:
        self.state, self.api_key = state, api_key
        self.secret = discovery.new_secret()
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        server_class = type("Server", (ThreadingHTTPServer,), {"address_family": family,
                                                               "daemon_threads": True})
        self.http = server_class((host, port), _handler(self))
        self.port = self.http.server_address[1]
        self.info = discovery.ServerInfo(os.getpid(), discovery.connect_host(host), self.port, self.secret)
        self._thread = threading.Thread(target=self.http.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="mlx-stream-stand-in", daemon=True)

    def start(self) -> "StandIn":
        self._thread.start()
        discovery.write(self.info)
        return self

    def close(self) -> None:
        """Stop answering; the discovery file stays, for the next rank 0 to take over
        (`forget()` removes it)."""
        self.http.shutdown()
        self.http.server_close()
        self._thread.join(5)

    def forget(self) -> None:
        discovery.remove(self.info)

    def error(self) -> dict:
        message = (f"the pipeline is restarting after a failure ({self.state['pipeline_error']}); "
                   f"retry in a few seconds")
        return {"error": {"message": message, "type": "server_error", "param": None,
                          "code": "pipeline_restarting"}}

    def allowed(self, headers) -> bool:
        return self.api_key is None or key_accepted(headers, (self.api_key, self.secret))


def _handler(stand_in: StandIn):
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?")[0]
            length = int(self.headers.get("Content-Length") or 0)
            self.rfile.read(min(length, 1 << 20))  # read before answering: unread bytes reset the socket
            if path == "/health":
                self._send(503, {"status": "restarting", "id": discovery.public_id(stand_in.secret),
                                 **stand_in.error()})
            elif not stand_in.allowed(self.headers):
                self._send(401, {"error": {"message": "missing or wrong API key", "type": "invalid_request_error",
                                           "param": None, "code": "invalid_api_key"}})
            elif path == "/api/stats":
                self._send(200, dict(stand_in.state))
            else:
                self._send(503, stand_in.error(), {"Retry-After": str(RETRY_AFTER_SECONDS)})

        do_POST = do_PUT = do_DELETE = do_GET

        def _send(self, status: int, body: dict, headers: dict | None = None) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            for name, value in {"Content-Type": "application/json", "Content-Length": str(len(data)),
                                **(headers or {})}.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args) -> None:
            pass

    return Handler
