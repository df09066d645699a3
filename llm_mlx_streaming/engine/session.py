"""The KV cache kept between generations, and how much of it a new prompt can reuse.

A chat turn's prompt is the previous turn's prompt and reply plus the new message, so
its tokens usually extend what the cache already holds: only the new tokens need a
prefill. Caches that can be trimmed (attention KV) are cut back to the common prefix;
those that cannot (linear-attention state) are reused only when the cached tokens are a
strict prefix of the new prompt: such a state cannot be rewound, only extended.
"""

from __future__ import annotations

from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache
from mlx_lm.utils import common_prefix_len


class Session:
    def __init__(self, model):
        self.model = model
        self.cache = None
        self.tokens: list[int] = []  # exactly the tokens the cache has seen

    def reset(self) -> None:
        self.cache = None
        self.tokens = []

    def prepare(self, prompt: list[int]) -> tuple[list, list[int], int]:
        """(cache, tokens still to prefill, tokens reused) for `prompt`."""
        reuse = 0
        if self.cache is not None:
            reuse = min(common_prefix_len(self.tokens, prompt), len(prompt) - 1)
            if reuse < len(self.tokens):
                if reuse > 0 and can_trim_prompt_cache(self.cache):
                    trim_prompt_cache(self.cache, len(self.tokens) - reuse)
                else:
                    reuse = 0
        if reuse == 0:
            self.cache = make_prompt_cache(self.model)
        self.tokens = list(prompt[:reuse])
        return self.cache, list(prompt[reuse:]), reuse

    def fed(self, tokens) -> None:
        """Record tokens that went through the model into the cache."""
        self.tokens.extend(int(t) for t in tokens)
