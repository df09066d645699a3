"""Choosing tokens from a verify pass so the output is exactly the target's.

Greedy: a draft is kept while it is the target's argmax. Sampling: the standard
speculative-sampling rule with the drafter's proposal treated as certain (every
drafter here proposes one token, not a distribution): draft d is kept with
probability p(d), where p is the distribution the request's sampler draws from;
on rejection the token is drawn from p with d removed (max(p - q, 0), renormalised).
Each emitted token is then distributed exactly as the target's sampler would emit it.
p is built with mlx-lm's own filters (top_p, min_p, top_k), in make_sampler's order.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from .. import syncs


class TargetSampler:
    """The request's sampler as a distribution: what drafts are accepted against."""

    def __init__(self, temperature: float, top_p: float = 0.0, min_p: float = 0.0, top_k: int = 0):
        self.temperature = temperature
        self.filters = []
        if 0 < top_p < 1.0:
            self.filters.append(lambda x: apply_top_p(x, top_p))
        if min_p != 0.0:
            self.filters.append(lambda x: apply_min_p(x, min_p, 1))
        if top_k > 0:
            self.filters.append(lambda x: apply_top_k(x, top_k))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logprobs: mx.array) -> mx.array:
        """(L, V) probabilities the sampler draws each position's token from."""
        for f in self.filters:
            logprobs = f(logprobs)
        return mx.softmax(logprobs * (1 / self.temperature), axis=-1)


def choose(logprobs: mx.array, drafts: list[int], target: TargetSampler, sampler) -> tuple[int, int]:
    """(drafts accepted, the verifier's own next token) for one pass.

    `logprobs` is (len(drafts) + 1, V): row i predicts the token after draft i.
    `sampler` is the request's mlx-lm sampler, used where no draft is judged.
    """
    if not drafts:
        return 0, int(syncs.item(sampler(logprobs[-1:])))
    if target.greedy:
        best = syncs.tolist(mx.argmax(logprobs, axis=-1))
        n = 0
        while n < len(drafts) and best[n] == drafts[n]:
            n += 1
        return n, best[n]
    probs = target.probs(logprobs)
    draws, accept = syncs.tolist(mx.stack([mx.random.uniform(shape=(len(drafts),)),
                                           probs[mx.arange(len(drafts)), mx.array(drafts)]]))
    for n, (d, u, p) in enumerate(zip(drafts, draws, accept)):
        if u >= p:
            rest = probs[n].at[d].multiply(0.0)
            return n, int(syncs.item(mx.random.categorical(mx.log(rest))))
    return len(drafts), int(syncs.item(sampler(logprobs[-1:])))
