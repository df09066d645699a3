"""Stepping every rank together: rank 0 picks each token, and says after each token and
each prefill chunk whether the others go on.

Every rank computes the same logits (mlx-lm's pipeline gathers the last hidden state to
all of them), but only rank 0 has the request's sampler, seed and logits processors, so
the token is rank 0's, summed into every rank inside the step's own graph. After each
token rank 0 says CONTINUE, STOP (its reply ended early: a stop sequence) or ABORT (it
was cancelled or failed), so every rank runs the same forwards and keeps the same cache.
Between prefill chunks it says CONTINUE or ABORT, so a cancelled prompt stops at its
next chunk on every rank, not at its end.
"""

from __future__ import annotations

import time

import mlx.core as mx

from ..engine.generation import Cancelled
from .group import ABORT, CONTINUE, STOP, Group
from .watch import Heartbeat


class Aborted(Exception):
    """Rank 0 gave up this generation; a following rank drops its cache."""


def leading_sampler(group: Group, sampler):
    """Rank 0's sampler, its token handed to every rank."""

    def sample(logprobs: mx.array) -> mx.array:
        return mx.distributed.all_sum(sampler(logprobs).astype(mx.int32), group=group.group)

    return sample


def following_sampler(group: Group):
    """A following rank's sampler: rank 0's token."""

    def sample(logprobs: mx.array) -> mx.array:
        return mx.distributed.all_sum(mx.zeros(logprobs.shape[:-1], mx.int32), group=group.group)

    return sample


class Lead:
    """Rank 0's responses, each followed by its word to the others. `end()` after the
    generation (or its failure) says STOP or ABORT for a token not yet answered;
    `stepping` says a failure came from inside a forward, which the others cannot leave."""

    def __init__(self, group: Group, responses, heart: Heartbeat) -> None:
        self.group, self.heart, self.pending, self.stepping = group, heart, False, False
        self.steps = self._run(iter(responses))

    def _run(self, responses):
        while True:
            self.stepping = True  # in a forward: the other ranks are in it too
            response = next(responses, None)
            self.stepping = False
            if response is None:
                return
            self.pending = True
            yield response
            self.pending = False
            self.group.word(CONTINUE)
            self.heart.beat()

    def between_chunks(self, out) -> None:
        """After a prefill chunk: ABORT, and Cancelled here, once the request is cancelled
        (every rank leaves this forward together: no failure within a step)."""
        try:
            out.check_cancelled()
        except Cancelled:
            self.stepping = False
            self.group.word(ABORT)
            raise
        self.group.word(CONTINUE)
        self.heart.beat()

    def end(self, aborting: bool) -> None:
        self.steps.close()
        if self.pending:
            self.pending = False
            self.group.word(ABORT if aborting else STOP)


class Follow:
    """A following rank's responses, ending where rank 0's word says; each word is a
    beat of `heart`."""

    def __init__(self, group: Group, heart: Heartbeat) -> None:
        self.group, self.heart = group, heart

    def steps(self, responses):
        with self.heart.waiting("step"):
            for response in responses:
                yield response
                word = self.group.word()
                self.heart.beat()
                if word == STOP:
                    return
                if word == ABORT:
                    raise Aborted

    def between_chunks(self, _out, last: bool) -> None:
        """After a prefill chunk but the last: rank 0's word (Lead.between_chunks)."""
        if last:
            return
        word = self.group.word()
        self.heart.beat()
        if word == ABORT:
            raise Aborted


class WaitClock:
    """Time this rank spends waiting for the others: the input of its first layer is
    evaluated on its own, so the wait for the previous rank (or, on the rank of the
    first layers, for the whole last step) is measured apart from its own compute."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def attach(self, model) -> None:
        layers = [layer for layer in model.model.layers if layer is not None]
        first = layers[0]
        base, clock = type(first), self

        def timed(self, x, *args, **kwargs):
            start = time.perf_counter()
            mx.eval(x)
            clock.seconds += time.perf_counter() - start
            return base.__call__(self, x, *args, **kwargs)

        first.__class__ = type(base.__name__, (base,), {"__call__": timed})
