"""`llm mlxs serve --hosts`: mlx.launch as a child, started again when the pipeline fails.

mlx.launch ends every rank once one exits non-zero, then exits 0 itself: its end says
nothing. The ranks' stderr, relayed here to ours, does: a rank that fails says why in one
line (`mlx-stream: rank N on HOST: ...`), mlx.launch warns which rank ended first and
how, and rank 0 says `server stopped` when it was stopped on purpose. A pipeline that
ended any other way, while no one asked this process to stop, is started again with the
same arguments on the same port, within a budget of restarts; until then a stand-in
(process/standin.py) answers at its address with the failure.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Sequence
from urllib.parse import urlsplit

import click

from ... import discovery
from ...errors import MlxStreamError
from ...distributed.launch import due_signal, launch_command
from .standin import StandIn

RESTART_WAIT = 2.0  # seconds between a failure and the restart
STEADY = 600.0  # a pipeline that served this long before it failed starts the budget afresh

_RANK_LINE = re.compile(r"mlx-stream: (rank (\d+) on \S+: .+)")
_SERVING = re.compile(r"mlx-stream: serving on (\S+)")
_STOPPED = "mlx-stream: server stopped"
_ERROR = re.compile(r"^Error: (.+)")
_ENDED = re.compile(r"\[WARN\] Node with rank (\d+) (?:was (killed)|exited with code (-?\d+))")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")

# mlx.launch as distributed/launch.py runs it: signals left to the ranks, and the ranks
# stopped once this process is gone
_LAUNCHER = "import sys; from llm_mlx_streaming.distributed.launch import run_launcher; run_launcher(sys.argv[1:])"


class Ending:
    """How a run of the pipeline ended, read from its stderr line by line."""

    def __init__(self, hosts: Sequence[str]) -> None:
        self.hosts = list(hosts)
        self.lines: dict[int, str] = {}  # each rank's first line on why it failed
        self.ended: list[tuple[int, str]] = []  # (rank, how), as mlx.launch saw them end
        self.errors: list[str] = []  # `Error: ...` lines, from a rank that failed to start
        self.url: str | None = None  # where rank 0 listens, once it does
        self.listening_since: float | None = None
        self.stopped = False  # rank 0 said it was stopped on purpose

    def note(self, line: str) -> None:
        line = _ANSI.sub("", line).strip()
        if m := _RANK_LINE.search(line):
            self.lines.setdefault(int(m.group(2)), m.group(1))
        elif m := _SERVING.search(line):
            self.url, self.listening_since = m.group(1), time.monotonic()
        elif m := _ENDED.search(line):
            code = int(m.group(3) or 0)
            how = ("was killed" if m.group(2) else f"ended by {signal.Signals(-code).name}" if code < 0
                   else f"exited with code {code}")
            self.ended.append((int(m.group(1)), how))
        elif m := _ERROR.search(line):
            self.errors.append(m.group(1))
        elif line.endswith(_STOPPED):
            self.stopped = True

    def failure(self, launcher_code: int = 0) -> str | None:
        """One line on why the pipeline ended, or None when rank 0 was stopped on purpose.
        The rank that ended first is the one to name: its own line, or else how it ended."""
        said = f" ({self.errors[-1]})" if self.errors else ""
        if launcher_code:
            return f"mlx.launch exited with code {launcher_code}{said}"
        if self.ended:
            rank, how = self.ended[0]
            if rank in self.lines:
                return self.lines[rank]
            where = f"rank {rank} on {self.hosts[rank]}" if rank < len(self.hosts) else f"rank {rank}"
            if rank != 0:
                return f"{where} {how}"  # ended without a word: killed, or crashed
            if not self.lines:
                return f"{where} {how}{said}"  # an `Error:` line is rank 0's, at its start
        if self.lines:
            return next(iter(self.lines.values()))
        return None if self.stopped else f"the ranks ended without saying why{said}"


class Run:
    """One run of mlx.launch, in a process group of its own (the supervisor passes Ctrl-C
    on), its stderr relayed to ours line by line and read into `ending`."""

    def __init__(self, command: Sequence[str], hosts: Sequence[str]) -> None:
        self.ending = Ending(hosts)
        self.process = subprocess.Popen([sys.executable, "-c", _LAUNCHER, *command], stdin=subprocess.PIPE,
                                        stderr=subprocess.PIPE, start_new_session=True)
        self._relay = threading.Thread(target=self._read, name="mlx-stream-relay", daemon=True)
        self._relay.start()

    def _read(self) -> None:
        for raw in self.process.stderr:
            sys.stderr.buffer.write(raw)
            sys.stderr.buffer.flush()
            self.ending.note(raw.decode(errors="replace"))

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.process.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def join(self) -> None:
        self._relay.join(5)

    def failure(self) -> str | None:
        return self.ending.failure(self.process.returncode)


class Supervisor:
    """Run the pipeline until Ctrl-C or SIGTERM (then stop every rank, and return), or
    until it failed more often in a row than `restarts` allows (MlxStreamError, its line).
    A failure before rank 0 ever listened counts like any other."""

    def __init__(self, rank_args: Sequence[str], *, hosts: Sequence[str] | None, hostfile: str | None,
                 backend: str, ring_port: int | None, host: str, port: int, api_key: str | None,
                 restarts: int) -> None:
        self.rank_args, self.hostfile, self.backend, self.ring_port = list(rank_args), hostfile, backend, ring_port
        self.host, self.port, self.api_key, self.budget = host, port, api_key, restarts
        self.hosts = list(hosts) if hosts else _hostfile_hosts(hostfile)
        self._stop_at: float | None = None  # when Ctrl-C or SIGTERM came (a flag: set in a signal handler)
        self._run: Run | None = None
        self._stand_in: StandIn | None = None
        self._command(0, None)  # mlx.launch missing or a bad backend: refused before anything starts

    def _command(self, restarts: int, last_error: str | None) -> list[str]:
        args = [*self.rank_args, "--port", str(self.port), "--supervisor", f"{socket.gethostname()}:{os.getpid()}"]
        if restarts:
            args += ["--pipeline-restarts", str(restarts), "--pipeline-error", last_error]
        try:
            return launch_command(self.hosts if not self.hostfile else None, self.hostfile, self.backend,
                                  args, self.ring_port)
        except ValueError as e:
            raise MlxStreamError(str(e)) from None

    def run(self) -> None:
        running = discovery.read()
        if running is not None:
            raise MlxStreamError(f"A server already runs for this llm user dir at {running.url} (pid {running.pid})")
        previous = {s: signal.signal(s, self._stop) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            self._loop()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            if self._stand_in is not None:
                self._stand_in.close()
            kept = discovery.read()
            if kept is not None and kept.pid == os.getpid():  # rank 0's on this machine, or the stand-in's
                discovery.remove(kept)

    def _loop(self) -> None:
        spent = restarts = 0
        last = None
        while True:
            what = f"{len(self.hosts)} ranks" if self.hosts else "the hostfile's ranks"
            again = f" (restart {restarts})" if restarts else ""
            click.echo(f"mlx-stream: starting {what} with mlx.launch{again}", err=True)
            run = self._run = Run(self._command(restarts, last), self.hosts)
            if self._stop_at is not None:
                run.signal(signal.SIGINT)
            self._wait(run)
            self._run = None
            ending = run.ending
            if ending.url:
                self.port = urlsplit(ending.url).port or self.port
            line = run.failure()
            if self._stop_at is not None or line is None:
                return
            if run.process.returncode:  # mlx.launch itself refused: starting again would not help
                raise MlxStreamError(f"the pipeline could not start: {line}")
            if ending.listening_since is not None and time.monotonic() - ending.listening_since >= STEADY:
                spent = 0
            if spent >= self.budget:
                after = f" (after {restarts} restart{'s' if restarts != 1 else ''})" if restarts else ""
                raise MlxStreamError(f"the pipeline failed{after}: {line}")
            spent, restarts, last = spent + 1, restarts + 1, line
            click.echo(f"mlx-stream: the pipeline failed: {line}; restarting it in {RESTART_WAIT:g} s "
                       f"({self.budget - spent} more restart{'s' if self.budget - spent != 1 else ''} allowed)",
                       err=True)
            self._stand_by(line, restarts)
            if self._stop_at is not None:
                return

    def _stand_by(self, line: str, restarts: int) -> None:
        """Answer at the server's address with the failure for RESTART_WAIT seconds."""
        state = {"pipeline_state": "restarting", "pipeline_error": line, "pipeline_restarts": restarts}
        try:
            self._stand_in = StandIn(self.host, self.port, state, self.api_key).start()
            self.port = self._stand_in.port
        except OSError as e:
            self._stand_in = None
            click.echo(f"mlx-stream: nothing answers at {self.host}:{self.port} meanwhile ({e.strerror or e})",
                       err=True)
        until = time.monotonic() + RESTART_WAIT
        while self._stop_at is None and time.monotonic() < until:
            time.sleep(0.1)
        if self._stand_in is not None:
            self._stand_in.close()  # its discovery file stays until the next rank 0 takes it over

    def _wait(self, run: Run) -> None:
        while True:
            try:
                run.process.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                pass
            if self._stop_at is not None:
                sig = due_signal(time.monotonic() - self._stop_at)
                if sig is not None:
                    run.signal(sig)
        if run.process.returncode < 0:  # mlx.launch was killed: what it started stops as on Ctrl-C
            run.signal(signal.SIGINT)
        run.join()

    def _stop(self, signum, frame) -> None:
        if self._stop_at is not None:
            return
        self._stop_at = time.monotonic()
        if self._run is not None:
            self._run.signal(signal.SIGINT)


def _hostfile_hosts(path: str | None) -> list[str]:
    """Each rank's host in mlx.launch's hostfile (a list of hosts, or an object with
    `hosts`), to name a rank that ended without a word; [] when it cannot be read."""
    try:
        with open(path) as f:
            data = json.load(f)
        hosts = data["hosts"] if isinstance(data, dict) else data
        return [str(h["ssh"]) for h in hosts]
    except (OSError, ValueError, TypeError, KeyError):
        return []
