"""A small model as the drafter: any model added with `llm mlxs add`.

It runs fully resident (it is meant to be small, e.g. a 0.6B dense model for a Qwen3
MoE) and greedy, with its own KV cache. The engine keeps one per checkpoint, so in a
chat the draft cache, like the target's, is cut back to the longest prefix it shares
with the next turn's conversation and only the new tokens are fed.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache
from mlx_lm.utils import common_prefix_len

from .. import syncs
from ..errors import one_line
from .drafter import DraftContext, DraftError

PREFILL_STEP = 2048  # a draft model is dense and resident: it reads the conversation in mlx-lm's own chunks


class DraftModelDrafter:
    needs_hidden = False

    def __init__(self, name: str, path: Path, model, tokenizer):
        self.name, self.path = name, path
        self.model, self.tokenizer = model, tokenizer
        self.cache = make_prompt_cache(model)
        self.seen: list[int] = []  # exactly the tokens in self.cache
        self.sequence: list[int] = []  # the conversation so far

    def reset(self, tokens: list[int]) -> None:
        self.sequence = [int(t) for t in tokens]

    def accept(self, tokens: list[int], hidden=None) -> None:
        self.sequence.extend(int(t) for t in tokens)

    def propose(self, k: int) -> list[int]:
        if k <= 0 or not self.sequence:
            return []
        self._cut_back()
        pending = self.sequence[len(self.seen):]
        while len(pending) > PREFILL_STEP:
            self._feed(pending[:PREFILL_STEP])
            pending = pending[PREFILL_STEP:]
        drafts = []
        for _ in range(k):
            logits = self._feed(pending)
            token = int(syncs.item(mx.argmax(logits[0, -1])))
            drafts.append(token)
            pending = [token]
        return drafts

    def _feed(self, tokens: list[int]) -> mx.array:
        logits = self.model(mx.array(tokens)[None], cache=self.cache)
        self.seen.extend(tokens)
        return logits

    def _cut_back(self) -> None:
        """Keep the longest cached prefix of the sequence, short of its last token
        (whose logits the next draft needs)."""
        keep = min(common_prefix_len(self.seen, self.sequence), len(self.sequence) - 1)
        if keep == len(self.seen):
            return
        if keep > 0 and can_trim_prompt_cache(self.cache):
            trim_prompt_cache(self.cache, len(self.seen) - keep)
        else:
            self.cache, keep = make_prompt_cache(self.model), 0
        del self.seen[keep:]


def build_draft_model(context: DraftContext, name: str, path: Path) -> DraftModelDrafter:
    """Load the draft model `name` at `path`; DraftError if its vocabulary differs."""
    from mlx_lm.utils import load_model, load_tokenizer

    from ..checkpoints.mtp import classes_without_head

    try:
        model, config = load_model(Path(path), get_model_classes=classes_without_head)
        tokenizer = load_tokenizer(Path(path), eos_token_ids=config.get("eos_token_id"))
    except (OSError, ValueError, KeyError) as e:
        raise DraftError(f"draft model {name!r} ({path}) cannot be loaded: {one_line(e)}") from None
    target = context.checkpoint.name if context.checkpoint else "the target"
    if context.tokenizer is not None:
        ours, theirs = tokenizer.get_vocab(), context.tokenizer.get_vocab()
        if ours != theirs:
            raise DraftError(
                f"draft model {name!r} does not share the vocabulary of {target!r}: "
                f"{len(ours)} vs {len(theirs)} tokens"
                + ("" if len(ours) != len(theirs) else ", different ids")
            )
    mx.eval(model.parameters())
    return DraftModelDrafter(name, Path(path), model, tokenizer)
