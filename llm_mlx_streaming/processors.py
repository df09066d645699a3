"""Logits processors see the whole token history, whatever part of it a cache supplied.

mlx-lm's `generate_step` shows its processors the tokens it was handed: with a KV
cache that already holds a prefix (a chat turn, the conversation cache on disk, a
server follow-up) that is only the part still to prefill, so a repetition penalty
would forget the reused tokens and the same request would decode differently on a
warm cache than on a cold one. Each processor here is given the reused prefix in
front of what mlx-lm shows it, which is exactly what a cold run shows it.
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol, Sequence

import mlx.core as mx

from . import syncs


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
                  answer: Sequence[int], budget: int, then: Optional[Continuation] = None) -> Stateless:
    """Close the reasoning once it holds `budget` tokens: force its `end` tag's ids and
    then `answer`'s (what the format writes to begin the answer: harmony's final-channel
    header), one token a step, as the model's own format writes them, until the whole
    sequence follows the budget; `then`, when given, constrains what follows it (the
    answer or a call) until it could end there. The block opens at the prompt's end when
    `opened`, else at the reply's first `start`; one that ended within the budget is
    left alone. A function of the history alone (the reply is what follows the prompt's
    `prompt_length` tokens), so a cached prefix or a speculative pass sees what a cold
    run sees."""
    return Stateless(ReasoningCap(prompt_length, opened, start, end, [*end, *answer], budget, then))


class ReasoningCap:
    """`reasoning_cap`'s processor, O(1) a token: it keeps marks (where the reasoning
    opened, where its end came within the budget, where the closing sequence was written
    whole, where `then` let go) and reads the history back (one counted sync, syncs.py)
    only when a step's answer depends on it: from the budget on, never before it. mlx-lm
    shows it one token more each step; a history no longer than what was read (a
    speculative pass starting again after its accepted tokens, another generation) is
    taken to share all but its last token with it, so the marks past that are dropped
    and what follows is read again. Each read takes the last tokens read before again
    and, where they differ (a history that was not extended), reads the whole reply."""

    def __init__(self, prompt_length: int, opened: bool, start: Sequence[int], end: Sequence[int],
                 close: Sequence[int], budget: int, then: Optional[Continuation] = None):
        self.prompt_length, self.opened, self.budget, self.then = prompt_length, opened, budget, then
        self.start, self.end, self.close = list(start), list(end), list(close)
        self.lookback = max(len(self.start), len(self.close))  # read again before `read`, to match across
        self.read = 0  # the reply's tokens read back
        self.tail: list[int] = []  # the last of them (up to `lookback`)
        self.opening: Optional[int] = 0 if opened else None  # the marks: reply lengths when each was made
        self.ended: Optional[int] = None
        self.closed: Optional[int] = None
        self.released: Optional[int] = None

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        n = len(tokens) - self.prompt_length  # the reply's length
        if 0 < n <= self.read:
            self._back_to(n - 1)
        if self._free(n):
            return logits
        reply = self._read(tokens, n)
        if self._free(n):
            return logits
        if self.closed is None:
            return _only(logits, self.close[self._written(reply)])
        allowed = self.then.allowed(reply.since(self.closed), logits.shape[-1])
        if allowed is None:
            self.released = n
            return logits
        return mx.where(mx.array(allowed), logits, mx.array(-mx.inf, dtype=logits.dtype))

    def _free(self, n: int) -> bool:
        """Whether the next token after a reply of `n` is the model's own, as far as what
        was read tells: the reasoning ended within its budget, the cap let go, or the
        reply is shorter than the budget after the opening (after the earliest the
        opening can still come, while it has not)."""
        if self.ended is not None or self.released is not None:
            return True
        return n < (self.read + 1 if self.opening is None else self.opening) + self.budget

    def _read(self, tokens: mx.array, n: int) -> "_Read":
        """Read the reply up to `n` (from the tail before `read`, and from the close once it
        is whole, for `then`), marking what the new tokens open, end or close."""
        reply = self._fetch(tokens, n)
        at = self.read - len(self.tail) - reply.first
        if reply.values[at : at + len(self.tail)] != self.tail:
            self._back_to(0)  # not what was read: read it all again
            reply = self._fetch(tokens, n)
        for upto in range(self.read + 1, n + 1):
            self.read = upto
            if self.opening is None:
                if reply.ends_with(upto, self.start):
                    self.opening = upto
                continue
            count = upto - self.opening  # the reasoning's tokens so far
            if len(self.end) <= count < self.budget + len(self.end) and reply.ends_with(upto, self.end):
                self.ended = upto
                break
            if self.closed is None and count - self.budget >= len(self.close) and reply.ends_with(upto, self.close):
                self.closed = upto
                self.released = upto if self.then is None else None
        self.tail = reply.values[max(0, self.read - self.lookback - reply.first) : self.read - reply.first]
        return reply

    def _fetch(self, tokens: mx.array, n: int) -> "_Read":
        first = max(0, self.read - self.lookback)
        if self.closed is not None:
            first = min(first, self.closed)
        p = self.prompt_length
        return _Read(first, syncs.tolist(tokens[p + first : p + n]))

    def _written(self, reply: "_Read") -> int:
        """How much of the closing sequence follows the budget: the longest part of it that
        the reply ends with and that fits in what was written since the budget."""
        since = self.read - self.opening - self.budget
        return max(k for k in range(min(since, len(self.close) - 1) + 1)
                   if reply.ends_with(self.read, self.close[:k]))

    def _back_to(self, m: int) -> None:
        """Forget what was read past the reply's first `m` tokens."""
        self.read, self.tail = m, self.tail[: max(0, len(self.tail) - (self.read - m))]
        if not self.opened and self.opening is not None and self.opening > m:
            self.opening = None
        self.ended, self.closed, self.released = (
            mark if mark is not None and mark <= m else None for mark in (self.ended, self.closed, self.released))


class Continuation(Protocol):
    """What may follow a closed reasoning (prompt/constrained.py's grammar of an answer or a call)."""

    def allowed(self, written: list[int], n_vocab: int):
        """The tokens allowed after `written` (a bool mask), or None once the grammar could
        end there (anything may follow from then on)."""


class _Read:
    """Reply tokens read back: `values[i]` is the reply's `first + i`-th."""

    def __init__(self, first: int, values: list[int]):
        self.first, self.values = first, values

    def ends_with(self, upto: int, part: Sequence[int]) -> bool:
        """Whether the reply's first `upto` tokens end with `part` (False when not read)."""
        at = upto - len(part) - self.first
        return at >= 0 and self.values[at : upto - self.first] == list(part)

    def since(self, position: int) -> list[int]:
        return self.values[position - self.first :]


def _only(logits: mx.array, token: int) -> mx.array:
    """`logits` with every token but `token` masked out."""
    only = mx.arange(logits.shape[-1]) == token
    return mx.where(only, mx.zeros_like(logits), mx.full(logits.shape, -mx.inf, logits.dtype))


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
