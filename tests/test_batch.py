"""Continuous batching (engine/batch.py): each sequence's tokens are stock mlx-lm's batch
generation of the same requests joined at the same steps, at full pools and at 2 slots;
requests that cannot batch run alone; a cancelled member leaves the others untouched."""

import threading

import pytest
from mlx_lm.utils import load as mlx_load

from exactness import prompt_tokens, vocab_size
from fixtures.architectures import ARCHITECTURES
from fixtures.batches import engine_batch, stock_batch
from llm_mlx_streaming.engine import worker
from llm_mlx_streaming.engine.batch import alone_reason
from llm_mlx_streaming.engine.manager import EngineManager
from llm_mlx_streaming.engine.request import Request, Sampling

MOE = [a for a in ARCHITECTURES if a != "qwen3"]  # qwen3: the factory's dense draft model


def _prompts(path):
    return [prompt_tokens(vocab_size(path), n=n, seed=i) for i, n in enumerate((9, 14, 5, 11))]


@pytest.mark.parametrize("slots", [None, 2], ids=["all", "2"])
@pytest.mark.parametrize("arch", MOE)
def test_batched_sequences_are_stock_batch_generation(build, arch, slots):
    path = build(arch, num_experts=8, top_k=2)
    prompts = _prompts(path)
    engine = EngineManager()
    engine.load(path, expert_slots=slots)
    if alone_reason(Request(prompt=[1], max_batch=4), engine.loaded.model) is not None:
        pytest.skip(f"{arch}: {alone_reason(Request(prompt=[1], max_batch=4), engine.loaded.model)}")
    try:
        model, tokenizer = mlx_load(str(path))
        assert engine_batch(engine, prompts) == stock_batch(model, tokenizer, prompts)
        assert engine.counters().unplaced == 0 and engine.bad_slots() == 0
    finally:
        engine.unload()


@pytest.fixture
def qwen(build):
    return build("qwen3_moe", num_experts=8, top_k=2)


def _queued_behind_a_held_job(engine, requests):
    """Run `requests` queued together behind a job that holds the engine thread, so
    they are all waiting when the first one starts."""
    go = threading.Event()
    worker.submit(lambda out: go.wait(30))
    handles = [engine.run(None, r) for r in requests]
    go.set()
    return handles


def test_queued_requests_batch_and_each_gets_its_reply_alone(qwen):
    engine = EngineManager()
    engine.load(qwen, expert_slots=4)
    prompts = [prompt_tokens(vocab_size(qwen), n=8 + 3 * i, seed=i) for i in range(4)]
    runs = [engine.run(None, Request(prompt=p, max_tokens=10)) for p in prompts]
    alone = [[r.token for r in h] for h in runs]
    one_syncs = min(h.stats["syncs_per_token"] for h in runs)
    handles = _queued_behind_a_held_job(engine, [Request(prompt=p, max_tokens=10, max_batch=4) for p in prompts])
    assert [[r.token for r in h] for h in handles] == alone
    assert [h.stats["batch"] for h in handles] == [4, 4, 4, 4]
    assert engine.metrics()["largest_batch"] == 4 and engine.metrics()["batch"] == 0
    assert max(h.stats["syncs_per_token"] for h in handles) < one_syncs
    engine.unload()


def test_a_request_that_cannot_batch_waits_and_runs_alone(qwen):
    engine = EngineManager()
    engine.load(qwen, expert_slots=4)
    p = prompt_tokens(vocab_size(qwen), n=8)
    seeded = Request(prompt=p, max_tokens=6, max_batch=4, sampling=Sampling(seed=3, temperature=0.8))
    assert alone_reason(seeded, engine.loaded.model) == "a seed or its own sampler (reproducible alone)"
    assert alone_reason(Request(prompt=p, k=3, max_batch=4), engine.loaded.model) == "speculation"
    assert alone_reason(Request(prompt=p), engine.loaded.model) == "max_batch 1"
    first, second, third = _queued_behind_a_held_job(
        engine, [Request(prompt=p, max_tokens=6, max_batch=4), seeded, Request(prompt=p, max_tokens=6, max_batch=4)])
    for h in (first, second, third):
        list(h)
    assert first.stats["batch"] == 1 and "batch" not in second.stats and third.stats["batch"] == 1
    again = engine.run(None, Request(prompt=p, max_tokens=6, sampling=Sampling(seed=3, temperature=0.8)))
    assert [r.token for r in again] == second.tokens  # the seed's draws were its own
    engine.unload()


def test_a_cancelled_member_leaves_and_the_others_go_on(qwen):
    engine = EngineManager()
    engine.load(qwen, expert_slots=4)
    prompts = [prompt_tokens(vocab_size(qwen), n=8, seed=i) for i in range(3)]
    alone = [[r.token for r in engine.run(None, Request(prompt=p, max_tokens=12))] for p in prompts]
    cancelled, calls = threading.Event(), []

    def held_until_cancelled(tokens, logits):  # its third pass (a token ahead) waits for the cancel
        calls.append(1)
        if len(calls) == 3:
            assert cancelled.wait(30)
        return logits

    requests = [Request(prompt=p, max_tokens=12, max_batch=4) for p in prompts]
    requests[1].logits_processors.append(held_until_cancelled)
    served = engine.served
    handles = _queued_behind_a_held_job(engine, requests)
    next(handles[1])
    handles[1].cancel()
    cancelled.set()
    assert [r.token for r in handles[0]] == alone[0]
    assert [r.token for r in handles[2]] == alone[2]
    handles[1].close()  # returns once the engine has let go of it
    assert len(calls) <= 4 and engine.served == served + 2  # it left at the next pass
    assert engine.bad_slots() == 0
    engine.unload()


def test_a_long_prompt_joins_in_one_call_while_the_members_go_on_decoding(qwen, monkeypatch):
    from llm_mlx_streaming.engine import batch as batching
    from llm_mlx_streaming.engine.generation import Channel

    monkeypatch.setattr(batching.Batch, "_members_due", lambda self, fed: True)  # a pass after each group
    engine = EngineManager()
    engine.load(qwen, expert_slots=2)  # 8 experts a layer: each call of the long prompt reads 4 groups
    short = prompt_tokens(vocab_size(qwen), n=6, seed=1)
    long = prompt_tokens(vocab_size(qwen), n=300, seed=2)
    alone = {len(p): [r.token for r in engine.run(None, Request(prompt=p, max_tokens=n))]
             for p, n in ((short, 40), (long, 4))}
    engine.prompts.reset()  # both prompts cold again
    running = batching.Batch(engine, 4)
    outs = [Channel(), Channel()]
    events = {id(out): [] for out in outs}

    def tokens(out):
        while not out.events.empty():
            events[id(out)].append(out.events.get())
        return [r.token for kind, r in events[id(out)] if kind == "response"]

    try:
        running.admit(Request(prompt=short, max_tokens=40, max_batch=4), outs[0])
        running.step()
        before = len(tokens(outs[0]))
        running.admit(Request(prompt=long, max_tokens=4, max_batch=4), outs[1])
        assert len(tokens(outs[0])) > before  # the member decoded while the long prompt was fed
        for _ in range(100):
            if not running.members:
                break
            running.step()
    finally:
        running.close()
    assert tokens(outs[0]) == alone[len(short)] and tokens(outs[1]) == alone[len(long)]
    done = dict(e for e in events[id(outs[1])] if e[0] == "done")["done"]
    assert done["prefill_calls"] == 1  # (its passes count the member's decode reads meanwhile too)
    engine.unload()
