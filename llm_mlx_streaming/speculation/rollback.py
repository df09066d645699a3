"""Rolling a prompt cache back past the drafts the verifier rejected.

Attention caches are trimmed. A linear-attention `ArraysCache` (qwen3_next) holds a
running state that cannot be rewound, and mlx-lm's own speculative decoding refuses
it; here its state is checkpointed at every position *during* the verify pass and the
checkpoint after the last kept position is put back, so nothing is recomputed:

- the convolution state after m positions is rows m .. m+n_keep of the layer's
  convolution input (old state + the pass's inputs), recorded as the conv runs;
- the recurrent state after each position comes from running mlx-lm's own
  `gated_delta_update` one position at a time within the pass: the same call a
  single-token decode makes, so every kept state is the one plain decoding reaches.
"""

from __future__ import annotations

import re
import sys
from contextlib import contextmanager

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, RotatingKVCache


class RollbackError(RuntimeError):
    """The cache holds state this module cannot roll back."""


def room(cache: list) -> int:
    """Most positions a verify pass may feed and still be cut back afterwards.

    A sliding-window cache can be trimmed only until its window has wrapped, so a pass
    must end before it; once it has wrapped (or for a cache of unknown kind) a pass
    feeds one position, as plain decoding does.
    """
    most = sys.maxsize
    for c in cache:
        if isinstance(c, ArraysCache):
            continue
        if isinstance(c, RotatingKVCache):
            most = min(most, max(c.max_size - c.offset - 1, 1))
        elif not c.is_trimmable():
            most = 1
    return most


class VerifyPass:
    """Per-position checkpoints of the linear-attention layers over one verify forward."""

    def __init__(self, model, cache: list, layers: "list | None" = None):
        """`layers`: the model's linear-attention modules, when a previous pass found them
        (they do not change within a generation; finding them walks the whole model)."""
        self.cache = cache
        self.linear = [c for c in cache if isinstance(c, ArraysCache)]
        if layers is None:
            layers = _linear_layers(model) if self.linear else []
        self.layers = layers
        # State caches of another kind of layer (not gated delta) cannot be checkpointed.
        self.supported = len(self.layers) == len(self.linear)
        self.conv_inputs: list[mx.array] = []
        self.states: list[list[mx.array]] = []
        self.positions = 0

    @contextmanager
    def recording(self, positions: int):
        """Run the verify forward of `positions` tokens inside this block."""
        self.positions = positions
        if positions > 1 and not self.supported:
            raise RollbackError("this model's state caches cannot be rolled back")
        if not self.linear or positions == 1:
            yield self
            return
        restore = []
        try:
            for layer in self.layers:
                conv = layer.conv1d
                layer.conv1d = _Recorder(conv, self.conv_inputs)
                restore.append((layer, "conv1d", conv))
            for module in {sys.modules[type(layer).__module__] for layer in self.layers}:
                original = module.gated_delta_update
                module.gated_delta_update = _stepwise(original, self.states)
                restore.append((module, "gated_delta_update", original))
            yield self
        finally:
            for owner, name, value in reversed(restore):
                setattr(owner, name, value)
        if len(self.conv_inputs) != len(self.linear) or len(self.states) != len(self.linear):
            # A layer ran twice or not at all: the checkpoints would not match the caches.
            raise RollbackError("the verify pass did not run every linear-attention layer once")

    def keep(self, kept: int) -> None:
        """Cut every cache back to the first `kept` positions of the pass."""
        drop = self.positions - kept
        if drop > 0:
            for c in self.cache:
                if not isinstance(c, ArraysCache):
                    c.trim(drop)
            for c, conv_input, states in zip(self.linear, self.conv_inputs, self.states):
                n_keep = c[0].shape[1]
                c[0] = mx.contiguous(conv_input[:, kept : kept + n_keep, :])
                c[1] = states[kept - 1]
        mx.eval([c.cache for c in self.linear])  # small; leaves no graph into the next pass


class _Recorder:
    """Stands in for a layer's conv1d for one pass, keeping its input."""

    def __init__(self, conv, sink: list):
        self.conv, self.sink = conv, sink

    def __call__(self, x):
        self.sink.append(x)
        return self.conv(x)


def _stepwise(update, sink: list):
    """mlx-lm's gated_delta_update, one position at a time, keeping every state."""

    def run(q, k, v, a, b, A_log, dt_bias, state=None, mask=None, **kwargs):
        outputs, states = [], []
        for t in range(q.shape[1]):
            step = slice(t, t + 1)
            y, state = update(q[:, step], k[:, step], v[:, step], a[:, step], b[:, step],
                              A_log, dt_bias, state, None if mask is None else mask[:, step], **kwargs)
            outputs.append(y)
            states.append(state)
        sink.append(states)
        return mx.concatenate(outputs, axis=1), state

    return run


def _linear_layers(model) -> list:
    """The linear-attention modules, in the order their caches appear."""
    found = [(name, m) for name, m in model.named_modules()
             if "conv1d" in m and hasattr(sys.modules[type(m).__module__], "gated_delta_update")]
    found.sort(key=lambda item: [int(n) for n in re.findall(r"\d+", item[0])])
    return [m for _, m in found]
