"""Freed memory: how much MLX keeps for reuse while requests run, and all of it given
back when the engine goes idle.

A prefill frees many activation-sized buffers. MLX keeps freed buffers for reuse (its
buffer cache, capped here by the `buffer_cache` setting), and glibc's malloc keeps
freed heap pages in the process rather than return them: on the CPU backend a prompt
near the demo's context left some 250 MB that no later request used. The engine thread
calls `release` when nothing is queued, so an idle server is back at its weights,
pools and one conversation's KV cache, however long it has run. The Metal wired limit
needs nothing here: mlx-lm's `stream_generate` raises it to cover the model's arrays.
"""

from __future__ import annotations

import ctypes

DEFAULT_BUFFER_CACHE = 256 * 2**20  # the memory plan's reserve floor (engine/planner.py)


def _malloc_trim():
    """glibc's malloc_trim, or None where the C library has none (macOS, musl)."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


_trim = _malloc_trim()


def cap_buffer_cache(limit: int) -> None:
    """Keep at most `limit` bytes of freed MLX buffers for reuse."""
    import mlx.core as mx

    mx.set_cache_limit(limit)


def release() -> None:
    """Give back every freed MLX buffer and glibc's free heap pages (on the engine thread,
    with nothing queued: the next request allocates afresh, a few ms at most)."""
    import mlx.core as mx

    mx.clear_cache()
    if _trim is not None:
        _trim(0)
