"""The file that tells `llm` commands a server runs for this llm user dir.

It holds the server's pid, address and a per-server secret (the `llm` CLI's bearer
token), so it is written with mode 0600. A file whose process has gone is stale and is
removed by whoever finds it.
"""

from __future__ import annotations

import json
import os
import secrets
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import llm

FILENAME = "server.json"


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


def discovery_path() -> Path:
    return llm.user_dir() / "mlx-streaming" / FILENAME


def new_secret() -> str:
    return secrets.token_urlsafe(24)


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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive, but not ours to judge
    return True


def read() -> Optional[ServerInfo]:
    """The running server's details; None when there is none (a stale or unreadable
    file is removed)."""
    path = discovery_path()
    try:
        data = json.loads(path.read_text())
        info = ServerInfo(pid=int(data["pid"]), host=str(data["host"]), port=int(data["port"]),
                          secret=str(data["secret"]))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        remove_stale(path)
        return None
    if not _alive(info.pid):
        remove_stale(path)
        return None
    return info


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
