"""The bundled demo model writes English, streams exactly, and routes with locality.

It is the trained checkpoint in llm_mlx_streaming/checkpoints/demo/ (docs/demo-model.md),
served by `llm -m mlx-stream` with 8 slots for its 16 experts.
"""

import json
import re
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors
from mlx_lm.utils import load_model

from exactness import greedy_tokens, logits_trace
from llm_mlx_streaming.checkpoints.default import SHIPPED
from llm_mlx_streaming.engine.loading import load_streaming
from llm_mlx_streaming.experts.simulate import simulate
from llm_mlx_streaming.experts.traces import bundled_traces, load_trace
from llm_mlx_streaming.options.knobs import BUNDLED_REPETITION_PENALTY, REPETITION_CONTEXT
from llm_mlx_streaming.options.settings import Options
from llm_mlx_streaming.reply.build import repetition_processors
from llm_mlx_streaming.options.run_config import repetition_penalty
from plugin_support import LlmEnv, assert_ok

DATA = Path(__file__).parent / "data"
PROMPTS = ("Once upon a time", "The Python standard library", "A list is")
FUNCTION_WORDS = {"the", "of", "to", "a", "an", "and", "is", "in", "that", "for", "it", "be"}
TOKENS = 60


@pytest.fixture(scope="module")
def corpus_words() -> set[str]:
    return set((DATA / "demo-corpus-words.txt").read_text().split())


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """{prompt: stdout} of `llm -m mlx-stream PROMPT` on a fresh user dir (the bundled
    default, copied out of the package on first use), greedy, 60 tokens."""
    user_dir = tmp_path_factory.mktemp("llm")
    mp = pytest.MonkeyPatch()
    mp.setenv("LLM_USER_PATH", str(user_dir))
    try:
        env = LlmEnv(user_dir, SHIPPED)
        out = {p: assert_ok(env.run("-m", "mlx-stream", "-o", "max_tokens", str(TOKENS), p)).stdout
               for p in PROMPTS}
        turns = env.turns()
    finally:
        mp.undo()
    assert [t["stats"]["expert_slots"] for t in turns] == [8] * len(PROMPTS)
    return out


def words(text: str) -> list[str]:
    return [w.lower() for w in re.findall(r"[A-Za-z]+", text)]


def test_the_bundled_default_writes_words_of_its_corpus(served, corpus_words):
    for prompt, text in served.items():
        found = words(text)
        assert len(found) >= 20, (prompt, text)  # 60 tokens of prose, not punctuation
        known = sum(w in corpus_words for w in found) / len(found)
        assert known >= 0.8, (prompt, known, text)
        assert FUNCTION_WORDS & set(found), (prompt, text)
        assert len(set(found)) >= 15, (prompt, text)  # the default penalty keeps it from looping


def test_random_words_fail_the_vocabulary_check(corpus_words):
    """The check above can fail: letters in random order are mostly not corpus words."""
    rng = np.random.default_rng(0)
    fake = ["".join(rng.choice(list("etaoinshrdlu"), size=rng.integers(3, 8))) for _ in range(200)]
    assert sum(w in corpus_words for w in fake) / len(fake) < 0.5


def penalized_greedy(model, prompt, n=TOKENS, penalty=BUNDLED_REPETITION_PENALTY):
    """mlx-lm's own loop, greedy, with its repetition penalty as the plugin applies it."""
    processors = make_logits_processors(repetition_penalty=penalty,
                                        repetition_context_size=REPETITION_CONTEXT)
    steps = generate_step(mx.array(prompt), model, max_tokens=n, logits_processors=processors)
    return [token for token, _ in steps]


def test_demo_model_streams_bit_identically_at_every_pool_size(served):
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tokenizer = load_tokenizer(SHIPPED)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[0]}],
                                           add_generation_prompt=True)
    stock, config = load_model(SHIPPED)
    expected = penalized_greedy(stock, prompt)
    ref_prefill, ref_decode = logits_trace(stock, prompt, expected)
    # What llm printed (8 slots) is stock mlx-lm's text, up to end-of-text.
    end = expected.index(tokenizer.eos_token_id) if tokenizer.eos_token_id in expected else TOKENS
    assert served[PROMPTS[0]].strip() == tokenizer.decode(expected[:end]).strip()
    plain = greedy_tokens(stock, prompt, TOKENS)
    assert plain != expected  # the penalty is on by default for the bundled demo

    experts = config["num_experts"]
    for slots in (experts, experts // 2, experts // 4, config["num_experts_per_tok"]):
        loaded = load_streaming(SHIPPED, expert_slots=slots, policy="lru")
        try:
            assert greedy_tokens(loaded.model, prompt, TOKENS) == plain, f"{slots} slots"
            tokens = penalized_greedy(loaded.model, prompt)
            prefill, decode = logits_trace(loaded.model, prompt, tokens)
            assert tokens == expected, f"{slots} slots"
            for step, (got, want) in enumerate(zip(decode, ref_decode)):
                assert np.array_equal(got, want), f"{slots} slots: decode step {step}"
            np.testing.assert_allclose(prefill, ref_prefill, rtol=1e-4, atol=1e-4)
            if slots < experts:
                assert sum(pool.counters.misses for pool in loaded.pools) > experts
            assert sum(pool.bad_slots() for pool in loaded.pools) == 0
        finally:
            loaded.store.close()


def test_llm_c_prefills_only_the_new_message(tmp_path, monkeypatch):
    """The completion-style template renders a conversation as the last prompt plus
    the reply's own tokens, so `llm -c` in a new process reuses all of the first turn."""
    monkeypatch.setenv("LLM_USER_PATH", str(tmp_path))
    env = LlmEnv(tmp_path, SHIPPED)
    assert_ok(env.run("-m", "mlx-stream", "-o", "max_tokens", "12", "The os module"))
    assert_ok(env.run("-c", "-o", "max_tokens", "12", "The sys module"))
    first, second = [t["stats"] for t in env.turns()]
    assert first["generated_tokens"] > 0
    assert second["reused_tokens"] == first["prompt_tokens"] + first["generated_tokens"]
    assert second["prompt_tokens"] > second["reused_tokens"]


def test_the_shipped_hashes_are_the_shipped_files():
    """tools/train_demo.py export writes them with the files; a demo changed without them fails here."""
    from llm_mlx_streaming.checkpoints.default import SHIPPED_HASHES
    from llm_mlx_streaming.checkpoints.integrity import hashes

    assert json.loads(SHIPPED_HASHES.read_text()) == hashes(SHIPPED)


def test_verify_checks_the_bundled_demo_against_its_shipped_hashes(tmp_path, monkeypatch):
    monkeypatch.setenv("LLM_USER_PATH", str(tmp_path))
    env = LlmEnv(tmp_path, SHIPPED)
    assert assert_ok(env.run("mlxs", "verify")).stdout == "ok: 6 files match the hashes shipped with the package\n"
    copy = next(tmp_path.glob("mlx-streaming/tiny-moe-*"))
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one bit of an expert: fluent nonsense, found only by its hash
    weights.write_bytes(bytes(data))
    bad = env.run("mlxs", "verify", "tiny-moe")
    assert bad.exit_code == 1 and bad.stdout.startswith(f"{weights}: sha256 ")
    assert bad.stderr.strip() == ("Error: 1 of the 6 files of mlx-stream/tiny-moe do not match the hashes shipped "
                                  "with the package")


def test_the_repetition_penalty_is_on_for_the_bundled_demo_only():
    assert repetition_penalty(Options(), "tiny-moe") == BUNDLED_REPETITION_PENALTY
    assert repetition_penalty(Options(), "small") == 1.0
    assert repetition_penalty(Options(repetition_penalty=1), "tiny-moe") == 1.0
    assert repetition_penalty(Options(repetition_penalty=1.1), "small") == 1.1
    assert len(repetition_processors(BUNDLED_REPETITION_PENALTY)) == 1 and repetition_processors(1.0) == []


def test_repetition_penalty_1_gives_plain_greedy(tmp_path, monkeypatch):
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    monkeypatch.setenv("LLM_USER_PATH", str(tmp_path / "llm"))
    out = assert_ok(LlmEnv(tmp_path / "llm", SHIPPED).run(
        "-m", "mlx-stream", "-o", "max_tokens", "20", "-o", "repetition_penalty", "1", PROMPTS[1])).stdout
    tokenizer = load_tokenizer(SHIPPED)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[1]}],
                                           add_generation_prompt=True)
    stock, _ = load_model(SHIPPED)
    assert out.strip() == tokenizer.decode(greedy_tokens(stock, prompt, 20)).strip()


# -- its recorded routing trace ------------------------------------------------------


TRACE = bundled_traces()["demo"]


def test_the_recorded_trace_is_of_the_shipped_model():
    config = json.loads((SHIPPED / "config.json").read_text())
    seqs = load_trace(TRACE)
    assert len(seqs) >= 4 and sum(s.steps for s in seqs) >= 400
    for seq in seqs:
        assert (seq.layers, seq.experts, seq.top_k) == (
            config["num_hidden_layers"], config["num_experts"], config["num_experts_per_tok"])


def test_demo_routing_has_locality_that_policies_can_use():
    """At a quarter of the experts, LRU hits clearly more often than the 25% that
    random routing gives, and Belady's optimum is well above LRU."""
    rows = {row["slots"]: row for row in simulate(TRACE, [4, 8, 12])}
    quarter = rows[4]
    assert quarter["hit_rate"]["lru"] > 0.30
    assert quarter["belady"] > quarter["hit_rate"]["lru"] + 0.1
    for row in rows.values():
        assert all(row["belady"] >= rate for rate in row["hit_rate"].values())
    assert rows[4]["hit_rate"]["lru"] < rows[8]["hit_rate"]["lru"] < rows[12]["hit_rate"]["lru"]
