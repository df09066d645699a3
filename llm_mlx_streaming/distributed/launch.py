"""Starting the ranks: the `mlx.launch` command that runs one `llm mlxs serve` rank per
host, and what each rank does once started (rank 0 serves, the others follow; a
serving rank 0 leaves once its pipeline broke, and stops once its supervisor is gone)."""

from __future__ import annotations

import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

BACKENDS = ("ring", "mpi")


def launch_command(hosts: Sequence[str] | None, hostfile: str | None, backend: str,
                   rank_args: Sequence[str], ring_port: int | None = None) -> list[str]:
    """mlx.launch over `hosts` (or `hostfile`), each rank running this Python's
    `llm mlxs serve` with `rank_args`; the ring listens from `ring_port` when given."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    launcher = Path(sys.executable).with_name("mlx.launch")
    if not launcher.exists():
        found = shutil.which("mlx.launch")
        if found is None:
            raise ValueError("mlx.launch is not installed beside this Python (it comes with mlx)")
        launcher = Path(found)
    where = ["--hostfile", hostfile] if hostfile else ["--hosts", ",".join(hosts or ())]
    if ring_port is not None:
        where += ["--starting-port", str(ring_port)]
    return [str(launcher), "--backend", backend, *where, "--", sys.executable,
            "-m", "llm", "mlxs", "serve", *rank_args]


def join(backend: str, budgets: list[int] | None = None, restarts: int = 0,
         last_error: str | None = None, **plan_options):
    """This rank's part: a PipelineEngine made the process-wide engine on rank 0
    (returned, to serve), or None on another rank once rank 0 has sent it home.
    `budgets`: each host's memory in bytes, planned with `plan_options`; `restarts` and
    `last_error` are the supervisor's word, for rank 0's figures."""
    from ..engine.manager import use_manager
    from .engine import PipelineEngine, follow
    from .group import init

    group = init(backend)
    if group.rank != 0:
        # Ctrl-C reaches every local rank at once: rank 0 sends the others home (or
        # its end fails their collectives), so that no rank is left halfway
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        follow(group)
        return None
    if budgets is not None and len(budgets) != group.size:
        group.broadcast({"op": "stop"})
        raise ValueError(f"{len(budgets)} budgets for {group.size} ranks")
    engine = PipelineEngine(group, budgets, restarts, last_error, **plan_options)
    use_manager(engine)
    return engine


def leave_when_broken(engine, busy: Callable[[], bool], forget: Callable[[], None],
                      grace: float = 5.0) -> None:
    """Once `engine`'s pipeline broke, end rank 0's process with its one line on stderr:
    mlx.launch then ends the other ranks at once (none waits out a timeout) and the
    supervisor restarts them. The failing request's reply goes out first: the exit
    waits while `busy()` (responses under way), at most `grace` seconds; `forget()`
    removes the discovery file."""

    def wait() -> None:
        engine.failed.wait()
        deadline = time.monotonic() + grace
        while busy() and time.monotonic() < deadline:
            time.sleep(0.05)
        forget()
        print(f"mlx-stream: {engine.group.where(0)}: {engine.broken}", file=sys.stderr, flush=True)
        os._exit(1)

    threading.Thread(target=wait, name="mlx-stream-leave", daemon=True).start()


def stop_when_unsupervised(gone: Callable[[], bool], every: float = 1.0) -> None:
    """Once `gone()` says the supervisor ended without a word (killed), stop rank 0 as
    Ctrl-C does: it sends the other ranks home and mlx.launch ends with them, instead of
    every rank running on with no one left to stop it. Checked every `every` seconds."""

    def watch() -> None:
        while not gone():
            time.sleep(every)
        print("mlx-stream: the supervisor is gone: stopping the ranks", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=watch, name="mlx-stream-supervised", daemon=True).start()

