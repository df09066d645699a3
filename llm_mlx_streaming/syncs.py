"""Host synchronisations: every place the engine waits for the device to hand it a value.

On a GPU each one stalls the pipeline for a round trip (about 2 ms per MoE layer on
Apple GPUs), so the engine makes them all here and counts them: a response's
`syncs_per_token` and the engine's `syncs` are read from `count()`. mlx-lm's own
per-step token read (overlapped with the next step by its `async_eval`) is not ours
and is not counted.
"""

from __future__ import annotations

import numpy as np


class _Counter:
    n = 0  # the engine thread is the only writer


_counter = _Counter()


def count() -> int:
    """Host synchronisations made since the process started."""
    return _counter.n


def to_host(array) -> np.ndarray:
    """The array's values on the host (one synchronisation)."""
    _counter.n += 1
    return np.array(array)


def item(array):
    """The one value of a one-element array (one synchronisation)."""
    return to_host(array).item()


def tolist(array) -> list:
    """The array's values as a list (one synchronisation)."""
    return to_host(array).tolist()


def evaluate(*arrays) -> None:
    """Evaluate `arrays` and wait for them (one synchronisation)."""
    import mlx.core as mx

    _counter.n += 1
    mx.eval(*arrays)
