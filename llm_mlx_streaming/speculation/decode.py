"""The speculative decode loop: draft k tokens, verify them in one pass, keep the agreeing prefix.

One forward over ``[last, d1..dk]`` runs every streamed layer once for k+1 positions,
so it reads the union of their experts and pays the per-layer fixed costs once. Only
tokens the verifier chose are emitted (sampling.py), and the cache is rolled back past
rejected drafts (rollback.py), so the cache afterwards holds what plain decoding
would have put there. The prompt is prefilled as the plain path prefills it (the
engine's prefill, handed in as `feed`), and a pass without drafts is exactly mlx-lm's
single-token step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Optional

import mlx.core as mx
from mlx_lm.generate import (
    GenerationResponse,
    generation_stream,
    maybe_quantize_kv_cache,
    wired_limit,
)

from .. import syncs
from ..processors import apply_at_positions
from . import heads
from .depth import Depth
from .rollback import VerifyPass, room
from .sampling import TargetSampler, choose


@dataclass
class SpecFigures:
    """What speculation did in one generation (response_json, `llm mlxs stats`)."""

    k: "int | str"  # draft tokens per pass, or "auto"
    draft: str
    draft_tokens: int = 0  # drafts verified
    accepted_tokens: int = 0  # drafts the verifier kept
    verify_passes: int = 0  # forwards after the prefill
    pass_tokens: int = 0  # tokens emitted by those forwards
    speculation_off: Optional[str] = None  # why this generation decoded without drafts

    def as_dict(self) -> dict:
        return {
            "k": self.k,
            "draft": self.draft,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": round(self.accepted_tokens / self.draft_tokens, 4)
            if self.draft_tokens else None,
            "verify_passes": self.verify_passes,
            "tokens_per_pass": round(self.pass_tokens / self.verify_passes, 3)
            if self.verify_passes else None,
            "speculation_off": self.speculation_off,
        }


@dataclass
class SpeculativeRun:
    """One speculative generation over a prepared cache.

    `history` is the sequence the cache already holds (a reused prefix), `prompt` the
    tokens still to prefill. After (or during) iteration `fed` is exactly the tokens
    the cache has seen beyond `history`, which the prompt cache records.
    """

    model: object
    cache: list
    history: list[int]
    prompt: list[int]
    drafter: object
    depth: Depth
    target: TargetSampler
    sampler: object
    max_tokens: int
    processors: list  # stateless logits processors (processors.py), applied per position
    figures: SpecFigures
    fed: list[int] = field(default_factory=list)
    observer: object = None  # called with (inputs, kept) after each verify pass (benchmarks)
    feed: object = None  # feed(forward): the engine's prefill of all but the last prompt token
    kv_kwargs: dict = field(default_factory=dict)  # a quantized KV layout (stream_generate's kv_*)
    _linear_layers: Optional[list] = field(default=None, init=False, repr=False)  # VerifyPass's
    _at: int = field(default=0, init=False, repr=False)  # prompt tokens fed so far by `_forward`

    def tokens(self) -> Iterator[tuple[int, mx.array, bool]]:
        """(token, logprobs, from_draft) as mlx-lm's step generators yield them."""
        if self.max_tokens <= 0:
            return
        with mx.stream(generation_stream):
            if self.drafter.needs_hidden:  # it is shown the prompt as it is prefilled
                self.drafter.reset(self.history + self.prompt[:1])
            last = self._prefill()
            logits, hidden = heads.forward(self.model, mx.array([last])[None], self.cache,
                                           self.drafter.needs_hidden)
            logits = self._processed(logits[0], [last])
            self.fed.append(last)
            self._quantize()
            logprobs = _logprobs(logits)
            y = int(syncs.item(self.sampler(logprobs)))
            if not self.drafter.needs_hidden:
                self.drafter.reset(self.history + self.fed)
            self.drafter.accept([y], None if hidden is None else hidden[0])
            emitted = 1
            yield y, logprobs[0], False
            first = VerifyPass(self.model, self.cache)
            self._linear_layers = first.layers
            if not first.supported:
                self.figures.speculation_off = "state cache cannot be rolled back"
                self.depth = Depth(0)
            while emitted < self.max_tokens:
                k = min(self.depth.next(), self.max_tokens - emitted - 1)
                if k > 0 and room(self.cache) <= k:
                    k = room(self.cache) - 1
                    if k == 0:
                        self.figures.speculation_off = "sliding-window cache full"
                drafts = [int(t) for t in self.drafter.propose(k)[:k]] if k > 0 else []
                guess = self.drafter.propose(1) if self.depth.auto and self.depth.k == 0 else []
                out, logprobs, hidden = self._verify(y, drafts)
                if guess:
                    self.depth.watched(guess[0] == out[0])
                self.drafter.accept(out, None if hidden is None else hidden[0, : len(out)])
                for i, token in enumerate(out):
                    emitted += 1
                    yield token, logprobs[i], i < len(out) - 1
                    if emitted == self.max_tokens:
                        return
                y = out[-1]

    def _prefill(self) -> int:
        """Feed all but the last prompt token (`feed`, as the plain path feeds them); return the last."""
        if len(self.prompt) > 1:
            self._at = 0
            self.feed(self._forward if self.drafter.needs_hidden else None)
            self.fed.extend(self.prompt[:-1])
        return self.prompt[-1]

    def _forward(self, chunk: mx.array, embeddings=None) -> None:
        """A prefill call for a drafter that reads hidden states (an MTP head): it builds
        its own cache over the prompt, each position's state with the token it produced.
        The target's cache is what `self.model(chunk)` leaves, without the logits."""
        n = chunk.shape[1]
        hidden = self.model.model(chunk, cache=self.cache)
        self.drafter.accept(self.prompt[self._at + 1 : self._at + n + 1], hidden[0])
        self._at += n

    def _processed(self, logits: mx.array, inputs: list[int]) -> mx.array:
        """The pass's (L, V) logits after the request's processors, row by row."""
        if not self.processors:
            return logits
        return apply_at_positions(self.processors, self.history + self.fed, inputs, logits)

    def _quantize(self) -> None:
        """mlx-lm's switch to a quantized KV cache, at the same points generate_step makes it."""
        kw = self.kv_kwargs
        maybe_quantize_kv_cache(self.cache, kw.get("quantized_kv_start", 0),
                                kw.get("kv_group_size", 64), kw.get("kv_bits"))

    def _verify(self, y: int, drafts: list[int]):
        """One forward over [y, *drafts]; (tokens to emit, their logprobs, hidden or None)."""
        inputs = [y, *drafts]
        verify = VerifyPass(self.model, self.cache, self._linear_layers)
        with verify.recording(len(inputs)):
            logits, hidden = heads.forward(self.model, mx.array(inputs)[None], self.cache,
                                           self.drafter.needs_hidden)
        logprobs = _logprobs(self._processed(logits[0], inputs))
        accepted, token = choose(logprobs, drafts, self.target, self.sampler)
        verify.keep(1 + accepted)
        self._quantize()
        self.fed.extend(inputs[: 1 + accepted])
        f = self.figures
        f.verify_passes += 1
        f.pass_tokens += accepted + 1
        f.draft_tokens += len(drafts)
        f.accepted_tokens += accepted
        self.depth.update(len(drafts), accepted)
        if self.observer is not None:
            self.observer(inputs, 1 + accepted)
        if len(self.fed) % 256 < len(inputs):
            mx.clear_cache()
        return [*drafts[:accepted], token], logprobs, hidden


def _logprobs(logits: mx.array) -> mx.array:
    """(L, V) log-probabilities, row by row as generate_step computes them."""
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def stream_speculative(run: SpeculativeRun, tokenizer) -> Iterator[GenerationResponse]:
    """mlx-lm `GenerationResponse`s for `run`, with stream_generate's stopping rules:
    stop at an end-of-sequence token (reported, not detokenized) or after max_tokens."""
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    prompt_size = len(run.prompt)
    with wired_limit(run.model, [generation_stream]):
        tic = time.perf_counter()
        prompt_tps = 0.0
        token = logprobs = None
        from_draft = False
        n = -1
        for n, (token, logprobs, from_draft) in enumerate(run.tokens()):
            if n == 0:
                prompt_tps = prompt_size / (time.perf_counter() - tic)
                tic = time.perf_counter()
            if token in tokenizer.eos_token_ids:
                break
            detokenizer.add_token(token)
            if n + 1 == run.max_tokens:
                break
            yield _response(detokenizer.last_segment, token, logprobs, from_draft, prompt_size,
                            prompt_tps, n + 1, tic, None)
        if n < 0:
            return
        detokenizer.finalize()
        yield _response(detokenizer.last_segment, token, logprobs, from_draft, prompt_size,
                        prompt_tps, n + 1, tic,
                        "stop" if token in tokenizer.eos_token_ids else "length")


def _response(text, token, logprobs, from_draft, prompt_size, prompt_tps, generated, tic, finish):
    mx.eval(logprobs)  # here, on the stream it was made on: the caller may read it from another thread
    return GenerationResponse(
        text=text, token=token, logprobs=logprobs, from_draft=from_draft,
        prompt_tokens=prompt_size, prompt_tps=prompt_tps, generation_tokens=generated,
        generation_tps=generated / (time.perf_counter() - tic),
        peak_memory=mx.get_peak_memory() / 1e9, finish_reason=finish,
    )
