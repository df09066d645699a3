"""Logits processors see the whole token history, whatever part of it a cache supplied.

mlx-lm's `generate_step` shows its processors the tokens it was handed: with a KV
cache that already holds a prefix (a chat turn, the conversation cache on disk, a
server follow-up) that is only the part still to prefill, so a repetition penalty
would forget the reused tokens and the same request would decode differently on a
warm cache than on a cold one. Each processor here is given the reused prefix in
front of what mlx-lm shows it, which is exactly what a cold run shows it.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

import mlx.core as mx


class Stateless:
    """A logits processor that is a function of (history, logits) alone.

    Such a processor can be applied at every position of a speculative verify pass,
    each over the history up to that position (speculation/decode.py); one that keeps
    state between calls (a schema matcher) cannot be evaluated ahead on drafts.
    """

    def __init__(self, processor: Callable):
        self.processor = processor

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        return self.processor(tokens, logits)


def reasoning_cap(prompt_length: int, opened: bool, start: Sequence[int], end: Sequence[int],
                  answer: Sequence[int], budget: int) -> Stateless:
    """Close the reasoning once it holds `budget` tokens: force its `end` tag's ids and
    then `answer`'s (what the format writes to begin the answer: harmony's final-channel
    header), one token a step, as the model's own format writes them, until the whole
    sequence follows the budget. The block opens at the prompt's end when `opened`, else
    at the reply's first `start`; one that ended within the budget is left alone. A
    function of the history alone (the reply is what follows the prompt's
    `prompt_length` tokens), so a cached prefix or a speculative pass sees what a cold
    run sees."""
    close = [*end, *answer]

    def cap(tokens: mx.array, logits: mx.array) -> mx.array:
        reply = tokens[prompt_length:].tolist()
        at = 0 if opened else _find(reply, start)
        if at is None:
            return logits
        if not opened:
            at += len(start)  # the reasoning's first token
        ended = _find(reply[at:], end)
        written = reply[at + budget:]
        if len(reply) - at < budget or (ended is not None and ended < budget) or _find(written, close) is not None:
            return logits
        done = max(k for k in range(len(close)) if k == 0 or written[-k:] == close[:k])  # where it stands
        only = mx.arange(logits.shape[-1]) == close[done]
        return mx.where(only, mx.zeros_like(logits), mx.full(logits.shape, -mx.inf, logits.dtype))

    return Stateless(cap)


def _find(tokens: list[int], part: Sequence[int]) -> int | None:
    """Where `part` first occurs in `tokens`, or None (list.index finds the candidates:
    the cap runs once a step over a reply that may be long)."""
    part, i = list(part), -1
    while True:
        try:
            i = tokens.index(part[0], i + 1)
        except ValueError:
            return None
        if tokens[i : i + len(part)] == part:
            return i


class Budgeted(Protocol):
    """A processor that shapes the reply to fit its token budget (constrained.py's
    schema closes its document before the budget runs out)."""

    def limit_tokens(self, budget: int) -> None: ...


class WithPrefix:
    """`processor`, shown `prefix` in front of the tokens it is called with."""

    def __init__(self, processor: Callable, prefix: Sequence[int]):
        self.processor = processor
        self.prefix = mx.array(list(prefix))

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        return self.processor(mx.concatenate([self.prefix, tokens]), logits)


def with_history(processors: Sequence[Callable], prefix: Sequence[int]) -> list:
    """`processors`, each shown the reused `prefix` before the tokens mlx-lm passes."""
    if not prefix:
        return list(processors)
    return [WithPrefix(p, prefix) for p in processors]


def all_stateless(processors: Sequence[Callable]) -> bool:
    return all(isinstance(p, Stateless) for p in processors)


def apply_at_positions(processors: Sequence[Callable], history: Sequence[int], inputs: Sequence[int],
                       logits: mx.array) -> mx.array:
    """(L, V) logits of one forward over `inputs`, row i processed as mlx-lm's step would
    process it: over `history` and inputs[: i + 1]."""
    if not processors:
        return logits
    rows = []
    for i in range(len(inputs)):
        tokens = mx.array([*history, *inputs[: i + 1]])
        row = logits[i : i + 1]
        for processor in processors:
            row = processor(tokens, row)
        rows.append(row)
    return mx.concatenate(rows, axis=0)
