"""Starting the ranks: the `mlx.launch` command that runs one `llm mlxs serve` rank per
host, mlx.launch's process, and what each rank does once started (rank 0 serves, the
others follow; a serving rank 0 leaves once its pipeline broke).

Nothing runs on unsupervised: each process of a pipeline ends once the one that started
it is gone, however it went (SIGKILL, a crash, a closed terminal). mlx.launch, whose
parent is the supervisor (`llm mlxs serve --hosts`), stops the ranks as the supervisor
would; a rank whose mlx.launch is gone stops (rank 0, as on Ctrl-C) or, following, leaves
unless rank 0 sends it home first. A stop is bounded in time: Ctrl-C, then SIGTERM, then
SIGKILL (`due_signal`)."""

from __future__ import annotations

import os
import runpy
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

BACKENDS = ("ring", "mpi")
STOP_GRACE = 6.0  # seconds a pipeline's processes get to stop after Ctrl-C, then SIGTERM
KILL_AFTER = 8.0  # then SIGKILL: every process of a stopped pipeline is gone within 10 s
ORPHAN_POLL = 0.2  # seconds between two looks at a process's parent


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
        leave_when_orphaned()
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


def due_signal(late: float) -> Optional[int]:
    """The signal a pipeline's processes are due `late` seconds after Ctrl-C asked them to
    stop: none yet, SIGTERM, then SIGKILL."""
    if late < STOP_GRACE:
        return None
    return signal.SIGTERM if late < KILL_AFTER else signal.SIGKILL


def run_launcher(argv: Sequence[str]) -> None:
    """Run mlx.launch (`argv`: its command line) in the process group the supervisor made
    for it. Ctrl-C and SIGTERM are left to the ranks (handlers that do nothing, which exec
    does not pass on: mlx.launch ends once they have, without a traceback, and SIGKILL is
    the only end it can be given before them). Once the supervisor is gone, the group is
    stopped as the supervisor stops it."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *a: None)
    when_orphaned(_stop_own_group)
    sys.argv = list(argv)
    runpy.run_path(sys.argv[0], run_name="__main__")


def _stop_own_group() -> None:
    """Ctrl-C to this process's group (mlx.launch, its local ranks, the ssh sessions of
    the others), then SIGTERM and SIGKILL as they fall due; mlx.launch ends before them
    once the ranks have."""
    os.killpg(0, signal.SIGINT)
    began = time.monotonic()
    while True:
        time.sleep(ORPHAN_POLL)
        sig = due_signal(time.monotonic() - began)
        if sig is not None:
            os.killpg(0, sig)


def stop_when_orphaned() -> None:
    """Rank 0, once mlx.launch is gone: stop as on Ctrl-C (it sends the others home)."""
    when_orphaned(lambda: os.kill(os.getpid(), signal.SIGINT))


def leave_when_orphaned() -> None:
    """Another rank, once mlx.launch is gone: leave, unless rank 0 sent it home within
    STOP_GRACE seconds (rank 0 may be gone too, and a ring that lost a peer may never fail
    the wait under way: the rank would spin in it)."""

    def leave() -> None:
        time.sleep(STOP_GRACE)
        os._exit(1)

    when_orphaned(leave)


def when_orphaned(action: Callable[[], None]) -> None:
    """Run `action()` on a daemon thread once this process's parent is gone (the process
    was handed to another: the parent ended, or is a zombie no one waits for). Its output
    is first pointed at /dev/null: the pipes' other ends were the parent's, and writing to
    a closed pipe would fail the stop that follows."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(ORPHAN_POLL)
        devnull = os.open(os.devnull, os.O_WRONLY)
        for fd in (1, 2):
            os.dup2(devnull, fd)
        os.close(devnull)
        action()

    threading.Thread(target=watch, name="mlx-stream-orphaned", daemon=True).start()
