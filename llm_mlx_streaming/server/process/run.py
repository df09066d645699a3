"""Start and stop a server: bind, write the discovery file, run uvicorn, clean up.

`llm mlxs serve` runs it in the foreground; tests run the same object on a thread.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
import threading
import time
from typing import Callable, Optional

import uvicorn

from ... import discovery
from ...errors import MlxStreamError, SettingsError
from ...options import registry
from ...options.settings import load_settings
from ..banner import Banner


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, api_key: Optional[str]) -> None:
    """Refuse an address beyond loopback without a key (a pipeline checks before its ranks start)."""
    if not is_loopback(host) and not api_key:
        raise MlxStreamError(f"Binding {host} (not loopback) needs --api-key, so that no one else on the network can use it")


class Server:
    def __init__(self, *, host: str = "127.0.0.1", port: int = 0, model: Optional[str] = None,
                 api_key: Optional[str] = None, max_queue: int = 8, hosts: Optional[list[str]] = None,
                 origins: Optional[list[str]] = None, keeper: Optional[int] = None, strict: bool = False,
                 aliases: Optional[dict[str, str]] = None, any_model: bool = False,
                 pinned: Optional[tuple[str, ...]] = None, max_models: Optional[int] = None,
                 sigterm_handled: Optional[Callable[[], bool]] = None, say: Optional[Callable[..., None]] = None,
                 live: bool = False) -> None:
        """`pinned`: models loaded at start and never unloaded (None: `model`, when given; a
        pipeline's rank 0 gives none, its one model is swapped for the next one asked for);
        `max_models`: most models loaded at once (None: the setting). `keeper`: the pid of a pipeline's supervisor on this machine, which keeps the
        discovery file: the file names it, so that it outlives this rank 0 while the ranks
        restart; this server takes over the file of its stand-in (process/standin.py) and
        leaves the file behind. `sigterm_handled()`: asked first when a SIGTERM comes; True
        keeps the server going (a pipeline's rank 0 failing its generation: it leaves by
        itself, distributed/engine.py `ended_elsewhere`). `say(text, end)`: where the server
        tells each load and, once ready, where things are (server/banner.py; `live`: a
        terminal, where a load's line shows its progress); None: nowhere."""
        from ..app import create_app
        from ..service import Service

        check_exposure(host, api_key)
        running = discovery.read()
        if running is not None and running.pid != keeper:
            raise MlxStreamError(f"A server already runs for this llm user dir at {running.url} (pid {running.pid})")
        from ..errors import ApiError

        settings = load_settings()
        hosts = [host] + (settings.server_hosts if hosts is None else hosts)  # its own address too
        origins = settings.server_origins if origins is None else origins
        self.service = Service(default_model=model, api_key=api_key, secret=discovery.new_secret(),
                               max_queue=max_queue, hosts=tuple(hosts), origins=tuple(origins),
                               max_batch=settings.max_batch, reply_memory=settings.reply_memory, strict=strict,
                               aliases=aliases, any_model=any_model,
                               pinned=tuple(dict.fromkeys([model] if model and pinned is None else pinned or ())),
                               max_models=max_models)
        for name in self.service.hosting.pinned or ([model] if model else []):
            try:
                self.service.policy.model_for(name)
            except ApiError:
                raise MlxStreamError(f"Unknown model '{name}'; see `llm mlxs models`") from None
        for alias, target in (aliases or {}).items():
            try:
                registry.model_id_for(target)
            except SettingsError:
                raise MlxStreamError(f"--model-alias {alias}={target}: no model {target!r}; see `llm mlxs models`") from None
        try:
            family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
            self.sock = socket.create_server((host, port), family=family)
        except OSError as e:
            raise MlxStreamError(f"Cannot listen on {host}:{port}: {e.strerror or e}") from None
        self.port = self.sock.getsockname()[1]
        self.keeper = keeper
        self.info = discovery.ServerInfo(keeper or os.getpid(), discovery.connect_host(host), self.port,
                                         self.service.policy.secret)
        config = uvicorn.Config(create_app(self.service), log_level="warning", access_log=False,
                                lifespan="on", timeout_graceful_shutdown=5)
        self.uvicorn = _Uvicorn(config, self.service, sigterm_handled)
        self._thread: Optional[threading.Thread] = None
        self.banner = Banner(self.service, self.url, api_key, say, live, lambda: self.uvicorn.started) if say else None

    @property
    def url(self) -> str:
        return self.info.url

    def serve(self) -> None:
        """Run until stopped (Ctrl-C in the foreground); the discovery file lives as long."""
        discovery.write(self.info)
        if self.banner is not None:
            self.banner.start()
        try:
            self.uvicorn.run(sockets=[self.sock])
        finally:
            if self.banner is not None:
                self.banner.stop()
            self.forget()
            self.sock.close()

    def busy(self) -> bool:
        """Whether a request is still being answered."""
        return bool(self.uvicorn.server_state.tasks)

    def forget(self) -> None:
        """Remove the discovery file, unless a supervisor keeps it."""
        if self.keeper is None:
            discovery.remove(self.info)

    def start(self, timeout: float = 30.0) -> "Server":
        """Serve on a thread; return once it answers."""
        self._thread = threading.Thread(target=self.serve, name="mlx-stream-server", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.uvicorn.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 15.0) -> None:
        self.uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class _Uvicorn(uvicorn.Server):
    """uvicorn, whose shutdown (Ctrl-C, SIGTERM, `stop`) first ends the replies in flight,
    so that their streams close before its grace period is over."""

    def __init__(self, config: uvicorn.Config, service, sigterm_handled=None) -> None:
        super().__init__(config)
        self.service, self.sigterm_handled = service, sigterm_handled

    def handle_exit(self, sig: int, frame) -> None:
        if sig == signal.SIGTERM and not self.should_exit and self.sigterm_handled and self.sigterm_handled():
            return
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: Optional[list[socket.socket]] = None) -> None:
        self.service.stop()
        await super().shutdown(sockets)
