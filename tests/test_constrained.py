"""`llm --schema` on mlx-stream: output constrained by llguidance always parses and
validates, even on random weights (#11)."""

from __future__ import annotations

import json

import llm
import pytest

from plugin_support import assert_ok, assert_one_line_error


@pytest.fixture
def bundled_env(llm_env, build):
    """llm_env serving a random checkpoint shaped like the old random demo (4 layers,
    16 experts, top-4), served with 8 slots."""
    path = build("qwen3_moe", hidden_size=128, num_layers=4, num_experts=16, top_k=4,
                 moe_intermediate_size=64)
    llm_env.write_settings(default_model="demo", models={"demo": {"path": str(path), "expert_slots": 8}})
    return llm_env


def _check(value, schema) -> None:
    """A small JSON-schema check for the types these tests use."""
    kind = schema["type"]
    if kind == "object":
        assert isinstance(value, dict) and set(value) <= set(schema["properties"])
        assert set(schema.get("required", [])) <= set(value)
        for key, item in value.items():
            _check(item, schema["properties"][key])
    elif kind == "array":
        assert isinstance(value, list)
        for item in value:
            _check(item, schema["items"])
    else:
        types = {"string": str, "integer": int, "boolean": bool, "number": (int, float)}[kind]
        assert isinstance(value, types) and (kind == "boolean" or not isinstance(value, bool))


def test_schema_output_validates_for_20_seeds(bundled_env):
    schema = llm.schema_dsl("name, age int, tags")
    for seed in range(20):
        out = assert_ok(bundled_env.run(
            "-m", "mlx-stream", "--schema", "name, age int, tags", "-o", "temperature", "1",
            "-o", "seed", str(seed), "-o", "max_tokens", "48", "Describe a person",
        )).stdout
        _check(json.loads(out), schema)
    stats = bundled_env.turns()[-1]["stats"]
    assert stats["finish_reason"] == "stop" and stats["generated_tokens"] <= 48


def test_nested_objects_and_arrays(bundled_env):
    schema = {
        "type": "object",
        "properties": {
            "person": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "pets": {"type": "array", "items": {
                        "type": "object",
                        "properties": {"kind": {"type": "string"}, "legs": {"type": "integer"}},
                        "required": ["kind", "legs"],
                    }},
                },
                "required": ["name", "pets"],
            },
            "scores": {"type": "array", "items": {"type": "number"}},
            "ok": {"type": "boolean"},
        },
        "required": ["person", "scores", "ok"],
    }
    for seed in range(3):
        out = assert_ok(bundled_env.run(
            "-m", "mlx-stream", "--schema", json.dumps(schema), "-o", "temperature", "1",
            "-o", "seed", str(seed), "-o", "max_tokens", "120", "A person and pets",
        )).stdout
        _check(json.loads(out), schema)


def test_schema_works_with_kv_reuse(llm_env):
    model = llm.get_model("mlx-stream")
    conversation = model.conversation()
    schema = llm.schema_dsl("word, count int")
    first = conversation.prompt("Say a word", schema=schema, max_tokens=40)
    _check(json.loads(first.text()), schema)
    second = conversation.prompt("And another", schema=schema, max_tokens=40)
    _check(json.loads(second.text()), schema)
    assert second.response_json["reused_tokens"] > 0


@pytest.mark.parametrize("schema, needle", [
    ('{"type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=a)b"}}}', "look-around"),
    ('{"type": "frog"}', "frog"),
])
def test_a_schema_that_cannot_compile_is_one_line(llm_env, schema, needle):
    assert_one_line_error(llm_env.run("-m", "mlx-stream", "--schema", schema, "hi"), "--schema", needle)
    assert llm_env.turns() == []


def test_closers_follow_the_json_state():
    from llm_mlx_streaming.prompt.constrained import closers

    assert closers('{"a": "tex') == ['"']
    assert closers('{"a": "te\\') == []  # an escape: the next character is not a close
    assert closers('{"a": 12') == ["]}", ","]
    assert closers('{"a": [true') == ["]}", ","]
    assert closers('{"a": ') == []


def test_schema_with_speculation_decodes_plainly_and_validates(llm_env):
    schema = llm.schema_dsl("word, count int")
    out = assert_ok(llm_env.run("-m", "mlx-stream", "--schema", "word, count int", "-o", "k", "2",
                                "-o", "max_tokens", "40", "Say a word")).stdout
    _check(json.loads(out), schema)
    assert llm_env.turns()[-1]["stats"]["speculation_off"] == "stateful logits processor"


def test_a_reply_cut_short_by_max_tokens_says_so_in_one_line(llm_env):
    schema = '{"type":"object","properties":{"a":{"type":"integer","minimum":5}},"required":["a"]}'
    short = assert_ok(llm_env.run("-m", "mlx-stream", "--schema", schema, "-o", "max_tokens", "3", "Give a"))
    with pytest.raises(ValueError):
        json.loads(short.stdout)
    warnings = [line for line in short.stderr.splitlines() if line.strip()]
    assert len(warnings) == 1 and "max_tokens ended the reply before the --schema document" in warnings[0]
    cut = llm_env.turns()[-1]["stats"]
    assert cut["schema_closed"] is False and cut["finish_reason"] == "length"

    whole = assert_ok(llm_env.run("-m", "mlx-stream", "--schema", schema, "-o", "max_tokens", "40", "Give a"))
    assert json.loads(whole.stdout)["a"] >= 5 and whole.stderr.strip() == ""
    assert llm_env.turns()[-1]["stats"]["schema_closed"] is True
