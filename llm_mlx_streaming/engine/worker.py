"""The engine thread: every load and generation of the process runs on it, in order.

One thread, because MLX computes one thing at a time anyway and the CPU backend's
side stream belongs to the thread that made it. Callers queue a job and read what it
produces from their own `Generation` (engine/generation.py), so a caller that stops
reading never blocks the others.

The process ends with the thread at rest (`_EngineThread.stop`, at exit): a thread that
has run MLX's compiled functions must neither end nor wake once the interpreter
finalizes, or the C++ runtime aborts the process ("terminate called without an active
exception"). CPython ends a daemon thread that asks for the GIL then, and MLX's per-thread
compile cache takes the GIL in its destructor as the thread ends. So it is never joined:
its work is cancelled and it is left waiting for a job that never comes. A step cannot be
cut short (a prefill chunk is one MLX evaluation, seconds long on a big prompt or a slow
disk), so when the thread is still in one as the exit's wait ends, the process ends
without finalizing (`os._exit`, with its status where it is known: a stopped server's 0,
else 1), once a file being written is whole.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import weakref
from collections import deque
from contextlib import contextmanager
from typing import Callable

from . import memory
from .generation import Cancelled, Channel, Generation


def submit(job: Callable[[Channel], None], tag=None) -> Generation:
    """Queue `job(channel)` on the engine thread; the handle reads what it puts there,
    and raises what it raised. `tag` describes the job to `take_queued`."""
    generation = Generation()
    channel = generation.channel  # the engine thread gets the channel, never the handle
    _engine_thread().submit(lambda: job(channel), channel, tag)
    return generation


def take_queued(accept: Callable) -> tuple | None:
    """For the job now running (a batch): the next queued job's (tag, channel), taken
    off the queue, when `accept(tag)`; None when the queue is empty or its head is not
    accepted, so jobs still run in order. The taker runs it and sets the channel's
    `finished` when it is over (a caller waiting in `Generation.close` goes on)."""
    return _engine_thread().take(accept)


def idle() -> bool:
    """Whether the engine thread waits with nothing to run, its freed memory given back."""
    return _engine_thread().idle


EXIT_WAIT_SECONDS = 30.0  # the longest an exit waits for the step under way (a prefill chunk, a load)
END_WAIT_SECONDS = 3.0  # the same for `end_process`, which knows the status to end with
WRITE_WAIT_SECONDS = 30.0  # the longest it then waits for a file being written (`whole_write`)
UNKNOWN_STATUS = 1  # an exit that cannot wait, where the process's own status is not known (atexit)

_writing = threading.Lock()


@contextmanager
def whole_write():
    """Around a write that must not be cut in half (a conversation cache file written,
    then renamed into place): an exit that cannot wait for the engine thread waits for it."""
    with _writing:
        yield


def end_process(status: int, last: Callable[[], None] | None = None) -> None:
    """End the process now with `status` (a server once stopped): the engine thread
    stopped as at exit (`_EngineThread.stop`), `last` run once it rests (not if it never
    does), then no interpreter finalization, which must not run while that thread is
    inside MLX and whose garbage collection of a model's arrays takes seconds."""
    thread = _engine_thread.made()
    if thread is not None:
        thread.stop(END_WAIT_SECONDS, status)
    if last is not None:
        last()
    _end_now(status)


class _EngineThread:
    """The one thread that runs every job, in submission order; a job never waits on
    another job."""

    def __init__(self) -> None:
        self._jobs: deque = deque()
        self._ready = threading.Condition()
        self._channels: weakref.WeakSet = weakref.WeakSet()  # of the jobs not yet over: what `stop` cancels
        self.idle = False
        self.stopped = False
        threading.Thread(target=self._loop, name="mlx-stream-engine", daemon=True).start()
        atexit.register(self.stop)

    def submit(self, job, channel: Channel, tag) -> None:
        with self._ready:
            if self.stopped:  # the process is exiting
                channel.put("error", Cancelled())
                return
            self._channels.add(channel)
            self._jobs.append((job, channel, tag))
            self._ready.notify_all()

    def take(self, accept: Callable) -> tuple | None:
        with self._ready:
            if self.stopped or not self._jobs or not accept(self._jobs[0][2]):
                return None
            _, channel, tag = self._jobs.popleft()
        channel.running.set()
        return tag, channel

    def _loop(self) -> None:
        while True:
            with self._ready:
                idle = not self._jobs
            if idle:  # freed memory goes back before the wait (engine/memory.py)
                memory.release()
            with self._ready:
                self.idle = not self._jobs
                if self.idle:
                    self._ready.notify_all()  # `stop` may be waiting for it
                self._ready.wait_for(lambda: self._jobs)
                job, channel, _ = self._jobs.popleft()
                self.idle = False
            channel.running.set()
            try:
                job()
            except Cancelled:
                pass  # the caller has gone
            except BaseException as e:  # the caller re-raises it, KeyboardInterrupt included
                channel.put("error", e)
            finally:
                channel.finished.set()
                del job, channel

    def stop(self, timeout: float = EXIT_WAIT_SECONDS, status: int = UNKNOWN_STATUS) -> None:
        """Cancel every job, queued or running (a generation stops at its next token or
        prefill chunk), run no more, and wait until the thread rests in its wait for the
        next job, which never comes. Runs at exit, before the interpreter finalizes. If the
        thread is still in a step when `timeout` is over (or a second Ctrl-C comes), the
        process ends now with `status` (`_end_now`)."""
        with self._ready:
            self.stopped = True
            self._jobs.clear()
            for channel in list(self._channels):
                channel.cancel.set()
            try:
                rested = self._ready.wait_for(lambda: self.idle, timeout)
            except KeyboardInterrupt:
                rested = False
        if not rested:
            _end_now(status)


def _end_now(status: int) -> None:
    """End the process without finalizing the interpreter, which would tear the engine
    thread down inside MLX (SIGABRT): a file being written is finished first, the
    output flushed."""
    _writing.acquire(timeout=WRITE_WAIT_SECONDS)  # held from here on: no write starts
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or a pipe no one reads
            pass
    os._exit(status)


class Once:
    """A process-wide object, built by `factory` on first use, once whatever the threads."""

    def __init__(self, factory: Callable) -> None:
        self._factory, self._value = factory, None
        self._lock = threading.Lock()

    def __call__(self):
        with self._lock:
            if self._value is None:
                self._value = self._factory()
            return self._value

    def made(self):
        """The object, or None if nothing has used it yet."""
        return self._value

    def set(self, value) -> None:
        """Make `value` the object, before anything used another."""
        with self._lock:
            if self._value is not None and self._value is not value:
                raise RuntimeError("the process-wide object is already in use")
            self._value = value


_engine_thread = Once(_EngineThread)
