"""The file that tells `llm` commands a server runs for this llm user dir.

It holds the server's pid, address and a per-server secret (the `llm` CLI's bearer
token), so it is written with mode 0600. A file whose process has gone, or whose fields
are not a pid, a host and a port, is removed by whoever finds it (with a one-line notice
for a damaged one); the server's `/health` answers with `public_id(secret)`, so a client
also knows a pid or port taken over by some other program.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import re
import secrets
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import click
import llm

FILENAME = "server.json"
_HOSTNAME = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9-]{1,63}(?<!-))*")


@dataclass(frozen=True)
class ServerInfo:
    pid: int
    host: str
    port: int
    secret: str

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


def connect_host(host: str) -> str:
    """Where a client on this machine reaches a server bound to `host`."""
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "::1"
    return host


def discovery_path() -> Path:
    return llm.user_dir() / "mlx-streaming" / FILENAME


def new_secret() -> str:
    return secrets.token_urlsafe(24)


def public_id(secret: str) -> str:
    """What the server's unauthenticated `/health` shows: names this server, gives
    nothing of its secret away."""
    return hashlib.sha256(b"mlx-stream server " + secret.encode()).hexdigest()[:16]


def write(info: ServerInfo) -> Path:
    """Write the file atomically, readable by its owner only."""
    path = discovery_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".server-")  # mkstemp creates it 0600
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(info), f)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def alive(pid: int) -> bool:
    """Whether process `pid` runs (on this machine)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive, but not ours to judge
    return True


def read() -> Optional[ServerInfo]:
    """The running server's details; None when there is none (a stale file is removed,
    a damaged one too, with a notice naming it)."""
    path = discovery_path()
    try:
        info = parse(json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        forget(path, f"it is not a server's address ({exc})")
        return None
    if not alive(info.pid):
        remove_stale(path)
        return None
    return info


def parse(data) -> ServerInfo:
    """The file's fields, checked; ValueError naming the first bad one."""
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    pid, host, port, secret = (data.get(k) for k in ("pid", "host", "port", "secret"))
    if type(pid) is not int or pid <= 0:
        raise ValueError(f"pid {pid!r} is not a process id")
    if type(port) is not int or not 0 < port < 65536:
        raise ValueError(f"port {port!r} is not a TCP port")
    if not isinstance(host, str) or not _is_host(host):
        raise ValueError(f"host {host!r} is not an address")
    if not isinstance(secret, str) or not secret:
        raise ValueError("it has no secret")
    return ServerInfo(pid=pid, host=host, port=port, secret=secret)


def _is_host(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return len(host) <= 253 and _HOSTNAME.fullmatch(host) is not None


def forget(path: Path, why: str) -> None:
    """Remove a discovery file that names no server of ours, and say so in one line."""
    remove_stale(path)
    click.echo(f"Removed {path}: {why}; running in-process", err=True)


def remove_stale(path: Optional[Path] = None) -> None:
    try:
        (path or discovery_path()).unlink()
    except OSError:
        pass


def remove(info: ServerInfo) -> None:
    """Remove the file if it is still this server's (a newer server may own it)."""
    path = discovery_path()
    try:
        if json.loads(path.read_text()).get("secret") == info.secret:
            path.unlink()
    except (OSError, ValueError):
        pass
