"""Drafters that know the answer: for tests and benchmarks, never chosen by name.

`oracle` replays a recorded greedy continuation (always right, costs nothing), so a
benchmark isolates what verification costs and saves; `adversary` proposes a token
other than the recorded one at every position (always wrong under greedy decoding),
the floor. Both follow the sequence they are shown, so after the first disagreement
with the recording they simply propose nothing.
"""

from __future__ import annotations


class ScriptedDrafter:
    needs_hidden = False

    def __init__(self, expected: list[int], vocab_size: int, wrong: bool = False):
        self.name = "adversary" if wrong else "oracle"
        self.expected = [int(t) for t in expected]  # the whole sequence, prompt included
        self.vocab_size = vocab_size
        self.wrong = wrong
        self.tokens: list[int] = []

    def reset(self, tokens: list[int]) -> None:
        self.tokens = [int(t) for t in tokens]

    def accept(self, tokens: list[int], hidden=None) -> None:
        self.tokens.extend(int(t) for t in tokens)

    def propose(self, k: int) -> list[int]:
        n = len(self.tokens)
        if k <= 0 or self.expected[:n] != self.tokens:
            return []
        drafts = self.expected[n : n + k]
        if self.wrong:
            return [(t + 1) % self.vocab_size for t in drafts]
        return drafts
