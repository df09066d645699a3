"""Tools through `llm mlxs serve`, driven by the official openai client: an agent loop
(the model calls, the test answers, the model goes on), tool_choice enforced by
constrained decoding on random weights, and the refusals.

One server (in a thread of this process, stopped at the end) serves a checkpoint whose
chat template supports tools ('tools') and one whose template does not ('plain').
`script` forces the next generations' text, as the plugin's tool tests do.
"""

from __future__ import annotations

import json

import pytest

from plugin_support import LlmEnv
from test_plugin_features import Force, _tokenizer

ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two numbers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"], "additionalProperties": False}}}
SHOUT = {"type": "function", "function": {
    "name": "shout", "parameters": {"type": "object", "properties": {
        "word": {"type": "string", "maxLength": 12}, "times": {"type": "integer", "minimum": 1, "maximum": 3}},
        "required": ["word", "times"], "additionalProperties": False}}}
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
ASK = [{"role": "user", "content": "What is 2 + 3?"}]


@pytest.fixture(scope="module")
def tooled(tmp_path_factory, build, plugin_checkpoint):
    from fixtures.tokenizer import IM_END, token_ids
    from llm_mlx_streaming.engine.manager import get_manager
    from llm_mlx_streaming.server.run import Server

    path = build("qwen3_moe", tool_template=True)
    user_dir = tmp_path_factory.mktemp("tooled") / "llm"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LLM_USER_PATH", str(user_dir))
        env = LlmEnv(user_dir, path)
        env.write_settings(default_model="tools", models={
            "tools": {"path": str(path), "expert_slots": 4},
            "plain": {"path": str(plugin_checkpoint), "expert_slots": 4}})
        env.script, env.prompts, env.tokenizer = [], [], _tokenizer(path)
        engine = get_manager()
        real_run = engine.run

        def run(load, request):
            if env.script:
                ids = env.tokenizer.encode(env.script.pop(0))
                request.logits_processors.append(Force(ids + [token_ids()[IM_END]]))
            generation = real_run(load, request)
            env.prompts.append(generation)
            return generation

        mp.setattr(engine, "run", run)
        server = Server(port=0, max_queue=8).start()
        env.server = server
        try:
            yield env
        finally:
            server.stop()


def client(env):
    import openai

    return openai.OpenAI(base_url=env.server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def streamed(chunks):
    """(text, [{"id", "name", "arguments"}], finish_reason) of a chat stream."""
    text, calls, finish = [], {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = delta.id or call["id"]
                call["name"] += (delta.function.name or "") if delta.function else ""
                call["arguments"] += (delta.function.arguments or "") if delta.function else ""
            finish = choice.finish_reason or finish
    return "".join(text), [calls[i] for i in sorted(calls)], finish


def result_turn(reply_message, calls, output="5"):
    """The messages an agent sends back: the assistant's calls, then each result."""
    return [reply_message, *({"role": "tool", "tool_call_id": c["id"], "content": output} for c in calls)]


@pytest.mark.parametrize("stream", [False, True])
def test_an_agent_loop_calls_a_tool_and_answers_with_its_result(tooled, stream):
    c = client(tooled)
    tooled.script = [CALL, "It is 5."]
    if stream:
        text, calls, finish = streamed(c.chat.completions.create(
            model="mlx-stream", messages=ASK, tools=[ADD], max_tokens=100, stream=True))
        sent_back = {"role": "assistant", "content": text or None, "tool_calls": [
            {"id": x["id"], "type": "function", "function": {"name": x["name"], "arguments": x["arguments"]}}
            for x in calls]}
    else:
        reply = c.chat.completions.create(model="mlx-stream", messages=ASK, tools=[ADD], max_tokens=100)
        message, finish = reply.choices[0].message, reply.choices[0].finish_reason
        assert message.content is None
        text = ""
        calls = [{"id": t.id, "name": t.function.name, "arguments": t.function.arguments} for t in message.tool_calls]
        sent_back = message
    assert finish == "tool_calls" and text == ""
    assert [(x["name"], json.loads(x["arguments"])) for x in calls] == [("add", {"a": 2, "b": 3})]

    answer = c.chat.completions.create(model="mlx-stream", messages=ASK + result_turn(sent_back, calls),
                                       tools=[ADD], max_tokens=100)
    assert answer.choices[0].message.content == "It is 5." and answer.choices[0].finish_reason == "stop"
    stats = answer.model_extra["mlx_stream"]["stats"]
    prompt = tooled.tokenizer.decode(tooled.prompts[-1].started.prompt_tokens)
    assert CALL in prompt and "<tool_response>\n5\n</tool_response>" in prompt
    assert stats["prefilled_tokens"] < stats["prompt_tokens"] // 2  # the call turn's KV is reused

