"""The server `llm mlxs launch` points an agent at: the one already running for this llm
user dir, or one started here in the background (its output in a log file), loaded
before the agent starts and stopped when the agent is done."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

import click
import llm

from .. import discovery
from ..client.client import ServerClient, ServerGone
from ..errors import MlxStreamError
from ..options import registry

LOG_NAME = "launch-serve.log"
POLL_SECONDS = 0.1
STOP_SECONDS = 30  # for a stopped server to remove its discovery file and exit


@dataclass
class Served:
    url: str
    key: str  # the discovery secret: accepted as the bearer token, with --api-key too
    model_id: str
    process: Optional[subprocess.Popen] = None  # started here, so stopped by close()
    small_model_id: Optional[str] = None  # a second model served beside it (an agent's fast tier)

    def close(self) -> None:
        if self.process is not None:
            stop(self.process)


def serve(model: Optional[str], wait: float, small: Optional[str] = None) -> Served:
    """A server for `model` (None: the running server's model, else the default one),
    with the model loaded, and `small` loaded beside it when given; MlxStreamError in one
    line when there is none within `wait` s."""
    deadline = time.monotonic() + wait
    info = discovery.read()
    if info is not None:
        client = ServerClient(info)
        if client.is_ours():
            served = _reuse(client, model, deadline)
            if small:
                client.load(model_id(small), timeout=max(1.0, deadline - time.monotonic()))
            return replace(served, small_model_id=model_id(small) if small else None)
    return _start(model_id(model), deadline, model_id(small) if small else None)


def model_id(model: Optional[str]) -> str:
    """The model id a name stands for; the default model's own id for none, so the
    agent's requests and the replies name it."""
    return registry.model_id_for(model or registry.default_name())


def _reuse(client: ServerClient, model: Optional[str], deadline: float) -> Served:
    stats = client.stats()
    loaded = stats.get("model")
    want = model_id(model) if model else (loaded or model_id(None))
    if loaded and loaded != want:
        raise MlxStreamError(f"The server at {client.url} (pid {client.info.pid}) serves {loaded}: launch with that "
                             f"model, or stop that server to serve {want}")
    served = Served(client.url, client.info.secret, want)
    if stats.get("state") == "loaded" and loaded == want:
        _say(f"using the server at {client.url} ({want})")
        return served
    _say(f"loading {want} on the server at {client.url}")
    start = time.monotonic()
    if stats.get("state") == "loading" and loaded == want:
        _wait_loaded(client, want, deadline, lambda: None)
    else:
        client.load(want, timeout=max(1.0, deadline - time.monotonic()))
    _say(f"{want} loaded in {time.monotonic() - start:.1f} s")
    return served


def _start(want: str, deadline: float, small: Optional[str] = None) -> Served:
    log_path = llm.user_dir() / "mlx-streaming" / LOG_NAME
    log_path.parent.mkdir(parents=True, exist_ok=True)
    _say(f"starting a server for {want} (log: {log_path})")
    start = time.monotonic()
    with open(log_path, "wb") as log:
        # its own session: Ctrl-C in the agent's terminal is the agent's, and the
        # server is stopped by close() once the agent is done
        beside = ["-m", small] if small else []
        process = subprocess.Popen([sys.executable, "-m", "llm", "mlxs", "serve", "--port", "0", "-m", want, *beside,
                                    "--any-model"], stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    try:
        client = _wait_started(process, log_path, deadline)
        _say(f"loading {want}")
        for each in (want, *([small] if small else [])):
            _wait_loaded(client, each, deadline, lambda: _check_alive(process, log_path))
    except BaseException:
        stop(process)
        raise
    _say(f"{want} loaded in {time.monotonic() - start:.1f} s; serving on {client.url}")
    return Served(client.url, client.info.secret, want, process, small)


def _wait_started(process: subprocess.Popen, log_path: Path, deadline: float) -> ServerClient:
    """The client of the server `process` runs, once its discovery file names it."""
    while time.monotonic() < deadline:
        _check_alive(process, log_path)
        info = discovery.read()
        if info is not None and info.pid == process.pid:
            return ServerClient(info, timeout=10)
        time.sleep(POLL_SECONDS)
    raise MlxStreamError(f"The server did not start in time (log: {log_path})")


def _wait_loaded(client: ServerClient, want: str, deadline: float, check) -> None:
    while time.monotonic() < deadline:
        check()
        try:
            stats = client.stats()
        except ServerGone:  # not answering yet
            stats = {}
        if stats.get("state") == "error":
            raise MlxStreamError(f"The server could not load {want}: {stats.get('error')}")
        if any(want in m["ids"] for m in stats.get("models", ())):  # loaded, beside others or alone
            return
        time.sleep(POLL_SECONDS)
    raise MlxStreamError(f"{want} was not loaded in time (raise --wait)")


def _check_alive(process: subprocess.Popen, log_path: Path) -> None:
    if process.poll() is not None:
        raise MlxStreamError(f"The server exited (status {process.returncode}): {_last_line(log_path)} "
                             f"(log: {log_path})")


def _last_line(path: Path) -> str:
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1].strip() if lines else "it said nothing"


def stop(process: subprocess.Popen) -> None:
    """SIGTERM, as `llm mlxs serve` expects (it removes its discovery file); killed if
    it has not exited in STOP_SECONDS."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(STOP_SECONDS)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(STOP_SECONDS)


def _say(text: str) -> None:
    click.echo(f"mlx-stream: {text}", err=True)
