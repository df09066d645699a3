"""Reads experts' bytes from disk straight into pool slot buffers.

A read job is `(file, offset, [buffers])`: one contiguous file range that a single
`os.preadv` scatters into several slot buffers (numpy views of the MLX pool arrays),
so no intermediate copy is made. The jobs of one call are sorted by file offset,
jobs that touch end to end are merged into one read, and the reads are issued in that
ascending order by at most `threads` reader threads, so at most `threads` are in
flight (SSDs serve a few parallel reads best; more only queue).

`page_cache="keep"` lets reads go through the OS page cache, a free second tier of
experts; `"bypass"` keeps them out of it (macOS `F_NOCACHE`; Linux `O_DIRECT` for a
read that starts on a page, a packed record, through a page-aligned buffer, so the
kernel neither caches nor later reclaims its pages, and otherwise no readahead
(`POSIX_FADV_RANDOM`) and `posix_fadvise(DONTNEED)` once read; elsewhere nothing), so
the memory stays with the pools and the model.
"""

from __future__ import annotations

import mmap
import os
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

import numpy as np

from .. import values
from . import residency

DEFAULT_THREADS = 8  # see docs/benchmarks.md, "I/O"
MAX_MERGED_BYTES = 16 << 20  # one merged read never grows past this
MAX_IOV = 512  # buffers per preadv (IOV_MAX is 1024 on Linux and macOS)
_PAGE = 4096
_F_NOCACHE = 48  # <sys/fcntl.h> on macOS

ReadJob = tuple[Path, int, Sequence[np.ndarray]]


class ReadResult(NamedTuple):
    nbytes: int
    seconds: float
    reads: int  # preadv calls after merging


class ChecksumError(OSError):
    """Bytes read into a slot do not match the checksum recorded for them."""


class ExpertStore:
    """Open files and a read thread pool, shared by every layer's pool.

    `packed` is set to the checkpoint's packed store (experts/packed.py) when one is in
    use; the pools ask it for their layer's record file.
    """

    def __init__(self, threads: int = DEFAULT_THREADS, page_cache: str = "keep"):
        values.one_of("page_cache", page_cache, values.PAGE_CACHE_MODES)
        self.threads = max(1, int(threads))
        self.page_cache = page_cache
        self.packed = None
        self._fds: dict[Path, int] = {}
        self._direct: dict[Path, int | None] = {}
        self._fd_lock = threading.Lock()
        # the calling thread is one of the `threads` readers (see _read_runs)
        self._executor = ThreadPoolExecutor(max(1, self.threads - 1), thread_name_prefix="mlxs-read")
        # one read ahead at a time (experts/prefetch.py), beside the calls' own reads
        self._ahead = ThreadPoolExecutor(1, thread_name_prefix="mlxs-ahead")

    def _fd(self, file: Path) -> int:
        fd = self._fds.get(file)
        if fd is None:
            with self._fd_lock:
                fd = self._fds.get(file)
                if fd is None:
                    fd = os.open(file, os.O_RDONLY)
                    if self.page_cache == "bypass":
                        self._apply_mode(fd)
                    self._fds[file] = fd
        return fd

    def _apply_mode(self, fd: int) -> None:
        """Set the page-cache mode on an open file (bypass: no caching, no readahead,
        which would cache bytes no one asked for)."""
        bypass = self.page_cache == "bypass"
        if sys.platform == "darwin":
            import fcntl

            fcntl.fcntl(fd, getattr(fcntl, "F_NOCACHE", _F_NOCACHE), 1 if bypass else 0)
        elif sys.platform.startswith("linux"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM if bypass else os.POSIX_FADV_NORMAL)

    def open_files(self, files) -> None:
        """Open `files` now (at load): every later read then comes from the files the
        model was loaded from, even if one is replaced under the same name meanwhile."""
        for file in files:
            self._fd(Path(file))

    def adopt(self, old: "ExpertStore") -> None:
        """Take over the open files of the store this one replaces, in this store's
        page-cache mode, for the same reason as `open_files`."""
        with old._fd_lock:
            fds, old._fds = old._fds, {}
        with self._fd_lock:
            for file, fd in fds.items():
                self._apply_mode(fd)
                self._fds.setdefault(file, fd)

    def read(self, jobs: Sequence[ReadJob], verify: Callable[[ReadJob], bool] | None = None) -> ReadResult:
        """Fill every job's buffers from its file range; returns bytes, seconds, reads.

        `verify(job)`, when given, runs in the reader thread once the job's bytes have
        landed; a False raises ChecksumError. Raises OSError if a read fails or comes up
        short (the file changed under us). When this raises, no read is still running.
        """
        if not jobs:
            return ReadResult(0, 0.0, 0)
        runs = _merge(sorted(jobs, key=lambda j: (str(j[0]), j[1])))
        planned = [(self._fd(run[0][0]), run) for run in runs]
        start = time.perf_counter()
        self._read_runs(planned, verify)
        nbytes = sum(b.nbytes for job in jobs for b in job[2])
        return ReadResult(nbytes, time.perf_counter() - start, len(planned))

    def _read_runs(self, planned, verify) -> None:
        """At most `threads` reads in flight, issued in ascending offset order.

        The calling thread reads too rather than only waiting, so a call's first read
        starts at once instead of after a pool thread wakes (on a VM that wake costs
        about as much as copying an expert from the page cache; docs/benchmarks.md,
        "I/O efficiency"). With one thread, or one read, no pool thread is involved."""
        queue = iter(planned)
        lock = threading.Lock()
        stop = threading.Event()

        def worker():
            while not stop.is_set():
                with lock:
                    item = next(queue, None)
                if item is None:
                    return
                self._read_run(*item, verify)

        futures = [self._executor.submit(worker) for _ in range(min(self.threads, len(planned)) - 1)]
        try:
            worker()
            for future in futures:
                future.result()
        finally:
            # Even when interrupted, no read may still be writing into a slot that the
            # pool is about to hand out again.
            stop.set()
            wait(futures)

    def _read_run(self, fd: int, run: list[ReadJob], verify) -> None:
        offset = run[0][1]
        buffers = [memoryview(b).cast("B") for job in run for b in job[2]]
        direct = self._direct_fd(run[0][0]) if offset % _PAGE == 0 else None
        if direct is not None:
            read_direct(direct, offset, buffers)
        else:
            self._read_buffered(fd, offset, buffers)
        if verify is not None:
            for job in run:
                if not verify(job):
                    raise ChecksumError(f"{job[0]}: bytes at offset {job[1]} fail their checksum")

    def _direct_fd(self, file: Path) -> int | None:
        """On Linux with `bypass`, a second descriptor of `file` opened O_DIRECT (reads go
        from the device to memory without the page cache); None where that is not
        available (another OS, a file system without direct I/O)."""
        if self.page_cache != "bypass" or not hasattr(os, "O_DIRECT"):
            return None
        with self._fd_lock:
            if file not in self._direct:
                try:
                    self._direct[file] = os.open(file, os.O_RDONLY | os.O_DIRECT)
                except OSError:
                    self._direct[file] = None
            return self._direct[file]

    def _read_buffered(self, fd: int, offset: int, buffers: list[memoryview]) -> None:
        length = read_exact(fd, offset, buffers)
        if self.page_cache == "bypass" and sys.platform.startswith("linux"):
            # whole pages only are dropped: widen the range to page boundaries
            begin, end = offset // _PAGE * _PAGE, -(-(offset + length) // _PAGE) * _PAGE
            os.posix_fadvise(fd, begin, end - begin, os.POSIX_FADV_DONTNEED)

    def background(self, fn: Callable, *args) -> Future:
        """Run `fn(*args)` (a pool's read of experts ahead of their call) on the store's
        read-ahead thread; the caller waits for it before using what it reads."""
        return self._ahead.submit(fn, *args)

    def uncached_share(self, ranges) -> float | None:
        """Share of the `(file, offset, length)` ranges' pages that the page cache does
        not hold (None: unknown)."""
        return residency.uncached_share((self._fd(Path(f)), o, n) for f, o, n in ranges)

    def read_bytes(self, file: Path, offset: int, length: int) -> bytes:
        """Plain read, for verification."""
        return os.pread(self._fd(file), length, offset)

    def close(self) -> None:
        self._ahead.shutdown(wait=True)
        self._executor.shutdown(wait=True)
        for fd in [*self._fds.values(), *(d for d in self._direct.values() if d is not None)]:
            os.close(fd)
        self._fds.clear()
        self._direct.clear()


def _merge(jobs: list[ReadJob]) -> list[list[ReadJob]]:
    """Group sorted jobs whose ranges touch end to end into runs (one preadv each)."""
    runs: list[list[ReadJob]] = []
    end = size = iovs = 0
    for job in jobs:
        file, offset, buffers = job
        nbytes = sum(b.nbytes for b in buffers)
        if (runs and file == runs[-1][0][0] and offset == end
                and size + nbytes <= MAX_MERGED_BYTES and iovs + len(buffers) <= MAX_IOV):
            runs[-1].append(job)
            size += nbytes
            iovs += len(buffers)
        else:
            runs.append([job])
            size, iovs = nbytes, len(buffers)
        end = offset + nbytes
    return runs


_bounce = threading.local()  # each reader thread's page-aligned buffer for direct reads


def read_direct(fd: int, offset: int, buffers: list[memoryview]) -> int:
    """Fill `buffers` from `offset` of a file opened O_DIRECT: whole pages into a
    page-aligned buffer of this thread (the slots' addresses and sizes need not be
    aligned), then copied into place; returns the bytes."""
    total = sum(len(b) for b in buffers)
    span = -(-total // _PAGE) * _PAGE
    if getattr(_bounce, "size", 0) < span:
        _bounce.buf, _bounce.size = mmap.mmap(-1, span), span
    view = memoryview(_bounce.buf)[:span]
    done = 0
    while done < total:
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(f"short read at offset {offset + done}: the file changed")
        done += n
    at = 0
    for b in buffers:
        b[:] = view[at:at + len(b)]
        at += len(b)
    return total


def read_exact(fd: int, offset: int, buffers: list[memoryview]) -> int:
    """preadv until every buffer is full (a read may stop short); returns the bytes."""
    total = sum(len(b) for b in buffers)
    done = first = 0
    while done < total:
        n = os.preadv(fd, buffers[first:first + MAX_IOV], offset + done)
        if n <= 0:
            raise OSError(f"short read at offset {offset + done}: the file changed")
        done += n
        while first < len(buffers) and n >= len(buffers[first]):
            n -= len(buffers[first])
            first += 1
        if n:
            buffers[first] = buffers[first][n:]
    return total
