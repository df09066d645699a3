"""llm features on mlx-stream (#11): stop sequences, unlimited max_tokens, the
thinking switch and the async model, through llm's real CLI and Python API."""

from __future__ import annotations

import asyncio
import json
import shutil

import llm
import pytest

from fixtures.scripted import Force
from plugin_support import assert_llm_option_error, assert_ok, assert_one_line_error


def _text(llm_env, *args) -> str:
    return assert_ok(llm_env.run("-m", "mlx-stream", *args)).stdout


def checkpoint_with_template(src, dst, template: str):
    """A copy of checkpoint `src` (weights linked, not copied) with another chat template."""
    dst.mkdir()
    for item in src.iterdir():
        if item.name == "tokenizer_config.json":
            config = json.loads(item.read_text())
            config["chat_template"] = template
            (dst / item.name).write_text(json.dumps(config))
        elif item.is_file():
            (dst / item.name).symlink_to(item)
    return dst


# -- stop sequences ------------------------------------------------------------


def test_stop_sequence_ends_the_reply_before_it(llm_env):
    full = _text(llm_env, "-o", "max_tokens", "24", "Tell me about tea")[:-1]
    stop = full[6:9]
    assert len(stop) == 3 and full.find(stop) >= 0
    cut = full[: full.find(stop)]
    assert _text(llm_env, "-o", "max_tokens", "24", "-o", "stop", stop, "Tell me about tea") == cut + "\n"
    stats = llm_env.turns()[-1]["stats"]
    assert stats["finish_reason"] == "stop" and stats["generated_tokens"] < 24
    # several, as a JSON list: the earliest in the text wins
    later = full[12:14]
    out = _text(llm_env, "-o", "max_tokens", "24", "-o", "stop", json.dumps([later, stop, "never!"]),
                "Tell me about tea")
    assert out == full[: min(full.find(stop), full.find(later))] + "\n"
    # none of them in the text: the whole reply
    assert _text(llm_env, "-o", "max_tokens", "24", "-o", "stop", "\x01never", "Tell me about tea") == full + "\n"


def test_stop_matcher_holds_back_a_split_stop_sequence():
    from llm_mlx_streaming.stops import StopMatcher

    text = "one two END three"
    for cut in range(1, len(text)):
        m = StopMatcher(["END", "xyz"])
        out = m.feed(text[:cut])
        if m.hit is None:
            out += m.feed(text[cut:])
        assert (out, m.hit) == ("one two ", "END"), cut
    m = StopMatcher(["END"])
    assert m.feed("ab EN") == "ab " and m.flush() == "EN"


# -- unlimited max_tokens -------------------------------------------------------


@pytest.mark.parametrize("value", ["0", "-1"])
def test_unlimited_max_tokens_runs_to_the_context_end(llm_env, value):
    llm_env.write_settings(**{**llm_env.read_settings(), "max_context": 48})
    assert_ok(llm_env.run("-m", "mlx-stream", "-o", "max_tokens", value, "hi"))
    stats = llm_env.turns()[-1]["stats"]
    assert stats["prompt_tokens"] + stats["generated_tokens"] == 48
    assert stats["finish_reason"] == "length"


# -- thinking switch ---------------------------------------------------------------


def test_thinking_off_sets_the_template_switch(llm_env):
    from plugin_support import _stock

    from mlx_lm import generate

    model, tokenizer = _stock(str(llm_env.checkpoint))
    messages = [{"role": "user", "content": "Tell me about tea"}]
    tokens = tokenizer.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False)
    expected = generate(model, tokenizer, tokens, max_tokens=10)
    assert "<think>" not in expected
    assert _text(llm_env, "-o", "max_tokens", "10", "-o", "thinking", "off", "Tell me about tea") == expected + "\n"
    off = llm_env.turns()[-1]["stats"]["prompt_tokens"]
    assert_ok(llm_env.run("-m", "mlx-stream", "-o", "max_tokens", "1", "-o", "thinking", "on", "Tell me about tea"))
    on = llm_env.turns()[-1]["stats"]["prompt_tokens"]
    assert off == on + len(tokenizer.encode("<think>\n\n</think>\n\n", add_special_tokens=False)) == tokens.__len__()


def test_thinking_on_a_template_without_the_switch_is_one_line(llm_env, tmp_path):
    plain = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    path = checkpoint_with_template(llm_env.checkpoint, tmp_path / "plain", plain)
    llm_env.write_settings(models={"plain": {"path": str(path), "expert_slots": 4}})
    assert_one_line_error(
        llm_env.run("-m", "mlx-stream/plain", "-o", "thinking", "off", "hi"), "no thinking switch"
    )
    assert llm_env.turns() == []


# -- option validation ----------------------------------------------------------------


@pytest.mark.parametrize(
    "option, value",
    [
        ("thinking", "maybe"),
        ("stop", "[1, 2]"),
        ("stop", "[\"a\""),
        ("stop", "[]"),
        ("max_tokens", "-2"),
        ("max_tokens", "many"),
    ],
)
def test_bad_option_values_are_one_line(llm_env, option, value):
    assert_llm_option_error(llm_env.run("-m", "mlx-stream", "-o", option, value, "hi"), option)
    assert llm_env.turns() == []


# -- async -----------------------------------------------------------------------------


def test_async_model_matches_sync_and_runs_concurrently(llm_env):
    sync_text = llm.get_model("mlx-stream").prompt("Tell me about tea", max_tokens=8).text()
    model = llm.get_async_model("mlx-stream")
    assert model.model_id == "mlx-stream"

    async def both():
        one = model.prompt("Tell me about tea", max_tokens=8)
        two = model.prompt("Name a boat", max_tokens=6)
        texts = await asyncio.gather(one.text(), two.text())
        return (*texts, await two.json())

    one, two, two_json = asyncio.run(both())
    assert one == sync_text and two
    assert two_json["generated_tokens"] == 6


def test_cancelling_the_async_task_stops_the_generation(llm_env, monkeypatch):
    from llm_mlx_streaming.engine import manager as manager_mod

    engine = manager_mod.get_manager()
    handles, prompts = [], []
    real_run = engine.run

    def spy(load, request):
        prompts.append(list(request.prompt))
        handles.append(real_run(load, request))
        return handles[-1]

    monkeypatch.setattr(engine, "run", spy)
    model = llm.get_async_model("mlx-stream")

    async def start_then_cancel():
        chunks = []

        async def consume():
            async for chunk in model.prompt("Tell me about tea", max_tokens=-1):
                chunks.append(chunk)

        task = asyncio.create_task(consume())
        for _ in range(6000):  # at most a minute
            if chunks:
                break
            await asyncio.sleep(0.01)
        assert chunks, "no chunk in a minute"
        served = engine.served
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return served

    served = asyncio.run(start_then_cancel())
    [generation] = handles
    assert generation.channel.finished.wait(60)  # stopped long before 4096 tokens
    assert engine.served == served  # cancelled, not run to the end
    assert not any(held[:len(prompts[0])] == prompts[0] for held, _ in engine.prompts.conversations())  # dropped
    # the engine goes on serving
    assert llm.get_model("mlx-stream").prompt("hi", max_tokens=2).text()


# -- tools -------------------------------------------------------------------------------


@pytest.fixture
def tools_env(llm_env, build, monkeypatch):
    """llm_env serving a checkpoint whose chat template supports tools, as 'tools'; `script`
    lists the replies the next generations are forced to write (text, then end of turn)."""
    from llm_mlx_streaming.engine import manager as manager_mod
    from fixtures.tokenizer import IM_END, token_ids

    path = build("qwen3_moe", tool_template=True)
    llm_env.write_settings(default_model="tools", models={"tools": {"path": str(path), "expert_slots": 4}})
    engine = manager_mod.get_manager()
    real_run = engine.run
    llm_env.script, llm_env.prompts = [], []

    def run(load, request):
        if llm_env.script:
            text = llm_env.script.pop(0)
            tokenizer = _tokenizer(path)
            if isinstance(text, tuple):  # ("...", "chars"): one token per character, not BPE's spelling
                ids = [i for ch in text[0] for i in tokenizer.encode(ch)]
            else:
                ids = tokenizer.encode(text)
            request.logits_processors.append(Force(ids + [token_ids()[IM_END]]))
        generation = real_run(load, request)
        llm_env.prompts.append(generation)
        return generation

    monkeypatch.setattr(engine, "run", run)
    return llm_env


def _tokenizer(path):
    from pathlib import Path

    from mlx_lm.tokenizer_utils import load

    return load(Path(path))


CALL = 'Let me check.<tool_call>\n{"name": "llm_version", "arguments": {}}\n</tool_call>'


def test_a_tool_call_is_parsed_executed_and_its_result_fed_back(tools_env):
    from importlib.metadata import version

    tools_env.script = [(CALL, "chars"), "It is that."]
    out = assert_ok(tools_env.run("-m", "mlx-stream", "-T", "llm_version", "Which llm version?")).stdout
    assert "tool_call" not in out and "llm_version" not in out  # the markup is not shown
    assert out.split() == ["Let", "me", "check.", "It", "is", "that."]  # (llm joins a chain's replies)
    first, second = tools_env.turns()
    import sqlite3

    db = sqlite3.connect(tools_env.user_dir / "logs.db")
    [(name, payload)] = db.execute("select tool_name, payload from parts where type = 'tool_call'").fetchall()
    assert (name, json.loads(payload)["arguments"]) == ("llm_version", {})
    # the second turn's prompt holds the call, as the template writes it, and the result
    tokenizer = _tokenizer(tools_env.read_settings()["models"]["tools"]["path"])
    prompt = tokenizer.decode(tools_env.prompts[1].started.prompt_tokens)
    assert '<tool_call>\n{"name": "llm_version", "arguments": {}}\n</tool_call>' in prompt
    assert f"<tool_response>\n{version('llm')}\n</tool_response>" in prompt
    # the whole first reply, tool call included, is reused (the template writes the call as the model did)
    assert second["stats"]["reused_tokens"] == first["stats"]["prompt_tokens"] + first["stats"]["generated_tokens"]


def test_tool_calls_reach_the_python_api(tools_env):
    def add(a: int, b: int) -> int:
        "Add two numbers"
        return a + b

    tools_env.script = ['<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>']
    response = llm.get_model("mlx-stream").prompt("2 + 3?", tools=[add])
    assert response.text() == ""
    [call] = response.tool_calls()
    assert (call.name, call.arguments) == ("add", {"a": 2, "b": 3}) and call.tool_call_id
    [result] = response.execute_tool_calls()
    assert result.output == "5"


def test_tool_choice_forces_a_valid_call_and_none_hides_the_tools(tools_env):
    def add(a: int, b: int) -> int:
        "Add two numbers"
        return a + b

    model = llm.get_model("mlx-stream")
    for seed in range(5):  # random weights: only the grammar makes these calls
        response = model.prompt("2 + 3?", tools=[add], tool_choice="add", temperature=1.0, seed=seed,
                                max_tokens=120)
        [call] = response.tool_calls()
        assert call.name == "add" and set(call.arguments) == {"a", "b"}
        assert all(isinstance(v, int) for v in call.arguments.values())
    response = model.prompt("2 + 3?", tools=[add], tool_choice="none", max_tokens=4)
    assert response.text() is not None and response.tool_calls() == []
    tokenizer = _tokenizer(tools_env.read_settings()["models"]["tools"]["path"])
    assert "add" not in tokenizer.decode(tools_env.prompts[-1].started.prompt_tokens)  # not shown
    assert_llm_option_error(tools_env.run("-m", "mlx-stream", "-T", "llm_version", "-o", "tool_choice", "nope",
                                          "hi"), "tool_choice 'nope'")


def test_a_forced_tool_call_may_first_close_the_think_block_the_template_opened(tools_env):
    import llguidance
    import llguidance.hf

    from llm_mlx_streaming.prompt.tools import forced_call_grammar, template_tools

    tokenizer = _tokenizer(tools_env.read_settings()["models"]["tools"]["path"])
    tools = template_tools([llm.Tool(name="f", input_schema={"type": "object", "properties": {}})])
    grammar = forced_call_grammar(tokenizer, tools, "required", thinking=True)
    hf = tokenizer._tokenizer
    matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(hf, n_vocab=len(hf)), grammar, log_level=0)
    call = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    assert matcher.consume_tokens(tokenizer.encode("first a thought</think>\n\n" + call))
    assert matcher.is_accepting()
    matcher.reset()
    matcher.consume_tokens(tokenizer.encode(call))
    assert not matcher.is_accepting()  # a call inside the open think block is still thought


def test_a_tool_call_format_with_no_grammar_cannot_be_forced():
    from types import SimpleNamespace

    from llm_mlx_streaming.formats.registry import by_name
    from llm_mlx_streaming.prompt.tools import ToolError, forced_call_grammar, template_tools

    tokenizer = SimpleNamespace(has_tool_calling=True, tool_format=by_name("function_gemma"))
    tools = template_tools([llm.Tool(name="f", input_schema={"type": "object", "properties": {}})])
    with pytest.raises(ToolError, match=r"format \(function_gemma\) cannot be enforced; use tool_choice auto"):
        forced_call_grammar(tokenizer, tools, "required")


def test_unparseable_tool_markup_is_shown_as_written(tools_env):
    tools_env.script = ["<tool_call>\nnot json\n</tool_call>"]
    out = assert_ok(tools_env.run("-m", "mlx-stream", "-T", "llm_version", "hi")).stdout
    assert out == "<tool_call>\nnot json\n</tool_call>\n"


def test_tools_on_a_template_without_tool_support_is_one_line(llm_env):
    assert_one_line_error(llm_env.run("-m", "mlx-stream", "-T", "llm_version", "hi"), "no tool support")
    assert llm_env.turns() == []


def test_reply_splitter_cuts_tool_markup_split_anywhere():
    from types import SimpleNamespace

    from llm_mlx_streaming.prompt.split import ReplySplitter

    tokenizer = SimpleNamespace(has_thinking=True, think_start="<think>", think_end="</think>",
                                has_tool_calling=True, tool_call_start="<tool_call>", tool_call_end="</tool_call>",
                                response_transitions={}, structural_markers=(), tool_format=None)
    text = "a<think>r</think>b<tool_call>{x}</tool_call>c<tool_call>{y"
    for cut in range(1, len(text)):
        s = ReplySplitter(tokenizer)
        pieces = s.feed(text[:cut]) + s.feed(text[cut:]) + s.flush()
        kinds = {}
        for kind, chunk in pieces:
            kinds.setdefault(kind, []).append(chunk)
        assert "".join(kinds["text"]) == "abc", cut
        assert "".join(kinds["reasoning"]) == "r"
        assert kinds["tool_call"] == ["{x}"] and kinds["tool_call_unfinished"] == ["{y"]
        assert "".join(kinds["tool_call_text"]) == "{x}{y"  # the markup as it arrives


# -- the next turn reuses a reply cut by a stop sequence or ending in a tool call -------


def _reply_ids(response) -> list[int]:
    from llm_mlx_streaming.prompt.messages import METADATA_KEY

    found = None
    for message in response.messages():
        for part in message.parts:
            found = ((part.provider_metadata or {}).get(METADATA_KEY) or {}).get("tokens") or found
    return found


def test_the_next_turn_reuses_a_reply_cut_by_a_stop_sequence(llm_env):
    from pathlib import Path

    from mlx_lm.tokenizer_utils import load

    model = llm.get_model("mlx-stream")
    full = model.prompt("Tell me about tea", max_tokens=24).text()
    conversation = model.conversation()
    first = conversation.prompt("Tell me about tea", max_tokens=24, stop=full[10:13])
    assert first.text() == full[:10]
    ids = _reply_ids(first)
    assert load(Path(llm_env.checkpoint)).decode(ids) in (first.text(), " " + first.text())
    second = conversation.prompt("And then?", max_tokens=4)
    second.text()
    s1, s2 = first.response_json, second.response_json
    # everything up to the cut is reused; the stop sequence's own tokens are not
    assert s2["reused_tokens"] >= s1["prompt_tokens"] + len(ids) - 1


def test_thinking_off_gives_no_reasoning_events(tools_env):
    tools_env.script = ["<think>hmm</think>ok", "<think>hmm</think>ok"]
    on = assert_ok(tools_env.run("-m", "mlx-stream", "-o", "thinking", "on", "hi"))
    assert on.stdout == "ok\n" and "hmm" in on.stderr  # reasoning goes to stderr
    off = assert_ok(tools_env.run("-m", "mlx-stream", "-o", "thinking", "off", "hi"))
    assert off.stdout == "hmmok\n"  # a model that thinks anyway is shown as text, without the tags


def test_tools_in_llm_chat(tools_env):
    tools_env.script = [CALL, "It is that.", "Fine."]
    out = assert_ok(tools_env.run("chat", "-m", "mlx-stream", "-T", "llm_version",
                                  input="Which llm version?\nthanks\nquit\n")).stdout
    assert "tool_call" not in out and "It is that." in out and "Fine." in out
    turns = tools_env.turns()
    assert len(turns) == 3 and len({t["thread_id"] for t in turns}) == 1
    assert turns[2]["stats"]["reused_tokens"] > turns[1]["stats"]["prompt_tokens"]


def test_top_logprobs_are_recorded_alike_with_and_without_speculative_decoding(llm_env):
    model = llm.get_model("mlx-stream")
    runs = [model.prompt("hello there", max_tokens=8, top_logprobs=2, k=k) for k in (0, 2)]
    for response in runs:
        response.text()
    plain, drafted = (response.response_json["logprobs"] for response in runs)
    assert runs[1].response_json["k"] == 2 and len(plain) == 8
    assert [(e["token"], [t["token"] for t in e["top_logprobs"]]) for e in plain] == \
        [(e["token"], [t["token"] for t in e["top_logprobs"]]) for e in drafted]
    assert all(abs(a["logprob"] - b["logprob"]) < 1e-3 for a, b in zip(plain, drafted))
