"""Runs a model the way stock mlx-lm does and records what exactness is judged on."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache


def prompt_tokens(vocab_size: int, n: int = 48, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(0, vocab_size, n)]


def greedy_tokens(model, prompt: list[int], n: int = 32, logits_processors=()) -> list[int]:
    """mlx-lm's own generation loop, greedy, ignoring end-of-sequence."""
    steps = generate_step(mx.array(prompt), model, max_tokens=n, logits_processors=list(logits_processors) or None)
    return [token for token, _ in steps]


def logits_trace(model, prompt: list[int], tokens: list[int]):
    """Prefill logits of `prompt`, then the logits of each decode step fed `tokens`."""
    cache = make_prompt_cache(model)
    prefill = np.array(model(mx.array(prompt)[None], cache=cache).astype(mx.float32))
    decode = []
    for token in tokens:
        logits = model(mx.array([[token]]), cache=cache)
        decode.append(np.array(logits.astype(mx.float32)))
    return prefill, decode


def vocab_size(path) -> int:
    import json
    from pathlib import Path

    return json.loads((Path(path) / "config.json").read_text())["vocab_size"]


def generate(engine, prompt: list[int], *, max_tokens=None, logits_processors=(), **request):
    """Queue a generation from token ids on whatever `engine` has loaded (its Generation)."""
    from llm_mlx_streaming.engine.request import Request

    return engine.run(None, Request(prompt=list(prompt), max_tokens=max_tokens,
                                    logits_processors=list(logits_processors), **request))
