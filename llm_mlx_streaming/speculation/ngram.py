"""Prompt-lookup drafting: continue the conversation the way it continued before.

The last n tokens (n = 3, then 2, then 1) are looked up among earlier text; the tokens
that followed their most recent earlier occurrence are the draft. No weights, so it
works for every model, and costs a dictionary lookup per pass; it lands on quoting,
editing, summaries and repetitive output, and proposes nothing where nothing repeats.
"""

from __future__ import annotations

from .drafter import DraftContext

LONGEST_MATCH = 3


class NgramDrafter:
    name = "ngram"
    needs_hidden = False

    def __init__(self, longest: int = LONGEST_MATCH):
        self.longest = longest
        self.tokens: list[int] = []
        # n-gram -> end of its most recent occurrence that has a token after it
        self.seen: dict[tuple[int, ...], int] = {}

    def reset(self, tokens: list[int]) -> None:
        self.tokens, self.seen = [], {}
        self._extend(tokens)

    def accept(self, tokens: list[int], hidden=None) -> None:
        self._extend(tokens)

    def propose(self, k: int) -> list[int]:
        if k <= 0:
            return []
        for n in range(min(self.longest, len(self.tokens)), 0, -1):
            end = self.seen.get(tuple(self.tokens[-n:]))
            if end is not None:
                return self.tokens[end : end + k]
        return []

    def _extend(self, tokens) -> None:
        for token in tokens:
            # The n-grams ending at the current last token get a successor now, so
            # they become useful for lookups; the suffix itself never matches itself.
            end = len(self.tokens)
            for n in range(1, min(self.longest, end) + 1):
                self.seen[tuple(self.tokens[end - n : end])] = end
            self.tokens.append(int(token))


def build(context: DraftContext) -> NgramDrafter:
    return NgramDrafter()
