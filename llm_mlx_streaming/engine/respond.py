"""One generation for one request, on the engine thread, under the provider's lock.

`respond` is the whole of it, in order: the token budget, the KV layout, the cache
checked out of the model's prompt cache with its longest cached prefix (in memory, then
on disk), plain decoding or speculation, stop sequences, the routing trace, the figures,
and the cache saved to disk and checked back in. What it keeps for the next generation
(the drafter, the disk cache in use, warnings already given) is in `Carried`.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .. import syncs
from ..errors import one_line
from ..processors import with_history
from ..stops import StopMatcher
from . import figures as fig, worker
from ..activity import ACTIVITY
from .generation import Channel, Started
from .provider import Carried, EngineError, ModelProvider
from .request import Request
from .disk_cache import DiskCache, namespace
from .kv import KVError, layout_for, make_cache
from .planner import model_context
from .prefill import Fed, feed
from .snapshots import TURNS
from .trace import TraceRecorder


def respond(provider: ModelProvider, request: Request, out: Channel, carried: Carried,
            default_max_tokens: int) -> dict:
    """Generate `request` on the loaded model, putting "started" then each response on
    `out`; returns the figures (the caller puts "done")."""
    import mlx.core as mx
    from mlx_lm.generate import stream_generate

    from ..speculation import start as spec

    loaded, prompts = provider.loaded, provider.prompts
    begun = begin(provider, request, out, carried, default_max_tokens)
    prompt, max_tokens, kv, kv_note = begun.prompt, begun.max_tokens, begun.kv, begun.kv_note
    lease, disk, from_disk = begun.lease, begun.disk, begun.from_disk
    cache, reused, new_tokens = lease.cache, begun.reused, begun.new_tokens

    step = request.chunk(len(prompt))  # prompt tokens per model call of the prefill (engine/prefill.py)
    # the dashboard's request in flight (activity.py)
    flight = ACTIVITY.begin(len(prompt), reused, len(new_tokens), step, len(loaded.layers))

    def prefilled(done: int, last: bool = False) -> None:
        provider.stepping.between_chunks(out, last)
        ACTIVITY.prefilled(flight, done)

    before, syncs_before = provider.counters(), syncs.count()
    mx.reset_peak_memory()
    start = time.perf_counter()
    ttft = last = None
    generated: list[int] = []
    recorder = _recorder(loaded, request.trace_path)
    stops = StopMatcher(request.stop)
    run = None
    prompt_reads = fig.ReadsDuring(provider)
    embeddings = None
    if loaded.takes_images:  # the whole prompt's embeddings, images in place; fed from `reused` on
        embeddings = loaded.model.embed(prompt, request.vision)[reused:]
    feeder = PromptFeeder(loaded, cache, prompts, request, prompt, reused, kv, step,
                          lambda done: prefilled(done - reused), lambda: provider.stepping.between_groups(out), embeddings)
    try:  # a generation that raises leaves its cache out of the prompt cache: it may hold a half-fed step
        try:
            figures = spec.figures_for(request)
            if figures.k != 0:  # k > 0 runs the draft-and-verify loop
                figures.speculation_off = spec.off_reason(request, loaded)
                if figures.speculation_off is None:
                    run = spec.make_run(request, loaded, cache, prompt[:reused], prompt[reused:], max_tokens,
                                        carried.drafters, figures, feed=feeder, kv_kwargs=kv.generate_kwargs())
        except (ValueError, spec.DraftError) as e:
            raise EngineError(one_line(e)) from None
        if run is not None:
            from ..speculation.decode import stream_speculative

            responses = stream_speculative(run, loaded.tokenizer)
        else:
            def plain():  # fed when first asked for, as a speculative run is (a pipeline tells its ranks first)
                fed = feeder(None)
                yield from stream_generate(
                    loaded.model, loaded.tokenizer, prompt[fed:],
                    input_embeddings=None if embeddings is None else embeddings[fed - reused:],
                    max_tokens=max_tokens, sampler=request.make_sampler(),
                    logits_processors=with_history(request.logits_processors, prompt[:fed]) or None,
                    prompt_cache=cache, **kv.generate_kwargs(),
                    prompt_progress_callback=lambda done, total: prefilled(fed - reused + done, done == total),
                )

            responses = plain()
        responses = provider.stepping.steps(responses)
        for response in responses:
            if ttft is None:
                ttft = time.perf_counter() - start
                prompt_reads.stop()
            ACTIVITY.token(flight)
            out.check_cancelled()
            generated.append(response.token)
            if request.top_logprobs is not None:
                response = replace(response, logprobs=token_logprobs(response, request.top_logprobs))
            last = stopped(response, stops)
            out.put("response", last)
            if stops.hit is not None:
                break
    finally:
        ACTIVITY.end(flight)
        mx.synchronize()  # nothing may still read a slot when the pools change
        if recorder is not None:
            recorder.__exit__(None, None, None)
    if run is not None:
        lease.fed(run.fed)  # its prompt and what it kept (the drafts it rejected were rolled back)
    else:
        lease.fed(prompt[reused:])
        lease.fed(generated)
    snapshots = feeder.fed.snapshots
    stats = fig.response_figures(provider, before, last, len(prompt), reused, len(new_tokens),
                                 time.perf_counter() - start, syncs.count() - syncs_before)
    if stops.hit is not None:
        stats["stop_sequence"] = stops.hit
    if request.conversation_cache is not None and (off := disk_cache_off(loaded, request)):
        stats["disk_cache_off"] = off
    stats.update(figures.as_dict())
    stats.update(fig.kv_figures(cache, kv, kv_note, step, ttft))
    stats.update(fig.prefill_figures(prompt_reads, feeder.fed, loaded))
    stats.update(fig.reuse_figures(lease.reuse, prompts, len(snapshots)))
    if recorder is not None:
        _write_trace(recorder, request.trace_path, provider.checkpoint.name, stats, carried.warned)
    save_to_disk(disk, lease, from_disk, stats, carried.warned, snapshots)
    prompts.check_in(lease)
    return stats


class PromptFeeder:
    """Feeds a prompt but its last token into `cache` (engine/prefill.py): model calls of
    `step` tokens, a snapshot kept in `prompts` (the model's prompt cache) at each of the
    request's positions where it keeps them, `between()` after each tile and expert group
    (a cancellation, other requests' decode steps). Called once, by the plain path, a
    speculative run (with its own forward, for a drafter that reads hidden states) or a
    batch member before it joins."""

    def __init__(self, loaded, cache, prompts, request: Request, prompt: list[int], reused: int, kv, step: int,
                 on_chunk, between, embeddings=None):
        self.loaded, self.cache, self.prompts, self.request = loaded, cache, prompts, request
        self.prompt, self.reused, self.kv, self.step = prompt, reused, kv, step
        self.on_chunk, self.between, self.embeddings = on_chunk, between, embeddings
        self.fed = Fed(reused, [])

    def __call__(self, forward=None) -> int:
        """Feed prompt[reused:-1]; returns the tokens now in the cache."""
        from .snapshots import positions

        prompts, request = self.prompts, self.request
        marks = {}
        if prompts.snapshots is not None and not disk_cache_off(self.loaded, request):  # images: tokens do not tell them apart
            marks = dict(positions(self.reused, len(self.prompt), request.boundaries, prompts.snapshots.every))
        self.fed = feed(self.loaded.model, self.cache, self.prompt, self.reused, len(self.prompt) - 1,
                        chunk=self.step, marks=marks, kv=self.kv, on_chunk=self.on_chunk, between=self.between,
                        embeddings=self.embeddings, forward=forward)
        self.fed.snapshots = [(at, prompts.take(self.kv, self.prompt[:at], cache, marks[at], copied=True))
                              for at, cache in self.fed.snapshots]
        return self.fed.tokens


@dataclass
class Begun:
    """What a generation starts from: its prompt and token budget, its KV layout, and its
    cache, checked out of the model's prompt cache with the prefix it reuses (from memory,
    or the conversation cache on disk)."""

    prompt: list[int]
    max_tokens: int
    kv: Any
    kv_note: Any
    lease: Any  # engine/prompt_cache.Lease: checked back in after the reply
    disk: Any

    @property
    def reused(self) -> int:
        return self.lease.reused

    @property
    def new_tokens(self) -> list[int]:
        return self.prompt[self.lease.reused:]

    @property
    def from_disk(self) -> int:
        return self.lease.reused if self.lease.reuse.source == "disk" else 0


def begin(provider: ModelProvider, request: Request, out: Channel, carried: Carried,
          default_max_tokens: int) -> Begun:
    """The start every generation shares, alone or in a batch, ending with "started" on `out`."""
    loaded, prompts = provider.loaded, provider.prompts
    prompt = [int(t) for t in request.prompt]
    max_tokens = token_budget(prompt, request, default_max_tokens, provider.context_length)
    for processor in request.budget_aware:  # constrained decoding closes within it
        processor.limit_tokens(max_tokens)
    kv, kv_note = kv_layout(loaded, request.kv)
    # the conversations share the KV cache the memory plan holds for the context
    prompts.bound(request.snapshots, prompts.size(kv, request.max_context or model_context(loaded.config)))
    hit = prompts.find(prompt, kv, images_of(request))
    disk = None if disk_cache_off(loaded, request) else disk_cache_for(provider, request, kv, carried)
    turns = max((b.position for b in request.boundaries if b.kind == TURNS), default=len(prompt))
    found = cache_from_disk(disk, loaded, prompt, kv, hit.reused)
    lease = prompts.check_out(hit, turns, len(prompt) + max_tokens, found)
    out.put("started", Started(loaded.tokenizer, provider.checkpoint, prompt, lease.reused, max_tokens))
    return Begun(prompt, max_tokens, kv, kv_note, lease, disk)


def disk_cache_off(loaded, request: Request) -> str | None:
    """Why the conversation cache on disk is not used for `request`, or None."""
    if loaded.takes_images:  # mlx-vlm's cache classes, which mlx-lm's load_prompt_cache cannot load
        return "a vision-language model"
    if images_of(request):  # keyed by tokens, which do not tell two pictures apart
        return "a prompt with images"
    return None


def images_of(request: Request) -> tuple[str, ...]:
    """The digests of the request's images, in prompt order."""
    return request.vision.digests if request.vision is not None else ()


def token_budget(prompt: list[int], request: Request, default_max_tokens: int, context: int | None) -> int:
    """Tokens this request may generate; a prompt that cannot fit is an EngineError."""
    max_tokens = default_max_tokens if request.max_tokens is None else request.max_tokens
    limit = context
    if request.max_context and (not limit or request.max_context < limit):
        limit = request.max_context
        what = f"the max_context of {limit} tokens (raise it with `llm mlxs config max_context N`)"
    else:
        what = f"the model's context of {limit} tokens"
    if not prompt:
        raise EngineError("the prompt is empty")
    if limit and len(prompt) + 1 > limit:
        raise EngineError(f"the prompt is {len(prompt)} tokens, longer than {what}")
    if max_tokens < 1:  # unlimited: until the context is full
        if not limit:
            raise EngineError("max_tokens is unlimited, but the model declares no context length")
        return limit - len(prompt)
    return min(max_tokens, limit - len(prompt)) if limit else max_tokens


def token_logprobs(response, top: int) -> tuple[float, list[tuple[int, float]]]:
    """The sampled token's log-probability and the `top` most likely (id, log-probability)
    of a response's logprobs row (after the logits processors, before temperature)."""
    import mlx.core as mx

    row = response.logprobs.reshape(-1)
    ids = []
    if top:
        best = mx.argpartition(-row, kth=top - 1)[:top]
        ids = syncs.tolist(best[mx.argsort(-row[best])])
    values = syncs.tolist(row[mx.array([response.token, *ids])])
    return values[0], list(zip(ids, values[1:]))


def stopped(response, stops: StopMatcher):
    """`response` with its text cut at a stop sequence (finish "stop"), or the held-back
    text flushed at the end."""
    text = stops.feed(response.text)
    if stops.hit is not None:
        return replace(response, text=text, finish_reason="stop")
    if response.finish_reason is not None:
        return replace(response, text=text + stops.flush())
    return replace(response, text=text) if text != response.text else response


def kv_layout(loaded, spec):
    """(the KV layout the loaded model runs `spec` with, a note when it differs);
    a layout the model cannot take is an EngineError."""
    from mlx.utils import tree_flatten

    try:
        return layout_for(spec, loaded.config, (n for n, _ in tree_flatten(loaded.model.parameters())))
    except KVError as e:
        raise EngineError(str(e)) from None


# -- the conversation cache on disk (engine/disk_cache.py) ------------------------------
def disk_cache_for(provider: ModelProvider, request: Request, kv, carried: Carried):
    """The conversation cache for this request's checkpoint and KV layout, or None."""
    spec = request.conversation_cache
    if spec is None:  # this turn changes a cache unseen: a later one writes it whole
        carried.disk = carried.disk_key = None
        return None
    key = (spec, str(provider.checkpoint), kv)
    if carried.disk_key != key:  # the namespace reads the checkpoint's fingerprint
        carried.disk, carried.disk_key = DiskCache(spec, namespace(provider.checkpoint, kv)), key
    return carried.disk


def cache_from_disk(disk, loaded, prompt, kv, reused: int):
    """A longer prefix than the `reused` tokens memory holds, from disk, when there is
    one (engine/disk_cache.Found), else None."""
    if disk is None or reused >= len(prompt) - 1:
        return None
    return disk.lookup(prompt, reused, make_cache(loaded.model, kv))


def save_to_disk(disk, lease, from_disk: int, stats: dict, warned: set, snapshots=()) -> None:
    """Save a request's cache (its engine/prompt_cache.Lease) for a later process, a
    segment ending at each of this generation's `snapshots` ((position, cache)) so that a
    later prompt can resume there too; a failed write is a warning and a figure, never a
    lost reply."""
    stats["disk_cache_tokens"] = from_disk
    if disk is None or not lease.tokens:
        return
    try:
        with worker.whole_write():  # an exit that cannot wait for the engine waits for this
            stats["disk_cache_saved_bytes"] = disk.save(lease.cache, lease.tokens, stats["reused_tokens"],
                                                        snapshots)
    except Exception as e:  # OSError, a cache class save_prompt_cache cannot write
        stats["disk_cache_error"] = one_line(e)
        _warn_once(warned, "disk_cache", f"conversation cache not saved: {one_line(e)}")


# -- the routing trace (engine/trace.py) ----------------------------------------------
def _recorder(loaded, trace_path):
    if trace_path is None or not loaded.layers:
        return None
    return TraceRecorder(loaded.layers, loaded.layers[0].layout.num_experts).__enter__()


def _write_trace(recorder, path: Path, model: str, stats: dict, warned: set) -> None:
    """Telemetry never fails a response: a trace that cannot be written is a warning
    (once per path) and a `trace_error` figure."""
    try:
        recorder.write(path, model)
    except OSError as e:
        stats["trace_error"] = one_line(e)
        _warn_once(warned, str(path), f"routing trace not written: {one_line(e)}")


def _warn_once(warned: set, key: str, message: str) -> None:
    if key not in warned:
        warned.add(key)
        print(f"mlx-stream: warning: {message}", file=sys.stderr)
