"""Long-context options through llm's real CLI: kv_bits, kv_group_size, kv_start,
prefill_step; their figures in response_json and `llm mlxs stats`; one-line errors."""

from __future__ import annotations

import json

import pytest

from plugin_support import _stock, assert_llm_option_error, assert_ok, assert_one_line_error


@pytest.fixture
def kv_env(llm_env, build):
    """llm_env with a model of head dimension 64 ('wide'), so 4- and 8-bit groups apply."""
    path = build("qwen3_moe", quant="4bit", num_experts=16, top_k=4, head_dim=64)
    settings = llm_env.read_settings()
    settings["models"]["wide"] = {"path": str(path), "expert_slots": 6}
    llm_env.write_settings(**settings)
    llm_env.wide = path
    return llm_env


def stock_text(path, prompt: str, max_tokens: int, **kv) -> str:
    from mlx_lm import generate

    model, tokenizer = _stock(str(path))
    tokens = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    return generate(model, tokenizer, tokens, max_tokens=max_tokens, **kv)


def test_kv_bits_option_matches_stock_mlx_lm_and_is_reported(kv_env):
    result = assert_ok(kv_env.run("-m", "mlx-stream/wide", "-o", "kv_bits", "4", "-o", "max_tokens", "16",
                                  "-o", "prefill_step", "256", "Tell me about tea"))
    expected = stock_text(kv_env.wide, "Tell me about tea", 16, kv_bits=4, kv_group_size=64, quantized_kv_start=0)
    assert result.stdout == expected + "\n"
    stats = kv_env.turns()[-1]["stats"]
    assert (stats["kv_bits"], stats["kv_group_size"], stats["kv_start"]) == (4, 64, 0)
    assert stats["kv_bytes"] > 0 and stats["ttft_seconds"] > 0 and stats["prefill_step"] == 256
    out = assert_ok(kv_env.run("mlxs", "stats")).stdout
    assert "KV cache" in out and "4-bit, groups of 64" in out and "first token" in out


def test_kv_settings_are_the_defaults_and_chat_reuses_the_quantized_cache(kv_env):
    assert_ok(kv_env.run("mlxs", "config", "kv_bits", "8"))
    assert_ok(kv_env.run("mlxs", "config", "kv_group_size", "32"))
    assert kv_env.read_settings()["kv_bits"] == 8
    assert_ok(kv_env.run("chat", "-m", "mlx-stream/wide", "-o", "max_tokens", "6",
                         input="hello there\nhow are you\nquit\n"))
    first, second = (t["stats"] for t in kv_env.turns())
    assert first["kv_bits"] == second["kv_bits"] == 8 and second["kv_group_size"] == 32
    assert second["reused_tokens"] == first["prompt_tokens"] + first["generated_tokens"]
    assert second["kv_bytes"] >= first["kv_bytes"] > 0


@pytest.mark.parametrize("value", ["5", "-1", "lots"])
def test_bad_kv_bits_are_one_line(kv_env, value):
    assert_llm_option_error(kv_env.run("-m", "mlx-stream/wide", "-o", "kv_bits", value, "hi"), "kv_bits")
    before = kv_env.settings_file.read_text()
    assert_one_line_error(kv_env.run("mlxs", "config", "--", "kv_bits", value), "kv_bits", repr(value))
    assert kv_env.settings_file.read_text() == before
    assert kv_env.turns() == []


def test_a_group_size_that_does_not_divide_the_head_dimension_is_one_line(kv_env):
    assert_one_line_error(
        kv_env.run("-m", "mlx-stream/wide", "-o", "kv_bits", "4", "-o", "kv_group_size", "128", "hi"),
        "kv_group_size 128 does not divide this model's head dimension 64",
    )
    assert_llm_option_error(kv_env.run("-m", "mlx-stream/wide", "-o", "kv_group_size", "48", "hi"), "kv_group_size")
    assert_llm_option_error(kv_env.run("-m", "mlx-stream/wide", "-o", "prefill_step", "many", "hi"), "prefill_step")
    assert kv_env.turns() == []


def test_plan_kv_bits_gives_the_pools_more_of_the_same_budget(kv_env):
    def plan(budget, *args):
        out = assert_ok(kv_env.run("mlxs", "plan", "wide", "--budget", str(budget), "--max-context", "65536",
                                   "--json", *args))
        return json.loads(out.stdout)

    big = plan("1GB")
    least = big["dense_bytes"] + big["kv_bytes"] + big["reserve_bytes"] + 4 * sum(big["expert_bytes_per_layer"])
    full, four = plan(least), plan(least, "--kv-bits", "4")
    assert full["slots_per_layer"] == [4, 4]
    assert four["kv_bytes"] <= 0.3 * full["kv_bytes"] and four["kv_bits"] == 4
    assert sum(four["slots_per_layer"]) > sum(full["slots_per_layer"])
    assert_one_line_error(kv_env.run("mlxs", "plan", "wide", "--kv-bits", "5"), "--kv-bits")


def test_plan_and_engine_refuse_the_same_kv_layouts(kv_env, build):
    narrow = build("qwen3_moe", num_experts=8, top_k=2, head_dim=16)
    settings = kv_env.read_settings()
    settings["models"]["narrow"] = {"path": str(narrow)}
    kv_env.write_settings(**settings)
    why = "head dimension 16; no group size (32, 64, 128) divides it, so use kv_bits off"
    assert_one_line_error(kv_env.run("mlxs", "plan", "narrow", "--kv-bits", "4"), why)
    assert_one_line_error(kv_env.run("-m", "mlx-stream/narrow", "-o", "kv_bits", "4", "hi"), why)
    assert_ok(kv_env.run("mlxs", "config", "kv_group_size", "128"))
    wide = "kv_group_size 128 does not divide this model's head dimension 64; use kv_group_size 32 or 64"
    assert_one_line_error(kv_env.run("mlxs", "plan", "wide", "--kv-bits", "4"), wide)
    assert_one_line_error(kv_env.run("-m", "mlx-stream/wide", "-o", "kv_bits", "4", "hi"), wide)
    assert kv_env.turns() == []
