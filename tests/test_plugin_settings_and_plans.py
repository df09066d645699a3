"""The performance settings and commands through llm's real CLI: memory budgets and
plans, read settings, routing traces and the simulator, packed stores."""

from __future__ import annotations

import json
import shutil

import pytest

from plugin_support import assert_ok, assert_one_line_error, mlx_lm_text, split_reply

PROMPT = "Tell me about tea"


def _expected(env, n: int) -> str:
    return split_reply(mlx_lm_text(env.checkpoint, [{"role": "user", "content": PROMPT}], n))[0] + "\n"


def _budget(path, slots_total: int, max_context: int = 4096) -> int:
    """A budget (bytes) that leaves exactly `slots_total` slots' worth for the pools."""
    from llm_mlx_streaming.engine.planner import default_reserve, plan_memory

    p = plan_memory(path, "4GB", max_context=max_context)
    per_slot = p.expert_bytes_per_layer[0]
    budget = p.dense_bytes + p.kv_bytes + default_reserve(10**9) + slots_total * per_slot
    assert default_reserve(budget) == default_reserve(10**9)  # still the 256 MiB floor
    return budget


def _plan(path, budget: int, max_context: int = 4096):
    from llm_mlx_streaming.engine.planner import plan_memory

    return plan_memory(path, budget, max_context=max_context)


def _per_layer(slots, layers: int = 2) -> list[int]:
    """response_json's expert_slots (one number when every layer has the same) as a list."""
    return list(slots) if isinstance(slots, list) else [slots] * layers


@pytest.fixture
def planned_env(llm_env):
    """'small' without its own expert_slots: its pools come from memory_budget."""
    llm_env.write_settings(
        default_model="small", models={"small": {"path": str(llm_env.checkpoint), "aliases": ["sm"]}}
    )
    return llm_env


# -- settings ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key, good, stored, shown, bad",
    [
        ("memory_budget", "12GB", "12GB", "12GB", "lots"),
        ("max_context", "8192", 8192, "8192", "0"),
        ("threads", "4", 4, "4", "many"),
        ("page_cache", "bypass", "bypass", "bypass", "drop"),
        ("overlap", "on", "on", "on", "sometimes"),
        ("trace", "on", True, "on", "maybe"),
        ("packed", "off", "off", "off", "yes"),
    ],
)
def test_config_of_each_new_setting(llm_env, key, good, stored, shown, bad):
    rows = {r["key"]: r for r in json.loads(assert_ok(llm_env.run("mlxs", "config", "--json")).stdout)}
    assert rows[key]["default"] is True and rows[key]["description"]

    before = llm_env.settings_file.read_text()
    assert_one_line_error(llm_env.run("mlxs", "config", key, bad), key, repr(bad))
    assert llm_env.settings_file.read_text() == before  # nothing written
    assert assert_ok(llm_env.run("mlxs", "config", key)).stdout == _fmt_default(key) + "\n"

    assert_ok(llm_env.run("mlxs", "config", key, good))
    assert llm_env.read_settings()[key] == stored
    assert assert_ok(llm_env.run("mlxs", "config", key)).stdout == shown + "\n"
    table = assert_ok(llm_env.run("mlxs", "config")).stdout
    assert next(line for line in table.splitlines() if line.startswith(f"* {key} "))  # marked set

    assert_ok(llm_env.run("mlxs", "config", "--unset", key))
    assert key not in llm_env.read_settings()
    assert "models" in llm_env.read_settings()


def _fmt_default(key):
    from llm_mlx_streaming.options.settings import Settings

    value = Settings.model_fields[key].default
    return ("on" if value else "off") if isinstance(value, bool) else str(value)


def test_config_auto_budget_and_wrong_types_in_the_file(llm_env):
    table = assert_ok(llm_env.run("mlxs", "config")).stdout
    row = next(line for line in table.splitlines() if line.startswith("  memory_budget"))
    assert "auto (" in row and "GB)" in row  # the size auto stands for here
    assert_one_line_error(llm_env.run("mlxs", "config", "memory_budget", "0GB"), "memory_budget", "more than 0")
    llm_env.write_settings(threads="eight")
    assert_one_line_error(llm_env.run("mlxs", "config"), "threads")
    llm_env.write_settings(memory_budget="lots")
    assert_one_line_error(llm_env.run("-m", "mlx-stream", "hi"), "memory_budget", "not a size")
    assert llm_env.turns() == []


# -- plan ----------------------------------------------------------------------------


def test_plan_prints_slots_per_layer_and_refuses_a_small_budget(llm_env):
    budget = _budget(llm_env.checkpoint, 10)  # 2 layers x 8 experts, top-2
    expected = _plan(llm_env.checkpoint, budget)
    assert expected.slots_per_layer == [6, 4]  # even to half, then layer 0 grows whole-wards

    out = assert_ok(llm_env.run("mlxs", "plan", "sm", "--budget", str(budget), "--hit-rate", "0.8"))
    assert "layer 0: 6; layer 1: 4" in out.stdout and "at hit rate 0.8" in out.stdout
    assert "runs with 4 expert slots per layer" in out.stderr  # 'small' has its own count

    data = json.loads(assert_ok(llm_env.run("mlxs", "plan", str(llm_env.checkpoint), "--budget",
                                            str(budget), "--json")).stdout)
    assert data["slots_per_layer"] == [6, 4] and data["budget"] == budget

    # the KV cache for max_context comes first: a shorter context leaves more for the pools
    shorter = json.loads(assert_ok(llm_env.run("mlxs", "plan", "--budget", str(budget),
                                               "--max-context", "1024", "--json")).stdout)
    assert sum(shorter["slots_per_layer"]) > 10 and shorter["max_context"] == 1024
    assert_one_line_error(llm_env.run("mlxs", "plan", "--budget", str(budget), "--max-context", "8192"),
                          "short", "KV cache")

    small = _budget(llm_env.checkpoint, 3)  # top_k x 2 layers = 4 slots at least
    error = assert_one_line_error(llm_env.run("mlxs", "plan", "small", "--budget", str(small)), "short")
    assert "it takes at least" in error
    assert_one_line_error(llm_env.run("mlxs", "plan", "small", "--budget", "lots"), "lots")
    assert_one_line_error(llm_env.run("mlxs", "plan", "ghost"), "Unknown model 'ghost'")


def test_plan_without_a_budget_shows_the_plan_the_model_runs_with(llm_env):
    """'small' has 4 expert slots per layer of its own: that is its plan, not what the budget would allow."""
    out = assert_ok(llm_env.run("mlxs", "plan"))
    assert "slots per layer  layers 0-1: 4\n" in out.stdout and "expert pool" in out.stdout
    assert out.stderr.strip() == ("Note: mlx-stream/small runs with 4 expert slots per layer (its --expert-slots), "
                                  "as planned above; --budget SIZE shows the plan a memory budget makes "
                                  "(-o memory_budget SIZE runs with it).")
    data = json.loads(assert_ok(llm_env.run("mlxs", "plan", "--json")).stdout)
    assert data["slots_per_layer"] == [4, 4] and data["expert_slots_in_use"] == 4
    assert data["expected_peak_bytes"] == data["dense_bytes"] + data["kv_bytes"] + data["reserve_bytes"] + \
        data["pool_bytes"] and data["pool_bytes"] == 4 * sum(data["expert_bytes_per_layer"])


# -- pools from the budget ---------------------------------------------------------------


def test_a_budget_sizes_the_pools_and_the_output_stays_exact(planned_env):
    env = planned_env
    budget = _budget(env.checkpoint, 10)
    slots = _plan(env.checkpoint, budget).slots_per_layer
    assert_ok(env.run("mlxs", "config", "memory_budget", str(budget)))

    result = assert_ok(env.run("-m", "mlx-stream", "-o", "max_tokens", "16", PROMPT))
    assert result.stdout == _expected(env, 16)
    stats = env.turns()[-1]["stats"]
    assert _per_layer(stats["expert_slots"]) == slots and stats["slots_from"] == "plan"
    assert stats["memory_budget_bytes"] == budget
    assert stats["misses"] > 0 and stats["unplaced"] == 0

    # -o memory_budget wins over the setting, -o expert_slots over both
    other = _budget(env.checkpoint, 6)
    assert_ok(env.run("-m", "sm", "-o", "max_tokens", "16", "-o", "memory_budget", str(other), PROMPT))
    assert _per_layer(env.turns()[-1]["stats"]["expert_slots"]) == _plan(env.checkpoint, other).slots_per_layer
    again = assert_ok(env.run("-m", "sm", "-o", "max_tokens", "16", "-o", "expert_slots", "3", PROMPT))
    assert again.stdout == result.stdout
    assert env.turns()[-1]["stats"]["expert_slots"] == 3
    assert env.turns()[-1]["stats"]["slots_from"] == "option"

    table = assert_ok(env.run("mlxs", "stats")).stdout
    assert "(memory plan)" not in table.split("Last 3")[0]  # the last one was -o expert_slots
    assert "MB/s" in table and "expert reads" in table


def test_a_budget_too_small_is_one_line_and_nothing_is_logged(planned_env):
    env = planned_env
    small = str(_budget(env.checkpoint, 3))
    error = assert_one_line_error(env.run("-m", "mlx-stream", "-o", "memory_budget", small, "hi"), "short")
    assert "it takes at least" in error
    assert_ok(env.run("mlxs", "config", "memory_budget", small))
    assert_one_line_error(env.run("-m", "mlx-stream", "hi"), "short")
    assert_one_line_error(env.run("chat", "-m", "mlx-stream", input="hi\nquit\n"), "short")
    assert env.turns() == []
    # explicit slots need no plan
    assert_ok(env.run("-m", "mlx-stream", "-o", "expert_slots", "4", "-o", "max_tokens", "2", "hi"))


def test_read_settings_apply_to_the_loaded_model(llm_env):
    base = assert_ok(llm_env.run("-m", "mlx-stream", "-o", "max_tokens", "12", PROMPT)).stdout
    from llm_mlx_streaming.engine.manager import get_manager

    dense = get_manager().loaded.model  # the loaded model is kept, not reloaded
    assert_ok(llm_env.run("mlxs", "config", "threads", "2"))
    assert_ok(llm_env.run("mlxs", "config", "page_cache", "bypass"))
    assert assert_ok(llm_env.run("-m", "mlx-stream", "-o", "max_tokens", "12", PROMPT)).stdout == base
    stats = llm_env.turns()[-1]["stats"]
    assert (stats["threads"], stats["page_cache"]) == (2, "bypass")
    assert get_manager().loaded.model is dense and get_manager().bad_slots() == 0
    assert all(pool.store is get_manager().loaded.store for pool in get_manager().loaded.pools)


def test_max_context_bounds_prompt_and_reply(llm_env):
    assert_ok(llm_env.run("mlxs", "config", "max_context", "40"))
    assert_one_line_error(llm_env.run("-m", "mlx-stream", "tea " * 60), "max_context of 40")
    assert llm_env.turns() == []
    assert_ok(llm_env.run("-m", "mlx-stream", "-o", "max_tokens", "100", "hi"))
    [turn] = llm_env.turns()
    assert turn["stats"]["prompt_tokens"] + turn["stats"]["generated_tokens"] == 40


# -- traces and the simulator ------------------------------------------------------------


def test_trace_then_simulate(llm_env):
    trace = llm_env.user_dir / "mlx-streaming" / "traces" / "small.jsonl"
    assert_ok(llm_env.run("-m", "mlx-stream", "-o", "max_tokens", "4", "no trace"))
    assert not trace.exists()
    assert_one_line_error(llm_env.run("mlxs", "simulate", "small"), "No trace recorded")

    assert_ok(llm_env.run("mlxs", "config", "trace", "on"))
    assert_ok(llm_env.run("-m", "mlx-stream", "-o", "max_tokens", "12", "trace this"))
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert {line["phase"] for line in lines} == {"prefill", "decode"}
    decode = next(line for line in lines if line["phase"] == "decode")
    assert decode["layers"] == 2 and decode["experts"] == 8 and decode["top_k"] == 2

    out = assert_ok(llm_env.run("mlxs", "simulate", "sm", "--slots", "2,4,6")).stdout
    assert "LRU" in out and "Belady" in out and "LFUDA" in out
    assert [line.split()[0] for line in out.splitlines()[3:6]] == ["2", "4", "6"]
    by_path = assert_ok(llm_env.run("mlxs", "simulate", str(trace), "--slots", "2,4,6")).stdout
    assert by_path.splitlines()[1:] == out.splitlines()[1:]

    rows = json.loads(assert_ok(llm_env.run("mlxs", "simulate", "mlx-stream", "--policies", "lru",
                                            "--phase", "prefill", "--json")).stdout)["rows"]
    assert [r["slots"] for r in rows] == list(range(2, 8)) and set(rows[0]["hit_rate"]) == {"lru"}
    assert "small" in assert_ok(llm_env.run("mlxs", "traces")).stdout

    assert_one_line_error(llm_env.run("mlxs", "simulate", "sm", "--policies", "fifo"), "fifo")
    assert llm_env.run("mlxs", "simulate", "sm", "--slots", "two").exit_code == 2
    assert_one_line_error(llm_env.run("mlxs", "simulate", "nothing-here.jsonl"), "No such trace file or model")


def test_the_traces_shipped_with_the_plugin_replay_by_name(llm_env):
    listed = assert_ok(llm_env.run("mlxs", "traces"))
    rows = {line.split()[0]: line for line in listed.stdout.splitlines()[1:]}
    assert "(shipped)" in rows["mixtral-8x7b"] and "(shipped)" in rows["demo"] and "No traces recorded" in listed.stderr
    out = assert_ok(llm_env.run("mlxs", "simulate", "mixtral-8x7b", "--slots", "2,4")).stdout
    assert out.splitlines()[0] == "mixtral-8x7b, shipped with the plugin (decode)"
    assert "hit rate over 37,336 accesses (4 sequences x 32 layers" in out
    assert "(traces shipped with the plugin: demo, mixtral-8x7b)" in assert_one_line_error(
        llm_env.run("mlxs", "simulate", "mixtral"))


# -- packed store ---------------------------------------------------------------------


def test_pack_prompt_verify_and_a_flipped_byte(llm_env, tmp_path):
    copy = tmp_path / "Packable"
    shutil.copytree(llm_env.checkpoint, copy)
    assert_ok(llm_env.run("mlxs", "add", str(copy), "--expert-slots", "3"))
    args = ["-m", "mlx-stream/Packable", "-o", "max_tokens", "16", PROMPT]
    before = assert_ok(llm_env.run(*args)).stdout
    assert llm_env.turns()[-1]["stats"]["store"] == "safetensors"
    assert_one_line_error(llm_env.run("mlxs", "pack", "Packable", "--verify"), "no packed store")

    packed = assert_ok(llm_env.run("mlxs", "pack", "Packable"))
    assert "layer 2/2 packed" in packed.stderr and "Packed mlx-stream/Packable" in packed.stdout
    assert "+packed" in assert_ok(llm_env.run("mlxs", "models")).stdout

    after = assert_ok(llm_env.run(*args))
    assert after.stdout == before == _expected(llm_env, 16)
    stats = llm_env.turns()[-1]["stats"]
    assert stats["store"] == "packed" and stats["misses"] > 0
    assert assert_ok(llm_env.run("mlxs", "pack", "Packable", "--verify")).stdout == "ok\n"

    # packed off: the safetensors again, same text
    assert_ok(llm_env.run("mlxs", "config", "packed", "off"))
    assert assert_ok(llm_env.run(*args)).stdout == before
    assert llm_env.turns()[-1]["stats"]["store"] == "safetensors"

    layer = copy / "mlxs-packed" / "layer-001.bin"
    data = bytearray(layer.read_bytes())
    data[5] ^= 0xFF
    layer.write_bytes(bytes(data))
    bad = llm_env.run("mlxs", "pack", "Packable", "--verify")
    assert_one_line_error(bad, "1 problem")
    assert "layer-001.bin: record of expert 0 fails its checksum" in bad.stdout

    assert_ok(llm_env.run("mlxs", "pack", "Packable", "--remove"))
    assert not (copy / "mlxs-packed").exists()
