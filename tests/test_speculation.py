"""Speculative decoding: drafters, the verify pass, rollback, and exactness against k=0."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache, make_prompt_cache
from mlx_lm.sample_utils import make_sampler
from mlx_lm.utils import load_model

from exactness import prompt_tokens, vocab_size
from fixtures.factory import ARCHITECTURES, supported_quants
from fixtures.scripted import ScriptedDrafter
from llm_mlx_streaming.engine.manager import EngineManager
from llm_mlx_streaming.engine.provider import EngineError
from llm_mlx_streaming.engine.request import Injected, Request, Sampling
from llm_mlx_streaming.speculation import heads
from llm_mlx_streaming.speculation.drafter import DraftContext, DraftError, Drafter
from llm_mlx_streaming.speculation.kinds import make_drafter
from llm_mlx_streaming.speculation.ngram import NgramDrafter
from llm_mlx_streaming.speculation.sampling import TargetSampler, choose

EXPERTS, TOP_K, K = 16, 4, 3
MOE_ARCHS = [a for a in ARCHITECTURES if a != "qwen3"]
# every MoE architecture x quantization
CASES = [(arch, quant) for arch in MOE_ARCHS for quant in supported_quants(arch)]
TOKENS = 20


def _prompt(path):
    head = prompt_tokens(vocab_size(path), n=14)
    return head + head[:6]  # a repeat, so n-gram lookup has something to find


def _engine(path, slots):
    engine = EngineManager()
    engine.load(path, expert_slots=slots)
    return engine


def _generate(engine, prompt, drafter=None, **request):
    generation = engine.run(None, Request(prompt=list(prompt), max_tokens=request.pop("max_tokens", TOKENS),
                                          injected=Injected(drafter=drafter), **request))
    return [r.token for r in generation], generation.stats


@pytest.mark.parametrize("arch,quant", CASES)
def test_greedy_speculation_equals_plain_decoding(build, arch, quant):
    """k > 0 emits what k = 0 emits, whatever the drafts, at a pool smaller than a
    verify pass's union of experts (its calls run expert-major) and at full size."""
    path = build(arch, quant=quant, num_experts=EXPERTS, top_k=TOP_K)
    prompt = _prompt(path)
    # fewer slots than a pass's union for every case; every expert resident for one
    # quantization per architecture
    for slots in (TOP_K + 2,) if quant != supported_quants(arch)[0] else (EXPERTS, TOP_K + 2):
        engine = _engine(path, slots)
        widest = []
        for module in engine.loaded.layers:
            module.observer = lambda layer, needed, single: widest.append(len(needed))
        plain, stats = _generate(engine, prompt, k=0)
        assert stats["k"] == 0 and stats["draft_tokens"] == 0
        expected = prompt + plain
        V = vocab_size(path)
        for drafter, k in ((ScriptedDrafter(expected, V), K), (ScriptedDrafter(expected, V, wrong=True), K),
                           (NgramDrafter(), 4)):
            widest.clear()
            tokens, stats = _generate(engine, prompt, k=k, drafter=drafter)
            assert tokens == plain, (slots, drafter.name)
            assert stats["unplaced"] == 0
            if drafter.name == "oracle" and arch != "gpt_oss":
                assert stats["accepted_tokens"] == stats["draft_tokens"] > 0
                assert stats["tokens_per_pass"] > 2
                if slots < EXPERTS:
                    assert max(widest) > slots, "a verify pass must need more experts than slots"
            if drafter.name == "adversary" and arch != "gpt_oss":
                assert stats["draft_tokens"] > 0 and stats["accepted_tokens"] == 0
        assert sum(pool.bad_slots() for pool in engine.loaded.pools) == 0
        engine.unload()


def test_a_verify_pass_gives_stock_mlx_lm_logits_bit_for_bit(build):
    """The streamed layers over several positions (routes split over two streams, or run
    expert-major when the pass needs more experts than slots) compute what mlx-lm does."""
    path = build("qwen3_moe", quant="4bit", num_experts=EXPERTS, top_k=TOP_K)
    stock, _ = load_model(path)
    prompt = _prompt(path)
    stock_cache = make_prompt_cache(stock)
    stock(mx.array(prompt)[None], cache=stock_cache)
    want = np.array(stock(mx.array([[5, 9, 11, 2]]), cache=stock_cache))
    for slots in (EXPERTS, TOP_K + 2):
        engine = _engine(path, slots)
        cache = make_prompt_cache(engine.loaded.model)
        engine.loaded.model(mx.array(prompt)[None], cache=cache)
        got = np.array(engine.loaded.model(mx.array([[5, 9, 11, 2]]), cache=cache))
        assert np.array_equal(got, want), slots
        engine.unload()


def test_quantized_kv_cache_and_short_prefill_chunks_stay_exact(build):
    """A quantized KV cache (switched to at the same step as plain decoding) and a prompt
    prefilled in several chunks: speculation still emits what plain decoding does."""
    from llm_mlx_streaming.engine.kv import KVSpec

    path = build("qwen3_moe", quant="4bit", num_experts=EXPERTS, top_k=TOP_K, head_dim=64)
    engine = _engine(path, TOP_K + 2)
    prompt = _prompt(path)
    layout = dict(kv=KVSpec(bits=8, group_size=32, start=24), prefill_step=8)
    plain, _ = _generate(engine, prompt, k=0, **layout)
    engine.prompts.reset()
    V = vocab_size(path)
    for drafter in (ScriptedDrafter(prompt + plain, V), ScriptedDrafter(prompt + plain, V, wrong=True)):
        engine.prompts.reset()
        tokens, stats = _generate(engine, prompt, k=K, drafter=drafter, **layout)
        assert tokens == plain and stats["kv_bits"] == 8 and stats["prefill_step"] == 8
        assert all(isinstance(c, QuantizedKVCache) for c in engine.prompts.conversations()[-1][1])
    engine.unload()


class _ScriptedDraftModel:
    """A stand-in draft model for mlx-lm's speculative_generate_step: its greedy token at
    each position is the recorded continuation (or a wrong token), like ScriptedDrafter."""

    def __init__(self, expected, vocab, wrong):
        self.expected, self.vocab, self.wrong = expected, vocab, wrong
        self.layers = [None]

    def make_cache(self):
        return [KVCache()]

    def __call__(self, inputs, cache):
        start, n = cache[0].offset, inputs.shape[1]
        cache[0].update_and_fetch(mx.zeros((1, 1, n, 1)), mx.zeros((1, 1, n, 1)))
        logits = np.zeros((1, n, self.vocab), dtype=np.float32)
        for i in range(n):
            nxt = start + i + 1
            token = self.expected[nxt] if nxt < len(self.expected) else 0
            logits[0, i, (token + self.wrong) % self.vocab] = 1.0
        return mx.array(logits)


def test_deepseek_v3_verify_passes_match_mlx_lm_speculative_decoding(build):
    """mlx-lm's MLA attention takes another path for several positions than for one
    (docs/architecture.md), so a verify pass rounds differently from a decode step. The
    tokens still equal plain decoding's here; they also equal mlx-lm's own
    speculative_generate_step driven by the same drafts."""
    from mlx_lm.generate import speculative_generate_step

    path = build("deepseek_v3", num_experts=EXPERTS, top_k=TOP_K)
    stock, config = load_model(path)
    prompt, V = _prompt(path), config["vocab_size"]
    engine = _engine(path, TOP_K + 2)
    plain, _ = _generate(engine, prompt, k=0)
    for wrong in (False, True):
        draft = _ScriptedDraftModel(prompt + plain, V, wrong)
        theirs = [t for t, _, _ in speculative_generate_step(
            mx.array(prompt), stock, draft, num_draft_tokens=K, max_tokens=TOKENS)]
        ours, _ = _generate(engine, prompt, k=K, drafter=ScriptedDrafter(prompt + plain, V, wrong=wrong))
        assert ours == theirs == plain
    engine.unload()


def test_state_caches_of_unknown_layers_decode_without_drafts(build, monkeypatch):
    # A recurrent layer this module cannot checkpoint: no drafts, and the figures say so.
    from llm_mlx_streaming.speculation import rollback

    monkeypatch.setattr(rollback, "_linear_layers", lambda model: [])
    path = build("qwen3_next", num_experts=EXPERTS, top_k=TOP_K)
    engine = _engine(path, EXPERTS)
    prompt = _prompt(path)
    plain, _ = _generate(engine, prompt, k=0)
    tokens, stats = _generate(engine, prompt, k=K, drafter=ScriptedDrafter(prompt + plain, vocab_size(path)))
    assert tokens == plain and stats["draft_tokens"] == 0
    assert stats["speculation_off"] == "state cache cannot be rolled back"
    engine.unload()


def test_sliding_window_cache_stops_drafting_once_it_wraps(build):
    # gpt_oss's sliding-window layers (window 16 here) cannot be trimmed after wrapping.
    path = build("gpt_oss", num_experts=EXPERTS, top_k=TOP_K)
    engine = _engine(path, EXPERTS)
    prompt = prompt_tokens(vocab_size(path), n=6)
    plain, _ = _generate(engine, prompt, k=0)
    tokens, stats = _generate(engine, prompt, k=K, drafter=ScriptedDrafter(prompt + plain, vocab_size(path)))
    assert tokens == plain
    assert stats["accepted_tokens"] > 0
    assert stats["speculation_off"] == "sliding-window cache full"
    engine.unload()


def _reference_cache(model, fed):
    """The cache plain decoding leaves after `fed`: generate_step's prefill of the prompt
    (one chunk here) and then one token per step."""
    cache = make_prompt_cache(model)
    for chunk in fed:
        model(mx.array(chunk)[None], cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def _assert_caches_equal(got, want):
    for a, b in zip(got, want):
        assert type(a) is type(b)
        if isinstance(a, ArraysCache):
            assert all(np.array_equal(np.array(x), np.array(y)) for x, y in zip(a.cache, b.cache))
        else:
            assert isinstance(a, KVCache) and a.offset == b.offset
            for x, y in ((a.keys, b.keys), (a.values, b.values)):
                assert np.array_equal(np.array(x[..., : a.offset, :]), np.array(y[..., : b.offset, :]))


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_moe"])
def test_rollback_leaves_the_cache_plain_decoding_leaves(build, arch):
    """After many rejected drafts the cache (linear-attention state included) equals,
    bit for bit, plain decoding's; the next turn reuses it and still decodes exactly."""
    path = build(arch, num_experts=EXPERTS, top_k=TOP_K)
    prompt = _prompt(path)
    engine = _engine(path, TOP_K + 2)
    plain, _ = _generate(engine, prompt, k=0)
    engine.prompts.reset()
    tokens, stats = _generate(engine, prompt, k=K, drafter=ScriptedDrafter(prompt + plain, vocab_size(path), wrong=True))
    assert tokens == plain and stats["draft_tokens"] >= 2 * TOKENS and stats["accepted_tokens"] == 0
    fed, cache = engine.prompts.conversations()[-1]
    assert fed == prompt + plain[:-1]  # the last token is emitted, not yet fed
    stock, _ = load_model(path)
    want = _reference_cache(stock, [prompt[:-1], *[[t] for t in fed[len(prompt) - 1:]]])
    _assert_caches_equal(cache, want)

    follow = prompt + plain + prompt_tokens(vocab_size(path), n=5, seed=4)
    second, stats = _generate(engine, follow, k=K, drafter=ScriptedDrafter(follow, vocab_size(path), wrong=True))
    assert stats["reused_tokens"] == len(fed)
    fresh = _engine(path, TOP_K + 2)
    assert _generate(fresh, follow, k=0)[0] == second
    engine.unload(), fresh.unload()


def test_forward_with_hidden_gives_the_models_own_logits(build):
    for arch, kwargs in (("qwen3_moe", {}), ("qwen3_moe", {"tie_word_embeddings": True}), ("deepseek_v3", {})):
        model, config = load_model(build(arch, **kwargs))
        inputs = mx.array([[1, 5, 9, 2]])
        want = np.array(model(inputs, cache=make_prompt_cache(model)))
        logits, hidden = heads.forward(model, inputs, make_prompt_cache(model), want_hidden=True)
        assert hidden.shape == (1, 4, config["hidden_size"])
        assert np.array_equal(np.array(logits), want)
        plain, none = heads.forward(model, inputs, make_prompt_cache(model))
        assert none is None and np.array_equal(np.array(plain), want)


def _chi_square(counts, probs) -> float:
    expected = np.asarray(probs) * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("draft", [0, 2, 3])
def test_speculative_sampling_draws_from_the_target_not_the_draft(draft):
    """Whatever token is drafted, the first emitted token follows the target's p."""
    p = np.array([0.5, 0.3, 0.15, 0.05])
    logprobs = mx.log(mx.array(np.stack([p, p]).astype(np.float32)))
    target, sampler = TargetSampler(1.0), make_sampler(1.0)
    mx.random.seed(7)
    draws = 2000
    counts = np.zeros(4)
    accepted = 0
    for _ in range(draws):
        n, token = choose(logprobs, [draft], target, sampler)
        counts[draft if n else token] += 1
        accepted += n
    assert _chi_square(counts, p) < 16.27  # chi-square, 3 degrees of freedom, p = 0.001
    assert abs(accepted / draws - p[draft]) < 0.03  # a draft is kept with probability p(draft)


def test_sampling_filters_shape_the_target_distribution():
    # top_k 2 at temperature 0.5: only tokens 0 and 1, in the ratio (0.5/0.3)**2.
    p = np.array([0.5, 0.3, 0.15, 0.05])
    probs = np.array(TargetSampler(0.5, top_k=2).probs(mx.log(mx.array(p[None].astype(np.float32)))))[0]
    ratio = (0.5 / 0.3) ** 2
    np.testing.assert_allclose(probs, [ratio / (1 + ratio), 1 / (1 + ratio), 0, 0], rtol=1e-5)


def test_sampled_generation_runs_and_reports(build):
    path = build("qwen3_moe", num_experts=EXPERTS, top_k=TOP_K)
    engine = _engine(path, TOP_K + 2)
    prompt = _prompt(path)
    tokens, stats = _generate(engine, prompt, k=K, sampling=Sampling(temperature=0.9, seed=3))
    again, _ = _generate(engine, prompt, k=K, sampling=Sampling(temperature=0.9, seed=3))
    assert tokens == again and len(tokens) == TOKENS  # a seed makes sampling repeatable
    assert stats["k"] == K and stats["draft"] == "ngram" and stats["verify_passes"] > 0
    engine.unload()


def test_k_auto_backs_off_from_failing_drafts_and_grows_on_good_ones(build):
    path = build("qwen3_moe", num_experts=EXPERTS, top_k=TOP_K)
    engine = _engine(path, EXPERTS)
    prompt = _prompt(path)
    plain, _ = _generate(engine, prompt, k=0, max_tokens=40)
    V = vocab_size(path)
    tokens, bad = _generate(engine, prompt, k="auto", drafter=ScriptedDrafter(prompt + plain, V, wrong=True), max_tokens=40)
    assert tokens == plain
    assert bad["k"] == "auto" and bad["draft_tokens"] == 1  # one failed draft: down to 0, and stays there
    tokens, good = _generate(engine, prompt, k="auto", drafter=ScriptedDrafter(prompt + plain, V), max_tokens=40)
    assert tokens == plain and good["acceptance_rate"] == 1.0 and good["tokens_per_pass"] > 4  # grew to 4
    engine.unload()


def test_ngram_drafter_continues_earlier_text():
    d = NgramDrafter()
    d.reset([1, 2, 3, 4, 5, 9, 2, 3])
    assert d.propose(3) == [4, 5, 9]  # "2 3" was followed by "4 5 9"
    d.accept([7], None)
    assert d.propose(2) == []  # "3 7" / "7" never occurred before
    d.accept([1, 2], None)
    assert d.propose(2) == [3, 4]  # "1 2" began the text
    d.accept([3, 7, 1, 2], None)
    assert d.propose(2) == [3, 7]  # the most recent earlier "7 1 2" wins
    assert isinstance(d, Drafter)


def test_stateful_logits_processors_decode_plainly_and_say_so(build):
    path = build("qwen3_moe", num_experts=EXPERTS, top_k=TOP_K)
    engine = _engine(path, EXPERTS)
    prompt = _prompt(path)
    ban = lambda tokens, logits: logits.at[:, 5].add(-1e9)  # noqa: E731
    plain, _ = _generate(engine, prompt, k=0, logits_processors=[ban])
    tokens, stats = _generate(engine, prompt, k=K, logits_processors=[ban])
    assert tokens == plain and stats["speculation_off"] == "stateful logits processor"
    assert stats["draft_tokens"] == 0
    engine.unload()


def test_a_repetition_penalty_is_applied_at_every_verified_position(build):
    """Greedy with a penalty: drafts are judged on logits penalised over the history up
    to their own position, so the text is exactly k 0's, and drafts are still made."""
    from mlx_lm.sample_utils import make_logits_processors

    from llm_mlx_streaming.processors import Stateless

    path = build("qwen3_moe", num_experts=EXPERTS, top_k=TOP_K)
    engine = _engine(path, EXPERTS)
    prompt = _prompt(path) * 3  # repeats for the ngram drafter to continue
    penalty = [Stateless(p) for p in make_logits_processors(repetition_penalty=4.0, repetition_context_size=20)]
    plain, _ = _generate(engine, prompt, k=0, logits_processors=penalty)
    unpenalised, _ = _generate(engine, prompt, k=0)
    engine.prompts.reset()
    tokens, stats = _generate(engine, prompt, k=K, logits_processors=penalty)
    assert plain != unpenalised  # the penalty changes the text, so the check below can fail
    assert tokens == plain and stats["speculation_off"] is None
    assert stats["draft_tokens"] > 0
    engine.unload()


def test_draft_model_drafts_and_keeps_its_cache_between_turns(build):
    path = build("qwen3_moe", num_experts=EXPERTS, top_k=TOP_K)
    engine = _engine(path, TOP_K + 2)
    prompt = _prompt(path)
    plain, _ = _generate(engine, prompt, k=0)
    # The target's own checkpoint as its draft model agrees with it everywhere.
    tokens, stats = _generate(engine, prompt, k=K, draft="self", draft_path=path)
    assert tokens == plain and stats["draft"] == "self" and stats["acceptance_rate"] == 1.0
    drafter = next(iter(engine.running.carried.drafters.values()))
    cached = len(drafter.seen)
    follow = prompt + plain + [7, 8, 9]
    _generate(engine, follow, k=K, draft="self", draft_path=path)
    assert next(iter(engine.running.carried.drafters.values())) is drafter and drafter.seen[:cached] == (prompt + plain)[:cached]
    engine.unload()


def _other_vocabulary(path, tmp_path):
    """A copy of checkpoint `path` whose tokenizer gives two tokens each other's ids."""
    import json
    import shutil

    other = tmp_path / "other-vocab"
    shutil.copytree(path, other)
    spec = json.loads((other / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = list(vocab)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(spec))
    return other


def test_bad_drafters_are_one_line_errors(build, tmp_path):
    path = build("qwen3_moe", num_experts=EXPERTS, top_k=TOP_K)
    other = _other_vocabulary(build("qwen3"), tmp_path)
    engine = _engine(path, EXPERTS)
    with pytest.raises(EngineError, match="does not share the vocabulary") as info:
        _generate(engine, _prompt(path), k=K, draft="small", draft_path=other)
    assert "'small'" in str(info.value) and path.name in str(info.value) and "\n" not in str(info.value)
    for k in (-1, "abc", 1.5, 33):
        with pytest.raises(EngineError, match="k must be"):
            _generate(engine, _prompt(path), k=k)
    model, _ = load_model(path)
    with pytest.raises(DraftError, match="unknown draft 'nosuch'"):
        make_drafter("nosuch", DraftContext(model=model, tokenizer=None))
    engine.unload()
