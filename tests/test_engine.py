"""The engine manager, the checkpoint index and their errors."""

import json
import threading
import time

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm import generate as mlx_generate
from mlx_lm import load as mlx_load

from exactness import generate, greedy_tokens, prompt_tokens, vocab_size
from llm_mlx_streaming.engine.loading import load_streaming
from llm_mlx_streaming.engine.figures import peak_rss_bytes
from llm_mlx_streaming.engine.manager import EngineManager
from llm_mlx_streaming.engine.provider import EngineError
from llm_mlx_streaming.experts.index import CheckpointIndex


@pytest.fixture
def qwen(build):
    return build("qwen3_moe", quant="4bit", num_experts=16, top_k=4)


def test_generate_matches_mlx_lm_generate(qwen):
    model, tokenizer = mlx_load(str(qwen))
    messages = [{"role": "user", "content": "Tell me about solid state drives and their pages."}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    expected = mlx_generate(model, tokenizer, prompt, max_tokens=40)

    engine = EngineManager()
    engine.load(qwen, expert_slots=5, policy="lru")
    text = "".join(r.text for r in generate(engine, prompt, max_tokens=40))
    assert text == expected
    stats = engine.last_stats
    assert stats["misses"] > 0 and stats["unplaced"] == 0
    assert stats["prompt_tokens"] == len(prompt) and stats["reused_tokens"] == 0
    assert stats["expert_slots"] == 5 and stats["policy"] == "lru"
    assert engine.bad_slots() == 0
    engine.unload()


def test_a_turn_that_extends_the_last_one_prefills_only_new_tokens(qwen):
    engine = EngineManager()
    engine.load(qwen, expert_slots=6)
    prompt = prompt_tokens(vocab_size(qwen), n=40)
    first = [r.token for r in generate(engine, prompt, max_tokens=8)]
    follow = prompt + first + prompt_tokens(vocab_size(qwen), n=10, seed=3)
    second = [r.token for r in generate(engine, follow, max_tokens=8)]
    stats = engine.last_stats
    assert stats["reused_tokens"] == len(prompt) + len(first)
    assert stats["prefilled_tokens"] == 10

    fresh = EngineManager()
    fresh.load(qwen, expert_slots=6)
    assert [r.token for r in generate(fresh, follow, max_tokens=8)] == second
    assert fresh.last_stats["reused_tokens"] == 0
    engine.unload(), fresh.unload()


def test_interrupted_generation_leaves_the_engine_usable(qwen):
    engine = EngineManager()
    engine.load(qwen, expert_slots=5)
    prompt = prompt_tokens(vocab_size(qwen), n=30)
    expected = [r.token for r in generate(engine, prompt, max_tokens=12)]

    calls = []

    def interrupt(tokens, logits):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return logits

    with pytest.raises(KeyboardInterrupt):
        for _ in generate(engine, prompt + [1, 2], max_tokens=12, logits_processors=[interrupt]):
            pass
    assert len(calls) == 4
    assert engine.bad_slots() == 0
    assert [r.token for r in generate(engine, prompt, max_tokens=12)] == expected
    assert engine.last_stats["reused_tokens"] == 0  # the interrupted cache was dropped
    engine.unload()


def test_a_second_caller_waits_its_turn(qwen):
    """a's first step holds the engine until b's request is queued behind it: b's steps
    must all come after a's."""
    engine = EngineManager()
    engine.load(qwen, expert_slots=8)
    prompt = prompt_tokens(vocab_size(qwen), n=20)
    steps = []  # the caller of every sampling step, as the engine ran them
    results, a_running = {}, threading.Event()

    def note_for(name):
        def note(tokens, logits):
            steps.append(name)
            if name == "a" and not a_running.is_set():
                a_running.set()
                deadline = time.monotonic() + 60
                while engine.queued < 1:  # b is waiting for the engine
                    assert time.monotonic() < deadline, "b was never queued"
                    time.sleep(0.001)
            return logits
        return note

    def run(name):
        results[name] = [r.token for r in generate(engine, prompt, max_tokens=6, logits_processors=[note_for(name)])]

    a = threading.Thread(target=run, args=("a",))
    a.start()
    assert a_running.wait(60)
    b = threading.Thread(target=run, args=("b",))
    b.start()
    for t in (a, b):
        t.join(120)
    assert results["a"] == results["b"]
    n = steps.count("a")
    assert n >= 6 and steps == ["a"] * n + ["b"] * n  # b ran after a, not alongside
    engine.unload()


def test_changing_expert_slots_rebuilds_pools_and_keeps_dense_weights(qwen):
    engine = EngineManager()
    engine.load(qwen, expert_slots=4)
    dense = {k: id(v) for k, v in tree_flatten(engine.loaded.model.parameters()) if ".experts." not in k}
    prompt = prompt_tokens(vocab_size(qwen), n=30)
    before = [r.token for r in generate(engine, prompt, max_tokens=10)]
    engine.load(qwen, expert_slots=9, policy="lfuda")
    assert all(pool.slots == 9 for pool in engine.loaded.pools)
    after_ids = {k: id(v) for k, v in tree_flatten(engine.loaded.model.parameters()) if ".experts." not in k}
    assert after_ids == dense
    engine.prompts.reset()
    assert [r.token for r in generate(engine, prompt, max_tokens=10)] == before
    metrics = engine.metrics()
    assert metrics["expert_slots"] == 9 and metrics["policy"] == "lfuda"
    assert metrics["misses"] > 0 and metrics["hit_rate"] is not None
    assert metrics["peak_rss_bytes"] == peak_rss_bytes() > 10 * 2**20
    assert metrics["mlx_active_memory_bytes"] > 0
    assert metrics["last_decode_tps"] > 0
    engine.unload()


def test_prompt_longer_than_the_context_is_refused(qwen):
    engine = EngineManager()
    engine.load(qwen)
    limit = engine.running.context_length
    with pytest.raises(EngineError, match=f"context of {limit} tokens"):
        next(generate(engine, [1] * (limit + 5), max_tokens=4))
    engine.unload()


def test_model_without_moe_layers_runs_fully_resident(build, capsys):
    path = build("qwen3")
    loaded = load_streaming(path, expert_slots=2)
    assert loaded.pools == []
    assert "no MoE layer" in capsys.readouterr().err
    stock, _ = mlx_load(str(path))
    prompt = prompt_tokens(vocab_size(path), n=20)
    assert greedy_tokens(loaded.model, prompt, 8) == greedy_tokens(stock, prompt, 8)


def test_index_maps_every_expert_to_its_bytes(build):
    path = build("qwen3_moe", quant="4bit", num_experts=8, top_k=2, shards=3)
    loaded = load_streaming(path, expert_slots=2)
    index = CheckpointIndex(path)
    assert len({f for f in (e.file for e in index.tensors.values())}) == 3
    from safetensors.numpy import load_file

    for module in loaded.layers:
        spans = module.layout
        assert {c.name for c in spans.components} >= {"gate_proj.weight", "up_proj.scales", "down_proj.biases"}
        for comp in spans.components:
            tensor = load_file(comp.file)[f"{spans.key}.{comp.name}"]
            offset, length = comp.span(5)
            with open(comp.file, "rb") as fh:
                fh.seek(offset)
                assert fh.read(length) == tensor[5].tobytes()
    loaded.store.close()


def test_stacked_experts_never_enter_memory(build):
    # ~200 MB of float32 experts, 10% of them resident.
    path = build("qwen3_moe", hidden_size=256, moe_intermediate_size=256, num_experts=64,
                 top_k=4, num_layers=4)
    index = CheckpointIndex(path)
    expert_bytes = sum(e.nbytes for k, e in index.tensors.items() if "switch_mlp" in k)
    dense_bytes = sum(e.nbytes for k, e in index.tensors.items() if "switch_mlp" not in k)
    assert expert_bytes >= 200e6
    mx.clear_cache()
    mx.reset_peak_memory()
    loaded = load_streaming(path, expert_slots=6)
    greedy_tokens(loaded.model, prompt_tokens(vocab_size(path), n=48), n=8)
    pool_bytes = sum(a.nbytes for p in loaded.pools for a in p.arrays.values())
    assert pool_bytes < 0.11 * expert_bytes
    assert mx.get_peak_memory() < dense_bytes + pool_bytes + 64 * 2**20
    loaded.store.close()


@pytest.mark.parametrize("damage,message", [
    ("missing_dir", "checkpoint directory not found"),
    ("no_config", "no config.json"),
    ("truncated", "truncated"),
    ("missing_experts", "switch_mlp.up_proj.weight"),
    ("bad_mode", "unsupported quantization mode 'ternary'"),
    ("zero_slots", "expert_slots must be"),
])
def test_bad_input_is_one_clear_line(build, tmp_path, damage, message):
    import shutil

    src = build("qwen3_moe", quant="4bit", num_experts=8, top_k=2)
    path = tmp_path / "ckpt"
    shutil.copytree(src, path)
    slots = 4
    if damage == "missing_dir":
        shutil.rmtree(path)
    elif damage == "no_config":
        (path / "config.json").unlink()
    elif damage == "truncated":
        shard = path / "model.safetensors"
        shard.write_bytes(shard.read_bytes()[:-100])
    elif damage == "missing_experts":
        from safetensors.numpy import load_file, save_file

        tensors = load_file(path / "model.safetensors")
        del tensors["model.layers.1.mlp.switch_mlp.up_proj.weight"]
        save_file(tensors, path / "model.safetensors", metadata={"format": "mlx"})
        index_file = path / "model.safetensors.index.json"
        if index_file.exists():
            index = json.loads(index_file.read_text())
            index["weight_map"].pop("model.layers.1.mlp.switch_mlp.up_proj.weight", None)
            index_file.write_text(json.dumps(index))
    elif damage == "bad_mode":
        config = json.loads((path / "config.json").read_text())
        config["quantization"]["mode"] = "ternary"
        (path / "config.json").write_text(json.dumps(config))
    elif damage == "zero_slots":
        slots = 0
    engine = EngineManager()
    with pytest.raises(EngineError) as err:
        engine.load(path, expert_slots=slots)
    text = str(err.value)
    assert message in text and "\n" not in text
    if damage not in ("zero_slots",):
        assert str(path) in text or "ckpt" in text
    if damage != "zero_slots":
        assert engine.state == "error" and engine.error == text


def test_interrupt_during_an_expert_read_leaves_no_half_filled_slot(qwen, monkeypatch):
    engine = EngineManager()
    engine.load(qwen, expert_slots=4)
    prompt = prompt_tokens(vocab_size(qwen), n=30)
    expected = [r.token for r in generate(engine, prompt, max_tokens=10)]
    store = engine.loaded.store
    real_read = store.read
    reads = []

    def flaky_read(jobs):
        reads.append(1)
        if len(reads) == 5:
            for _, _, buffers in jobs:  # half a read has landed when the interrupt comes
                for dest in buffers:
                    dest[: dest.size // 2] = 0xAB
            raise KeyboardInterrupt
        return real_read(jobs)

    monkeypatch.setattr(store, "read", flaky_read)
    engine.prompts.reset()
    with pytest.raises(KeyboardInterrupt):
        list(generate(engine, prompt, max_tokens=10))
    monkeypatch.setattr(store, "read", real_read)
    assert engine.bad_slots() == 0
    assert sum(p.counters.unplaced for p in engine.loaded.pools) == 0
    assert [r.token for r in generate(engine, prompt, max_tokens=10)] == expected
    engine.unload()


def test_trace_records_each_layers_routing_for_the_simulator(qwen, tmp_path):
    from llm_mlx_streaming.experts.simulate import simulate
    from llm_mlx_streaming.experts.traces import load_trace

    engine = EngineManager()
    engine.load(qwen, expert_slots=16)  # whole layers: tracing must still see every step
    trace = tmp_path / "trace.jsonl"
    prompt = prompt_tokens(vocab_size(qwen), n=20)
    generated = len(list(generate(engine, prompt, max_tokens=12, trace_path=trace)))
    (decode,) = load_trace(trace, phase="decode")
    assert decode.layers == len(engine.loaded.layers) and decode.experts == 16 and decode.top_k == 4
    # one-token model calls: the prompt's last token, then every generated token
    # (mlx-lm feeds each token it yields, to have the next ready)
    assert all(len(steps) == generated + 1 for steps in decode.layer_seqs)
    assert all(len(set(step)) == 4 for steps in decode.layer_seqs for step in steps)
    (prefill,) = load_trace(trace, phase="prefill")
    assert all(len(steps) >= 1 for steps in prefill.layer_seqs)
    rows = simulate(trace, [4, 8])
    assert rows[1]["belady"] >= rows[1]["hit_rate"]["lru"]
    engine.unload()


def test_buffer_cache_stays_bounded_over_a_long_session(qwen):
    engine = EngineManager()
    mx.set_cache_limit(2**45)  # unbounded, as MLX starts
    engine.load(qwen, expert_slots=5)
    limit = mx.set_cache_limit(2**45)  # returns the limit the engine set
    mx.set_cache_limit(limit)
    assert limit == engine.running.buffer_cache == 256 * 2**20  # the plan's reserve floor, when none is given
    engine.load(qwen, expert_slots=5, buffer_cache=2**20)  # a loaded model takes a new cap at once
    assert mx.set_cache_limit(2**20) == 2**20
    for seed in range(4):
        list(generate(engine, prompt_tokens(vocab_size(qwen), n=200, seed=seed), max_tokens=4))
        assert mx.get_cache_memory() <= 2**20
    engine.unload()


def test_the_engine_gives_freed_memory_back_once_nothing_is_queued(qwen):
    """A prefill frees activation-sized buffers; with nothing queued after it the engine
    thread hands them (and malloc's free pages) back, so an idle engine keeps none."""
    engine = EngineManager()
    engine.load(qwen, expert_slots=5, buffer_cache=2**30)
    out = list(generate(engine, prompt_tokens(vocab_size(qwen), n=200), max_tokens=4))  # held: none freed here
    assert mx.get_peak_memory() > mx.get_active_memory() + 2**20  # the prefill's buffers were freed
    deadline = time.monotonic() + 30
    while mx.get_cache_memory():
        assert time.monotonic() < deadline, "the engine kept its freed buffers"
        time.sleep(0.01)
    assert out
    engine.unload()


def test_a_suspended_generation_blocks_no_other_caller(qwen):
    """A stream that its reader stops reading (not closed, still referenced) must not
    hold the engine: another thread's generation runs to the end meanwhile."""
    engine = EngineManager()
    engine.load(qwen, expert_slots=5)
    prompt = prompt_tokens(vocab_size(qwen), n=20)
    expected = [r.token for r in generate(engine, prompt, max_tokens=8)]
    suspended = generate(engine, prompt, max_tokens=8)
    next(suspended)
    other = {}
    worker = threading.Thread(target=lambda: other.update(tokens=[r.token for r in generate(engine, prompt, max_tokens=8)]))
    worker.start()
    worker.join(timeout=60)
    assert not worker.is_alive(), "the suspended generation blocked the engine"
    assert other["tokens"] == expected
    assert [expected[0]] + [r.token for r in suspended] == expected  # and it can still be read
    assert engine.bad_slots() == 0
    engine.unload()


def test_a_generation_outlives_its_thread(qwen):
    """A generation handed on by a thread that has exited is not cut off by a later
    thread (thread ids are reused by the OS)."""
    engine = EngineManager()
    engine.load(qwen, expert_slots=5)
    prompt = prompt_tokens(vocab_size(qwen), n=20)
    handed = {}

    def start():
        handed["gen"] = generate(engine, prompt, max_tokens=8)
        next(handed["gen"])

    for _ in range(3):  # the later threads are likely to get the first one's id
        t = threading.Thread(target=start)
        t.start()
        t.join()
        first = handed["gen"]
        later = threading.Thread(target=lambda: list(generate(engine, prompt, max_tokens=4)))
        later.start()
        later.join()
        assert len([first.tokens[0]] + [r.token for r in first]) == 8
    engine.unload()


def test_a_closed_or_dropped_generation_stops_at_the_next_token(qwen):
    """Each generation's third step waits until its handle is closed (or dropped and
    collected): the engine must stop at the step after."""
    import gc

    engine = EngineManager()
    engine.load(qwen, expert_slots=5)
    prompt = prompt_tokens(vocab_size(qwen), n=20)
    steps, channels = [], []

    def count(tokens, logits):
        steps.append(1)
        if len(steps) == 3:  # mlx-lm samples one token ahead of the one it hands out
            deadline = time.monotonic() + 60
            while not (channels and channels[-1].cancel.is_set()):
                assert time.monotonic() < deadline, "the handle was never let go"
                time.sleep(0.001)
        return logits

    for drop in (False, True):
        steps.clear()
        gen = generate(engine, prompt, max_tokens=200, logits_processors=[count])
        channels.append(gen.channel)
        next(gen)
        if drop:
            del gen  # garbage-collected: the engine notices at the next token
            gc.collect()
        else:
            gen.close()
        assert channels[-1].finished.wait(60)
        assert len(steps) <= 4, drop  # the step that waited, at most one more
    after = generate(engine, prompt, max_tokens=3)
    assert len(list(after)) == 3
    held = engine.prompts.conversations()[-1][0]
    assert held == prompt + after.tokens[:len(held) - len(prompt)]
    assert engine.bad_slots() == 0
    engine.unload()


def test_stopping_the_engine_thread_cancels_its_jobs_and_leaves_it_at_rest():
    """What runs at exit (engine/worker.py): the running job is cancelled, a queued one
    never runs, a later one is refused, and stop returns once the thread waits idle."""
    from llm_mlx_streaming.engine import worker
    from llm_mlx_streaming.engine.generation import Cancelled, Generation

    thread = worker._EngineThread()  # its own, so the process's engine thread goes on
    began, ran = threading.Event(), []

    def endless(out):  # a generation that stops only when cancelled
        began.set()
        while True:
            out.check_cancelled()
            time.sleep(0.001)

    running, queued, late = Generation(), Generation(), Generation()
    thread.submit(lambda: endless(running.channel), running.channel, None)
    thread.submit(lambda: ran.append("queued"), queued.channel, None)
    assert began.wait(60)
    thread.stop(timeout=60)
    assert thread.idle and running.channel.finished.is_set() and ran == []
    thread.submit(lambda: ran.append("late"), late.channel, None)
    with pytest.raises(Cancelled):
        late.wait_started()
    assert ran == []


@pytest.mark.parametrize("path", ["alone", "batched", "speculative"])
def test_a_cancelled_request_leaves_its_prefill_at_the_next_chunk(qwen, monkeypatch, path):
    """Every path that prefills (stream_generate's, the batch's, speculation's) stops
    between chunks once its request is cancelled (issue 50), so an exit or a client that
    has gone never waits for the rest of a long prefill (25 chunks here): cancelled as its
    first progress is reported, it reports no other, not even its first token's."""
    from llm_mlx_streaming.activity import ACTIVITY
    from llm_mlx_streaming.engine import worker
    from llm_mlx_streaming.engine.generation import Cancelled
    from llm_mlx_streaming.engine.request import Request

    engine = EngineManager()
    engine.load(qwen, expert_slots=4)
    how = {"alone": {}, "batched": {"max_batch": 4}, "speculative": {"k": 2}}[path]
    request = Request(prompt=prompt_tokens(vocab_size(qwen), n=400, seed=1), max_tokens=4, prefill_step=16, **how)
    reported, handles, prefilled = [], [], ACTIVITY.prefilled

    def cancelled_at_first(flight, done):  # on the engine thread, as the chunk ends
        reported.append(done)
        handles[0].cancel()
        prefilled(flight, done)

    monkeypatch.setattr(ACTIVITY, "prefilled", cancelled_at_first)
    go = threading.Event()
    worker.submit(lambda out: go.wait(30))  # holds the engine until the handle is known
    handles.append(engine.run(None, request))
    go.set()
    with pytest.raises(Cancelled):
        list(handles[0])
    handles[0].close(timeout=60)
    assert handles[0].channel.finished.is_set()
    assert len(reported) == 1 and reported[0] < len(request.prompt), reported  # not at its first token
    assert engine.bad_slots() == 0
    engine.unload()
