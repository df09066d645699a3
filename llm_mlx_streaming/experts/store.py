"""Reads experts' bytes from the checkpoint straight into pool slot buffers.

Every (expert, component) range is one `os.preadv` into a numpy view of the slot, so
no intermediate copy is made; the ranges of one call are issued in ascending file
offset on a thread pool, since the SSD (and the OS) serve parallel reads best.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import numpy as np

DEFAULT_THREADS = 8


class ExpertStore:
    """Open shard files and a read thread pool, shared by every layer's pool."""

    def __init__(self, threads: int = DEFAULT_THREADS):
        self.threads = max(1, int(threads))
        self._fds: dict[Path, int] = {}
        self._executor = ThreadPoolExecutor(self.threads, thread_name_prefix="mlxs-read")

    def _fd(self, file: Path) -> int:
        fd = self._fds.get(file)
        if fd is None:
            fd = self._fds[file] = os.open(file, os.O_RDONLY)
        return fd

    def read(self, jobs: list[tuple[Path, int, np.ndarray]]) -> tuple[int, float]:
        """Fill each destination buffer from (file, offset); returns (bytes, seconds).

        Raises OSError if any read fails or comes up short (the file changed under us).
        """
        if not jobs:
            return 0, 0.0
        jobs = sorted(jobs, key=lambda j: (str(j[0]), j[1]))
        resolved = [(self._fd(file), offset, dest) for file, offset, dest in jobs]
        start = time.perf_counter()
        if len(resolved) == 1:
            _read_exact(*resolved[0])
        else:
            futures = [self._executor.submit(_read_exact, *job) for job in resolved]
            try:
                for future in futures:
                    future.result()
            finally:
                # Even when interrupted, no read may still be writing into a slot
                # that the pool is about to hand out again.
                for future in futures:
                    future.cancel()
                wait(futures)
        return sum(dest.nbytes for _, _, dest in resolved), time.perf_counter() - start

    def read_bytes(self, file: Path, offset: int, length: int) -> bytes:
        """Plain read, for verification."""
        return os.pread(self._fd(file), length, offset)

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _read_exact(fd: int, offset: int, dest: np.ndarray) -> None:
    view = memoryview(dest).cast("B")
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(f"short read at offset {offset + done}: the checkpoint file changed")
        done += n
