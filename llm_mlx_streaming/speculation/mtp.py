"""The `mtp` drafter: the checkpoint's own multi-token-prediction head drafts.

The engine shows the drafter the prompt as it prefills it, then after each verify pass
the accepted tokens, with the target's final hidden states at the positions that
produced them. Each pair (h_t, x_{t+1}) goes through the head (mtp_head.py),
which extends its own small KV cache and leaves the logits for the token after x_{t+1}:
the first draft, greedy. Further drafts chain the head on its own output hidden state
and its own draft; those chained positions are trimmed from the head's cache again at
once, so the cache only ever holds pairs of accepted tokens and a rollback of the
target never needs to touch it.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache
from mlx_lm.utils import common_prefix_len

from .. import syncs
from ..errors import CheckpointError
from .drafter import DraftContext, DraftError
from .mtp_head import LoadedHead, mtp_head


# Chain a further draft only while the head gives its latest one at least this
# probability: the threshold a peer engine (Vates) reported best on real MTP heads
# (+5-6% decode); random test heads are never that confident, so it cannot be tuned here.
CONFIDENCE_GATE = 0.3


class MTPDrafter:
    name = "mtp"
    needs_hidden = True

    def __init__(self, model, head: LoadedHead, gate: float = CONFIDENCE_GATE):
        self.model = model
        self.head = head
        self.gate = gate
        self.cache = KVCache()
        self.seen: list[int] = []  # the sequence the head's cache belongs to
        self.start = 0  # position of the pair in the cache's first entry
        self._hidden = None  # head output at the last accepted pair: (1, 1, H)
        self._logits = None  # head logits there: the first draft's

    def reset(self, tokens: list[int]) -> None:
        """Keep the head's pairs that still hold for `tokens` (the prefix shared with what
        it has seen) when they reach up to where the next pair goes: the next chat turn,
        or the same prompt again; otherwise start a new cache there."""
        tokens = [int(t) for t in tokens]
        common = common_prefix_len(tokens, self.seen)
        # pair j is (h_j, x_j+1): it holds while x_j+1 is in the shared prefix
        keep = min(self.cache.offset, common - 1 - self.start)
        if keep >= 0 and self.start + keep == len(tokens) - 1:
            self.cache.trim(self.cache.offset - keep)
        else:
            self.cache, self.start = KVCache(), len(tokens) - 1
        self.seen = tokens
        self._hidden = self._logits = None

    def accept(self, tokens: list[int], hidden) -> None:
        self.seen.extend(int(t) for t in tokens)
        if hidden is None or not len(tokens):
            self._hidden = self._logits = None
            return
        x, logits = self.head.head.step(
            self.model, mx.array(tokens, dtype=mx.uint32)[None], hidden.reshape(1, len(tokens), -1),
            self.cache,
        )
        self._hidden, self._logits = x[:, -1:], logits[0, -1]

    def propose(self, k: int) -> list[int]:
        """Up to k greedy drafts; the chain stops early once the head gives its latest
        draft less than `gate` probability (a draft after a likely miss is wasted)."""
        if k <= 0 or self._logits is None:
            return []
        drafts, confidence = _greedy(self._logits)
        x, chained = self._hidden, 0
        while len(drafts) < k and confidence >= self.gate:
            x, logits = self.head.head.step(
                self.model, mx.array([drafts[-1:]], dtype=mx.uint32), x, self.cache
            )
            chained += 1
            more, confidence = _greedy(logits[0, -1])
            drafts += more
        self.cache.trim(chained)  # chained positions are guesses: drop them again
        return drafts


def _greedy(logits: mx.array) -> tuple[list[int], float]:
    """([argmax], its softmax probability)."""
    probs = mx.softmax(logits.astype(mx.float32), axis=-1)
    token = mx.argmax(probs)
    chosen, confidence = syncs.tolist(mx.stack([token.astype(mx.float32), probs[token]]))
    return [int(chosen)], float(confidence)


def build(context: DraftContext) -> MTPDrafter:
    if context.loaded is None:
        raise DraftError("`-o draft mtp` needs the engine's streamed model")
    try:
        head = mtp_head(context.loaded)
    except CheckpointError as e:  # no head, or a damaged one
        raise DraftError(str(e)) from None
    return MTPDrafter(context.model, head)
