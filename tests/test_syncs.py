"""`syncs_per_token` is exact: the test counts the engine's host reads itself."""

import pytest

from exactness import generate, prompt_tokens, vocab_size
from llm_mlx_streaming import syncs
from llm_mlx_streaming.engine.manager import EngineManager
from llm_mlx_streaming.experts.switch import StreamingExperts


@pytest.fixture
def qwen(build):
    return build("qwen3_moe", num_experts=8, top_k=2)


@pytest.fixture
def counted(monkeypatch):
    """Counts every host read (`to_host`, which item/tolist go through) and every forced
    evaluation, and every MoE layer call, independently of the engine's counter."""
    seen = {"reads": 0, "evals": 0, "layer_calls": 0}
    to_host, evaluate, call = syncs.to_host, syncs.evaluate, StreamingExperts.__call__

    def counting_read(array):
        seen["reads"] += 1
        return to_host(array)

    def counting_eval(*arrays):
        seen["evals"] += 1
        return evaluate(*arrays)

    def counting_call(self, *args, **kwargs):
        seen["layer_calls"] += 1
        return call(self, *args, **kwargs)

    monkeypatch.setattr(syncs, "to_host", counting_read)
    monkeypatch.setattr(syncs, "evaluate", counting_eval)
    monkeypatch.setattr(StreamingExperts, "__call__", counting_call)
    return seen


def _run(counted, engine, prompt, **request):
    """(tokens, figures) of one request, counted from its start (not the load's trace)."""
    counted.update(reads=0, evals=0, layer_calls=0)
    handle = generate(engine, prompt, max_tokens=12, **request)
    tokens = [r.token for r in handle]
    return tokens, handle.stats


def test_a_streamed_layer_reads_the_router_back_once_per_call(qwen, counted):
    engine = EngineManager()
    engine.load(qwen, expert_slots=4, overlap="off")  # no read-ahead: its predictions read back too
    tokens, stats = _run(counted, engine, prompt_tokens(vocab_size(qwen), n=2))  # no call over 4 experts
    assert counted["evals"] == 0
    assert counted["reads"] == counted["layer_calls"] > 0
    assert stats["syncs"] == counted["reads"]
    assert stats["syncs_per_token"] == round(counted["reads"] / len(tokens), 3)
    live = engine.metrics()
    assert live["syncs"] == counted["reads"] and live["generated_tokens"] == len(tokens)
    engine.unload()


def test_whole_pools_need_no_read_back(qwen, counted):
    engine = EngineManager()
    engine.load(qwen, expert_slots=None)  # a slot per expert
    _, stats = _run(counted, engine, prompt_tokens(vocab_size(qwen), n=80))  # prefill calls >= 64 routes too
    assert counted["layer_calls"] > 0 and counted["reads"] == counted["evals"] == 0
    assert stats["syncs"] == 0 and stats["syncs_per_token"] == 0
    engine.unload()


def test_over_capacity_calls_count_each_chunk_they_evaluate(qwen, counted):
    engine = EngineManager()
    engine.load(qwen, expert_slots=2, overlap="off")
    _, stats = _run(counted, engine, prompt_tokens(vocab_size(qwen), n=40))
    assert counted["evals"] > 0
    assert stats["syncs"] == counted["reads"] + counted["evals"]
    engine.unload()


def test_speculation_counts_its_verify_reads(qwen, counted):
    engine = EngineManager()
    engine.load(qwen, expert_slots=4, overlap="off")  # no read-ahead: its predictions read back too
    prompt = prompt_tokens(vocab_size(qwen), n=12) * 3  # repeats: the ngram drafter proposes
    _, stats = _run(counted, engine, prompt, k=3)
    assert stats["verify_passes"] > 0
    assert counted["reads"] > counted["layer_calls"]  # each pass also reads its choice back
    assert stats["syncs"] == counted["reads"] + counted["evals"]
    engine.unload()


def test_llm_mlxs_stats_sums_syncs_over_responses():
    from llm_mlx_streaming.cli.stats import _stat_lines, aggregate

    rows = [{"stats": {"syncs": 8, "generated_tokens": 4}}, {"stats": {"syncs": 2, "generated_tokens": 6}}]
    totals = aggregate(rows)
    assert totals["syncs"] == 10 and totals["syncs_per_token"] == 1.0  # a ratio of sums
    assert ["host syncs", "10 (1.0 per generated token)"] in _stat_lines(totals)
