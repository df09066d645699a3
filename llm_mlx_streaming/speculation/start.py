"""Per request: whether it speculates, with which drafter, and its figures.

k = 0 (the default) keeps mlx-lm's own `stream_generate`, so turning speculation off
costs nothing. A request speculates only where the result stays exactly the target's:
a custom sampler or a stateful logits processor (a schema constraint cannot be
evaluated ahead on drafts) decode plainly, and the figures say why. Stateless ones
(the repetition penalty) are applied at every verified position, as mlx-lm's step
would apply them there.
"""

from __future__ import annotations

from typing import Optional

from .. import values
from ..processors import all_stateless
from .decode import SpecFigures, SpeculativeRun
from .depth import Depth
from .drafter import DraftContext, DraftError
from .kinds import make_drafter
from .sampling import TargetSampler


def figures_for(request) -> SpecFigures:
    return SpecFigures(k=values.k(request.k), draft=_draft_name(request))


def off_reason(request, loaded) -> Optional[str]:
    """Why this request must decode without drafts on `loaded` (None: it may speculate)."""
    if loaded.takes_images:  # its prompt is fed as embeddings, which the drafters do not take
        return "a vision-language model"
    if not all_stateless(request.logits_processors):
        return "stateful logits processor"
    if request.sampler is not None:
        return "custom sampler"
    if request.kv.quantized:  # mlx-lm's loop quantizes the cache
        return "quantized KV cache (kv_bits)"
    return None


def make_run(request, loaded, cache, history, prompt, max_tokens, drafters: dict, figures, *,
             feed, kv_kwargs: dict) -> SpeculativeRun:
    """The speculative run for `request`; DraftError (one line) if its drafter cannot be built.

    `feed(forward)` prefills all but the last prompt token as the plain path does (the
    engine's prefill), with the run's `forward` where its drafter reads hidden states;
    `kv_kwargs` (a quantized KV layout) is what the plain path passes to stream_generate."""
    drafter = request.injected.drafter or _drafter(request, loaded, drafters)
    return SpeculativeRun(
        model=loaded.model, cache=cache, history=list(history), prompt=list(prompt),
        drafter=drafter, depth=Depth(values.k(request.k)),
        target=TargetSampler(request.sampling.temperature, request.sampling.top_p, request.sampling.min_p,
                             request.sampling.top_k),
        sampler=request.make_sampler(), processors=list(request.logits_processors),
        max_tokens=max_tokens, figures=figures,
        observer=request.injected.after_verify, feed=feed, kv_kwargs=kv_kwargs,
    )


def _drafter(request, loaded, drafters: dict):
    """Drafters are kept in `drafters` (the engine's), so one that holds state worth
    keeping (a draft model's weights and cache, an MTP head) is built once; each
    generation starts with `reset`. Only the last one built stays."""
    key = (request.draft, str(request.draft_path or ""), str(loaded.path), id(loaded))
    if key in drafters:
        return drafters[key]
    context = DraftContext(
        model=loaded.model, tokenizer=loaded.tokenizer, checkpoint=loaded.path, loaded=loaded,
        draft_path=lambda name: request.draft_path if name == request.draft else None,
    )
    drafter = make_drafter(request.draft, context)
    drafters.clear()
    drafters[key] = drafter
    return drafter


def _draft_name(request) -> str:
    return getattr(request.injected.drafter, "name", None) or request.draft


__all__ = ["DraftError", "figures_for", "make_run", "off_reason"]
