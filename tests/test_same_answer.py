"""Same request, same answer: a cache hit never changes what a processor or a seed sees.

The bundled default decodes with a repetition penalty (a logits processor), so every
warm path (the in-process KV reused by a repeated prompt, `llm chat`, `llm -c` from
the conversation cache on disk, a server follow-up) must give the cold run's text.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors
from mlx_lm.tokenizer_utils import load as load_tokenizer
from mlx_lm.utils import load_model

from llm_mlx_streaming.checkpoints.default import SHIPPED
from llm_mlx_streaming.engine.manager import get_manager
from llm_mlx_streaming.options.knobs import BUNDLED_REPETITION_PENALTY, REPETITION_CONTEXT
from plugin_support import LlmEnv, assert_ok

PROMPT = "The dict type is a mapping that stores keys and values, and the list type is"
TOKENS = "24"


def forget_kv() -> None:
    """What a new process starts with: no KV cache kept in memory."""
    prompts = get_manager().prompts
    if prompts is not None:
        prompts.reset()


@pytest.fixture
def demo(tmp_path, monkeypatch):
    monkeypatch.setenv("LLM_USER_PATH", str(tmp_path))
    forget_kv()
    return LlmEnv(tmp_path, SHIPPED)


def run(env, *args, input=None) -> str:
    return assert_ok(env.run(*args, input=input)).stdout


def test_a_repeated_prompt_gives_stock_mlx_lm_penalised_greedy_text_every_time(demo):
    outs = [run(demo, "-m", "mlx-stream", "-o", "max_tokens", TOKENS, PROMPT) for _ in range(3)]
    assert [t["stats"]["reused_tokens"] > 0 for t in demo.turns()] == [False, True, True]
    tokenizer = load_tokenizer(SHIPPED)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    stock, _ = load_model(SHIPPED)
    processors = make_logits_processors(repetition_penalty=BUNDLED_REPETITION_PENALTY,
                                        repetition_context_size=REPETITION_CONTEXT)
    tokens = []
    for token, _ in generate_step(mx.array(prompt), stock, max_tokens=int(TOKENS), logits_processors=processors):
        if token in tokenizer.eos_token_ids:
            break
        tokens.append(token)
    assert outs == [outs[0]] * 3
    assert outs[0].strip() == tokenizer.decode(tokens).strip()


def test_seeded_sampling_gives_the_same_text_on_every_run(demo):
    args = ("-m", "mlx-stream", "-o", "max_tokens", TOKENS, "-o", "temperature", "0.5", "-o", "seed", "999", PROMPT)
    outs = [run(demo, *args) for _ in range(3)]
    assert demo.turns()[-1]["stats"]["reused_tokens"] > 0
    assert outs == [outs[0]] * 3


def test_llm_c_from_the_disk_cache_equals_the_uncached_continuation(demo):
    run(demo, "-m", "mlx-stream", "-o", "max_tokens", "12", "The os module")
    forget_kv()  # the next turn's prefix comes from the conversation cache on disk
    warm = run(demo, "-c", "-o", "max_tokens", TOKENS, PROMPT)
    assert demo.turns()[-1]["stats"]["disk_cache_tokens"] > 0

    cold_env = LlmEnv(demo.user_dir / "cold", SHIPPED)
    cold_env.write_settings(conversation_cache=False)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LLM_USER_PATH", str(cold_env.user_dir))
        forget_kv()
        run(cold_env, "-m", "mlx-stream", "-o", "max_tokens", "12", "The os module")
        forget_kv()
        cold = run(cold_env, "-c", "-o", "max_tokens", TOKENS, PROMPT)
        assert cold_env.turns()[-1]["stats"]["reused_tokens"] == 0
    assert warm == cold


def test_llm_chat_turns_that_reuse_the_kv_give_the_cold_text(demo):
    out = run(demo, "chat", "-m", "mlx-stream", "-o", "max_tokens", TOKENS, input=f"The os module\n{PROMPT}\nquit\n")
    chat_turns = demo.turns()
    assert chat_turns[1]["stats"]["reused_tokens"] > 0
    demo.write_settings(conversation_cache=False)
    forget_kv()
    run(demo, "-m", "mlx-stream", "-o", "max_tokens", TOKENS, "The os module")
    forget_kv()
    cold = run(demo, "-c", "-o", "max_tokens", TOKENS, PROMPT)
    assert demo.turns()[-1]["stats"]["reused_tokens"] == 0
    assert cold.strip() in out


def test_k_3_on_the_bundled_default_drafts_under_its_penalty_and_gives_k_0s_text(demo):
    plain = run(demo, "-m", "mlx-stream", "-o", "max_tokens", TOKENS, PROMPT)
    drafted = run(demo, "-m", "mlx-stream", "-o", "max_tokens", TOKENS, "-o", "k", "3", PROMPT)
    stats = demo.turns()[-1]["stats"]
    assert stats["speculation_off"] is None and stats["draft_tokens"] > 0
    assert stats["acceptance_rate"] is not None
    assert drafted == plain
