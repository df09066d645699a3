"""Continuous batching: several requests decoded in one forward pass.

On a streamed MoE the two costs that dominate decoding are each MoE layer's host
read-back of the router's choice and the expert reads; B sequences decoded in one pass
share both. The batch runs on mlx-lm's own `BatchGenerator` and batch KV caches,
through the streamed layers: a request joins after its prefill, leaves when it
finishes, and keeps its own sampler, logits processors, stop sequences, KV reuse and
cancellation; its cache, checked out of the model's prompt cache as it joins, goes back
in as its conversation's when it finishes. It runs on the engine thread under the
provider's lock, like `respond`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

from .. import syncs
from ..stops import StopMatcher
from . import figures as fig
from ..activity import ACTIVITY
from .generation import Channel
from .request import Injected, Request
from .prefill import suspended
from .respond import PromptFeeder, begin, save_to_disk, stopped, token_logprobs

SHARE_SECONDS = 0.25  # a joining prompt's prefill runs at least this long between the members' passes


def alone_reason(request: Request, model) -> str | None:
    """Why `request` runs alone rather than in a batch (None: it may join one)."""
    from mlx_lm.models.cache import make_prompt_cache

    if request.max_batch <= 1:
        return "max_batch 1"
    if getattr(model, "vlm", None) is not None:  # engine/vision.py: embeddings and positions per prompt
        return "a vision-language model"
    if request.k != 0:
        return "speculation"
    if request.sampling.seed is not None or request.sampler is not None:
        return "a seed or its own sampler (reproducible alone)"
    if request.budget_aware:
        return "a schema"
    if request.trace_path is not None:
        return "a routing trace"
    if request.kv.quantized:
        return "a quantized KV cache"
    if request.injected != Injected():
        return "injected parts"
    if not all(hasattr(c, "merge") for c in make_prompt_cache(model)):
        return "a cache mlx-lm cannot batch"
    return None


@dataclass
class Member:
    """One request in the batch and what its figures are built from."""

    request: Request
    out: Channel
    prompt: list[int]
    reused: int
    prefilled: int
    kv: Any
    kv_note: Any
    disk: Any
    from_disk: int
    lease: Any  # engine/prompt_cache.Lease
    stops: StopMatcher
    detokenizer: Any
    before: Any  # pool counters when it joined
    start: float = field(default_factory=time.perf_counter)
    first: float | None = None  # when its first token came
    tokens: int = 0
    syncs: float = 0.0  # its share of each pass's host synchronisations
    largest: int = 1  # the largest batch it ran in
    last: Any = None  # its last GenerationResponse
    flight: Any = None  # activity.py: the dashboard's request in flight
    feeder: Any = None  # engine/respond.PromptFeeder: how its prompt was fed
    reads: Any = None  # engine/figures.ReadsDuring: what its prompt read, up to its first token
    snapshots: list = field(default_factory=list)  # [(position, cache)] taken as its prompt was fed


class Batch:
    """The running batch: `admit` requests, `step` until no member is left."""

    def __init__(self, engine, capacity: int) -> None:
        from mlx_lm.generate import BatchGenerator

        self.engine, self.model, self.capacity = engine, engine.running, capacity  # model: the one that runs
        # members join with one prompt token left: the generator's own prefill is that token
        self.generator = BatchGenerator(self.model.loaded.model, completion_batch_size=capacity,
                                        prefill_batch_size=capacity)
        self.members: dict[int, Member] = {}
        self.pass_seconds = 0.0  # the last pass's
        ACTIVITY.batch = self  # its KV caches, for the dashboard's memory figures

    def admit(self, request: Request, out: Channel) -> None:
        """Start `request`: its cached prefix, its prompt fed as a request alone is fed
        (engine/prefill.py: in expert chunks, snapshots taken as it goes) while the
        members already decoding go on between its expert groups, then it joins the
        batch for its last prompt token."""
        from mlx_lm.generate import StopSequences

        model = self.model
        b = begin(model, request, out, model.carried, self.engine.max_tokens)
        tokenizer = model.loaded.tokenizer
        cache = b.lease.cache
        member = Member(request, out, b.prompt, b.reused, len(b.new_tokens), b.kv, b.kv_note, b.disk, b.from_disk,
                        b.lease, StopMatcher(request.stop), tokenizer.detokenizer, model.counters())
        step = request.chunk(len(b.prompt), held=self.kv_bytes())
        member.flight = ACTIVITY.begin(len(b.prompt), b.reused, len(b.new_tokens), step, len(model.loaded.layers))
        member.reads = fig.ReadsDuring(model)
        member.feeder = PromptFeeder(model.loaded, cache, model.prompts, request, b.prompt, b.reused, b.kv, step,
                                     lambda done: ACTIVITY.prefilled(member.flight, done - b.reused),
                                     self._between(out))
        try:
            fed = member.feeder()
        except BaseException:
            ACTIVITY.end(member.flight)
            raise
        member.snapshots = member.feeder.fed.snapshots
        (uid,) = self.generator.insert(
            [b.prompt[fed:]], max_tokens=[b.max_tokens], caches=[cache], all_tokens=[b.prompt[:fed]],
            samplers=[request.make_sampler()], logits_processors=[list(request.logits_processors)],
            stop_sequences=[StopSequences([[t] for t in tokenizer.eos_token_ids])],
        )
        self.members[uid] = member

    def _between(self, out: Channel):
        """What a joining request's prefill does between its tiles and expert groups: it
        stops if its caller has gone, and once it has run as long as the members' last
        pass took (at least `SHARE_SECONDS`), the members decode a token (one pass), so a
        long prompt joining does not stall the replies under way."""
        last = time.perf_counter()

        def between() -> None:
            nonlocal last
            out.check_cancelled()
            if self.members and self._members_due(time.perf_counter() - last):
                with suspended():
                    try:
                        self.step()
                    except BaseException as e:
                        self.fail(e)  # the members get the pass's error; the joining request too
                        raise
                last = time.perf_counter()

        return between

    def _members_due(self, fed_seconds: float) -> bool:
        """Whether the members decode now, a joining prompt having been fed this long."""
        return fed_seconds >= max(SHARE_SECONDS, self.pass_seconds)

    def kv_bytes(self) -> int:
        """Bytes of the batch's KV caches: mlx-lm's BatchGenerator keeps them in its prompt
        and generation batches (read for the dashboard, between passes)."""
        from .kv import cache_bytes

        return sum(cache_bytes(getattr(getattr(self.generator, part, None), "prompt_cache", None) or ())
                   for part in ("_prompt_batch", "_generation_batch"))

    def step(self) -> None:
        """One pass: every member's next token (a member that just joined, its last
        prompt token); members that finished or were cancelled leave."""
        for uid in [u for u, m in self.members.items() if m.out.cancel.is_set()]:
            self._leave(uid, kept=False)
        if not self.members:
            return
        before, start = syncs.count(), time.perf_counter()
        _, responses = self.generator.next()
        self.pass_seconds = time.perf_counter() - start
        share = (syncs.count() - before) / len(self.members)
        for member in self.members.values():
            member.syncs += share
            member.largest = max(member.largest, len(self.members))
        for r in list(responses):
            if r.uid in self.members:
                self._emit(r)

    def _emit(self, r) -> None:
        from mlx_lm.generate import GenerationResponse
        import mlx.core as mx

        member = self.members[r.uid]
        now = time.perf_counter()
        if member.first is None:
            member.first = now
            member.reads.stop()
        member.tokens += 1
        ACTIVITY.token(member.flight)
        if r.finish_reason != "stop":  # mlx-lm shows no text for the end-of-sequence token
            member.detokenizer.add_token(r.token)
        if r.finish_reason is not None:
            member.detokenizer.finalize()
        prompt_seconds = member.first - member.start
        response = GenerationResponse(
            text=member.detokenizer.last_segment, token=r.token, logprobs=r.logprobs, from_draft=False,
            prompt_tokens=member.prefilled, prompt_tps=member.prefilled / prompt_seconds if prompt_seconds else 0.0,
            generation_tokens=member.tokens,
            generation_tps=member.tokens / (now - member.first) if now > member.first else 0.0,
            peak_memory=mx.get_peak_memory() / 1e9, finish_reason=r.finish_reason,
        )
        if member.request.top_logprobs is not None:
            response = replace(response, logprobs=token_logprobs(response, member.request.top_logprobs))
        member.last = stopped(response, member.stops)
        member.out.put("response", member.last)
        if r.finish_reason is not None:
            self._finish(r.uid, r.prompt_cache, r.all_tokens)
        elif member.stops.hit is not None:
            cache, tokens = self.generator.remove([r.uid], return_prompt_caches=True)[r.uid]
            self._finish(r.uid, cache, tokens)

    def _finish(self, uid: int, cache, tokens) -> None:
        """A member's reply is complete: its cache goes back into the prompt cache as its
        conversation's, its figures to its caller."""
        from ..speculation.start import figures_for

        model, member = self.model, self.members[uid]
        lease = member.lease
        lease.cache, lease.tokens = cache, [int(t) for t in tokens]
        seconds = time.perf_counter() - member.start
        stats = fig.response_figures(model, member.before, member.last, len(member.prompt), member.reused,
                                     member.prefilled, seconds, member.syncs)
        stats.update(figures_for(member.request).as_dict())
        ttft = None if member.first is None else member.first - member.start
        stats.update(fig.kv_figures(cache, member.kv, member.kv_note, member.feeder.step, ttft))
        stats.update(fig.prefill_figures(member.reads, member.feeder.fed, model.loaded))
        stats.update(fig.reuse_figures(lease.reuse, model.prompts, len(member.snapshots)))
        stats["batch"] = member.largest
        if member.stops.hit is not None:
            stats["stop_sequence"] = member.stops.hit
        save_to_disk(member.disk, lease, member.from_disk, stats, model.carried.warned, member.snapshots)
        model.prompts.check_in(lease)
        self.engine.finished(stats)
        member.out.put("done", stats)
        self._leave(uid, kept=True)

    def _leave(self, uid: int, kept: bool) -> None:
        member = self.members.pop(uid)
        ACTIVITY.end(member.flight)
        if not kept:  # cancelled: its half-fed cache is dropped
            self.generator.remove([uid])
        member.out.finished.set()

    def fail(self, error: BaseException) -> None:
        """The pass raised: every member gets the error; their caches, which may hold a
        half-fed step, are not checked back in."""
        for member in self.members.values():
            ACTIVITY.end(member.flight)
            member.out.put("error", error)
            member.out.finished.set()
        self.members.clear()

    def close(self) -> None:
        import mlx.core as mx

        mx.synchronize()  # nothing may still read a slot when the pools change
        ACTIVITY.batch = None
        self.generator.close()


def admit_or_refuse(batch: Batch, request: Request, out: Channel) -> None:
    """A request taken from the queue joins, or its caller gets its one-line error."""
    try:
        out.check_cancelled()
        batch.admit(request, out)
    except BaseException as e:  # a prompt too long, a cancelled caller, an interrupt
        out.put("error", e)
        out.finished.set()
        if not isinstance(e, Exception):
            raise
