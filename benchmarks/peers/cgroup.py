"""A memory cgroup for the I/O-bound runs (`--iobound MB`).

A process's page-cache pages are charged to its memory cgroup, so a child in a cgroup
limited below the checkpoint's size cannot keep the checkpoint cached: its expert reads
wait on the disk, as on a machine whose memory is smaller than the model. Making one
needs root and a memory controller (cgroup v2 with `memory` enabled for children of the
current group, or the v1 `memory` hierarchy).
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")


class CgroupError(RuntimeError):
    """No memory cgroup can be made here; the message says what is needed."""


def _own_group(hierarchy: str) -> str:
    """This process's group in the v2 tree ("") or the v1 hierarchy named `hierarchy`."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if (hierarchy == "" and controllers == "") or hierarchy in controllers.split(","):
            return path.lstrip("/")
    return ""


class MemoryCgroup:
    """A new cgroup under this process's own, with `limit` bytes of memory (page cache
    included) and no swap; `enter` (a subprocess preexec_fn) moves the calling process
    into it."""

    def __init__(self, limit: int, name: str | None = None):
        if os.geteuid() != 0:
            raise CgroupError("--iobound needs root, to make a memory cgroup that keeps the checkpoint "
                              "out of the page cache (run the benchmark as root)")
        name = name or f"mlxs-iobound-{os.getpid()}"
        if (ROOT / "cgroup.controllers").exists():  # v2 (unified)
            parent = ROOT / _own_group("")
            if "memory" not in (parent / "cgroup.subtree_control").read_text().split():
                try:
                    (parent / "cgroup.subtree_control").write_text("+memory")
                except OSError as e:
                    raise CgroupError(f"--iobound needs the memory controller enabled for children of "
                                      f"{parent} (cgroup v2): {e}") from None
            self.path, self.v2 = parent / name, True
        elif (ROOT / "memory").is_dir():  # v1
            self.path, self.v2 = ROOT / "memory" / _own_group("memory") / name, False
        else:
            raise CgroupError(f"--iobound needs a cgroup memory controller; none is mounted under {ROOT}")
        try:
            self.path.mkdir(exist_ok=True)
            if self.v2:
                (self.path / "memory.max").write_text(str(limit))
                if (self.path / "memory.swap.max").exists():
                    (self.path / "memory.swap.max").write_text("0")
            else:
                (self.path / "memory.limit_in_bytes").write_text(str(limit))
        except OSError as e:
            raise CgroupError(f"--iobound could not make the memory cgroup {self.path}: {e}") from None
        self.limit = limit

    def enter(self) -> None:
        """Move the calling process (a child before exec) into the cgroup."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def describe(self) -> str:
        return f"memory cgroup {self.path} ({'v2' if self.v2 else 'v1'}), limit {self.limit / 1e6:.0f} MB"

    def close(self) -> None:
        try:
            self.path.rmdir()
        except OSError:
            pass
