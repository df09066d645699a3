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

from plugin_support import LlmEnv, serving
from test_plugin_features import Force, _reply_ids, _tokenizer
from test_server import call, client

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
        with serving(env):
            yield env


def streamed(chunks):
    """(text, [{"id", "name", "arguments", "pieces"}], finish_reason) of a chat stream."""
    text, calls, finish = [], {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": "", "pieces": 0})
                call["id"] = delta.id or call["id"]
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
                call["pieces"] += bool(delta.function.arguments)
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
    assert [(x["name"], x["arguments"]) for x in calls] == [("add", '{"a": 2, "b": 3}')]  # as the model wrote it
    if stream:
        assert calls[0]["pieces"] > 1  # the arguments are streamed as they are generated

    answer = c.chat.completions.create(model="mlx-stream", messages=ASK + result_turn(sent_back, calls),
                                       tools=[ADD], max_tokens=100)
    assert answer.choices[0].message.content == "It is 5." and answer.choices[0].finish_reason == "stop"
    stats = answer.model_extra["mlx_stream"]["stats"]
    prompt = tooled.tokenizer.decode(tooled.prompts[-1].started.prompt_tokens)
    assert CALL in prompt and "<tool_response>\n5\n</tool_response>" in prompt
    assert stats["prefilled_tokens"] < stats["prompt_tokens"] // 2  # the call turn's KV is reused



NAMED = {"type": "function", "function": {"name": "shout"}}


@pytest.mark.parametrize("choice", ["required", NAMED])
def test_a_forced_call_is_a_valid_call_on_random_weights_whatever_the_seed(tooled, choice):
    import jsonschema_rs

    c = client(tooled)
    valid = {t["function"]["name"]: jsonschema_rs.validator_for(t["function"]["parameters"]) for t in (ADD, SHOUT)}
    for seed in range(20):
        body = dict(model="mlx-stream", messages=ASK, tools=[ADD, SHOUT], tool_choice=choice, temperature=1.0,
                    seed=seed, max_tokens=120)
        if seed % 2:
            text, calls, finish = streamed(c.chat.completions.create(**body, stream=True))
        else:
            reply = c.chat.completions.create(**body)
            text, finish = reply.choices[0].message.content or "", reply.choices[0].finish_reason
            calls = [{"name": t.function.name, "arguments": t.function.arguments}
                     for t in reply.choices[0].message.tool_calls or []]
        assert finish == "tool_calls" and text == "" and calls, (seed, text)
        for call in calls:
            assert call["name"] == "shout" or choice == "required", (seed, call)
            assert valid[call["name"]].is_valid(json.loads(call["arguments"])), (seed, call)


def test_parallel_tool_calls_off_gives_one_call(tooled):
    c = client(tooled)
    tooled.script = [CALL + CALL]
    reply = c.chat.completions.create(model="mlx-stream", messages=ASK, tools=[ADD], parallel_tool_calls=False,
                                      max_tokens=200)
    assert len(reply.choices[0].message.tool_calls) == 1 and reply.choices[0].finish_reason == "tool_calls"
    for seed in range(4):
        reply = c.chat.completions.create(model="mlx-stream", messages=ASK, tools=[ADD, SHOUT], seed=seed,
                                          tool_choice="required", parallel_tool_calls=False, temperature=1.0,
                                          max_tokens=120)
        assert len(reply.choices[0].message.tool_calls) == 1


def in_process_calls(messages, tools, **options):
    """The plugin's own (text, [(name, arguments)], token ids) for `messages`, never routed
    to a server."""
    import llm
    from llm.parts import Message, TextPart

    chain = [Message(role=m["role"], parts=[TextPart(text=m["content"])]) for m in messages]
    specs = [llm.Tool(name=t["function"]["name"], description=t["function"].get("description"),
                      input_schema=t["function"]["parameters"]) for t in tools]
    response = llm.get_model("mlx-stream").prompt(messages=chain, tools=specs, server="off", **options)
    return response.text(), [(call.name, call.arguments) for call in response.tool_calls()], _reply_ids(response)


@pytest.mark.parametrize("choice", ["auto", "required", "shout"])
def test_replies_equal_the_in_process_greedy_reply(tooled, choice):
    expected = in_process_calls(ASK, [ADD, SHOUT], tool_choice=choice, max_tokens=120)
    tool_choice = {"type": "function", "function": {"name": choice}} if choice == "shout" else choice
    reply = client(tooled).chat.completions.create(model="mlx-stream", messages=ASK, tools=[ADD, SHOUT],
                                                   tool_choice=tool_choice, max_tokens=120)
    message = reply.choices[0].message
    calls = [(t.function.name, json.loads(t.function.arguments)) for t in message.tool_calls or []]
    assert (message.content or "", calls, reply.model_extra["mlx_stream"]["tokens"]) == expected
    assert bool(calls) == (choice != "auto")


CALLED = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]}


def test_an_assistant_message_sent_back_as_openai_gave_it_is_accepted(tooled):
    tooled.script = ["It is 5."]
    sent_back = {**CALLED, "refusal": None, "audio": None, "function_call": None, "annotations": []}
    status, _, reply = call(tooled, "POST", "/v1/chat/completions", {
        "model": "mlx-stream", "tools": [ADD], "max_tokens": 40,
        "messages": ASK + [sent_back, {"role": "tool", "tool_call_id": "call_1", "content": "5"}]})
    assert status == 200 and reply["choices"][0]["message"]["content"] == "It is 5.", reply


@pytest.mark.parametrize("body,needle", [
    ({"model": "mlx-stream/plain", "tools": [ADD]}, "no tool support"),
    ({"model": "mlx-stream/plain", "messages": ASK + [CALLED, {"role": "tool", "tool_call_id": "call_1",
                                                               "content": "5"}]}, "no tool support"),
    ({"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice 'nope'"),
    ({"tool_choice": "required"}, "tool_choice required: no tools"),
    ({"tools": [{"type": "function", "function": {"name": "two words"}}]}, "tools.0.function.name"),
    ({"messages": ASK + [{"role": "tool", "tool_call_id": "call_9", "content": "5"}]}, "messages.1.tool_call_id"),
    ({"messages": ASK + [{**CALLED, "tool_calls": [{**CALLED["tool_calls"][0], "function": {
        "name": "add", "arguments": "[1]"}}]}]}, "messages.1.tool_calls.0.function.arguments"),
    ({"messages": ASK + [{"role": "user", "content": "x", "tool_call_id": "call_1"}]}, "tool_call_id"),
    ({"messages": ASK + [{"role": "tool", "content": "5"}]}, "tool_call_id"),
    ({"messages": ASK + [{**CALLED, "function_call": {"name": "add", "arguments": "{}"}}]}, "function_call"),
    ({"messages": ASK + [{"role": "assistant", "content": "no", "refusal": "I won't"}]}, "refusal"),
])
def test_what_cannot_be_honoured_is_a_400_naming_it(tooled, body, needle):
    status, _, reply = call(tooled, "POST", "/v1/chat/completions",
                            {"model": "mlx-stream", "messages": ASK, "max_tokens": 4, **body})
    assert status == 400 and needle in reply["error"]["message"], reply
    assert "\n" not in reply["error"]["message"]


def test_llm_drives_a_tool_loop_through_the_server_as_an_openai_model(tooled):
    """llm's own OpenAI client, pointed at the server (extra-openai-models.yaml), runs
    the tool and sends its result back: the loop of docs/server.md."""
    from importlib.metadata import version

    from plugin_support import assert_ok

    (tooled.user_dir / "extra-openai-models.yaml").write_text(
        f"- model_id: via-server\n  model_name: mlx-stream\n  api_base: {tooled.server.url}/v1\n"
        "  supports_tools: true\n")
    version_call = '<tool_call>\n{"name": "llm_version", "arguments": {}}\n</tool_call>'
    tooled.script = [version_call, "It is that."]
    out = assert_ok(tooled.run("-m", "via-server", "-T", "llm_version", "Which llm version?", "-o", "max_tokens",
                               "100"))
    assert out.stdout.strip() == "It is that."
    prompt = tooled.tokenizer.decode(tooled.prompts[-1].started.prompt_tokens)
    assert version_call in prompt and f"<tool_response>\n{version('llm')}\n</tool_response>" in prompt


def test_a_seeded_request_gives_the_same_reply_whatever_was_served_before(tooled):
    c = client(tooled)
    body = dict(model="mlx-stream", messages=ASK, tools=[ADD, SHOUT], tool_choice="required", temperature=1.0,
                seed=11, max_tokens=120)

    def sampled(**changes):
        reply = c.chat.completions.create(**{**body, **changes})
        return reply.model_extra["mlx_stream"]["tokens"], reply.model_extra["mlx_stream"]["stats"]

    first, _ = sampled()
    again, stats = sampled()  # its prompt is all in the KV cache now
    assert again == first and stats["reused_tokens"] == stats["prompt_tokens"] - 1
    sampled(seed=12)
    sampled(tool_choice="auto", messages=ASK + [{"role": "assistant", "content": "Hm."}, *ASK])
    assert sampled()[0] == first


def test_llm_t_is_routed_to_the_running_server_and_reuses_its_kv(tooled):
    from importlib.metadata import version

    from plugin_support import assert_ok

    version_call = '<tool_call>\n{"name": "llm_version", "arguments": {}}\n</tool_call>'
    tooled.script = [version_call, "It is that."]
    out = assert_ok(tooled.run("-m", "mlx-stream", "-T", "llm_version", "Which llm version?", "-o", "max_tokens",
                               "100"))
    assert out.stdout.strip() == "It is that."
    first, second = tooled.turns()[-2:]
    assert first["stats"]["served_by"] == second["stats"]["served_by"] == tooled.server.url
    prompt = tooled.tokenizer.decode(tooled.prompts[-1].started.prompt_tokens)
    assert version_call in prompt and f"<tool_response>\n{version('llm')}\n</tool_response>" in prompt
    assert second["stats"]["reused_tokens"] >= first["stats"]["prompt_tokens"] + first["stats"]["generated_tokens"]


@pytest.mark.parametrize("max_tokens", [20, 50])
def test_a_call_cut_by_max_tokens_ends_with_length(tooled, max_tokens):
    """Cut before its arguments began, the markup is text; after, the call is left out of
    the reply (its arguments are no whole JSON: an agent that ran it would break) and the
    reply ends with length. Streamed, the call's pieces went out as they were generated:
    they are not taken back, and the stream ends with length too."""
    c = client(tooled)
    body = dict(model="mlx-stream", messages=ASK, tools=[SHOUT], tool_choice="required", max_tokens=max_tokens)
    reply = c.chat.completions.create(**body)
    text, calls, finish = streamed(c.chat.completions.create(**body, stream=True))
    assert reply.choices[0].finish_reason == finish == "length"
    assert reply.choices[0].message.tool_calls is None and (reply.choices[0].message.content or "") == text
    assert bool(calls) == (max_tokens == 50) and (text.startswith("<tool_call>") or calls)


def openai_cut(env, limit: int, stream: bool) -> tuple:
    c = client(env)
    body = dict(model="mlx-stream", messages=ASK, tools=[ADD], max_tokens=limit)
    if stream:
        text, calls, finish = streamed(c.chat.completions.create(**body, stream=True))
        return text, [], finish, [(x["name"], None) for x in calls]
    reply = c.chat.completions.create(**body)
    message = reply.choices[0].message
    return message.content or "", [t.function.name for t in message.tool_calls or []], \
        reply.choices[0].finish_reason, []


def anthropic_cut(env, limit: int, stream: bool) -> tuple:
    import anthropic

    c = anthropic.Anthropic(base_url=env.server.url, api_key="unused", max_retries=0, timeout=60)
    body = dict(model="mlx-stream", messages=ASK, max_tokens=limit,
                tools=[{"name": "add", "input_schema": ADD["function"]["parameters"]}])
    if stream:
        with c.messages.stream(**body) as events:
            reply = events.get_final_message()
        sent = [(b.name, None) for b in reply.content if b.type == "tool_use"]
        return "".join(b.text for b in reply.content if b.type == "text"), [], reply.stop_reason, sent
    reply = c.messages.create(**body)
    return "".join(b.text for b in reply.content if b.type == "text"), \
        [b.name for b in reply.content if b.type == "tool_use"], reply.stop_reason, []


def responses_cut(env, limit: int, stream: bool) -> tuple:
    import openai

    c = openai.OpenAI(base_url=env.server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    body = dict(model="mlx-stream", input=ASK[0]["content"], max_output_tokens=limit,
                tools=[{"type": "function", **ADD["function"], "strict": False}])
    sent = []
    if stream:
        with c.responses.stream(**body) as events:
            sent = [(e.item.name, e.item.status) for e in events
                    if e.type == "response.output_item.done" and e.item.type == "function_call"]
            reply = events.get_final_response()
    else:
        reply = c.responses.create(**body)
    ending = (reply.status, reply.incomplete_details.reason if reply.incomplete_details else None)
    return reply.output_text, [o.name for o in reply.output if o.type == "function_call"], ending, sent


def ollama_cut(env, limit: int, stream: bool) -> tuple:
    import ollama

    c = ollama.Client(host=env.server.url, timeout=60)
    body = dict(model="mlx-stream", messages=ASK, tools=[ADD], options={"num_predict": limit})
    lines = list(c.chat(**body, stream=True)) if stream else [c.chat(**body)]
    calls = [t.function.name for line in lines for t in line.message.tool_calls or []]
    text = "".join(line.message.content or "" for line in lines)
    return text, [] if stream else calls, lines[-1].done_reason, [(name, None) for name in calls] if stream else []


CUT = {"openai": (openai_cut, "length"), "anthropic": (anthropic_cut, "max_tokens"),
       "responses": (responses_cut, ("incomplete", "max_output_tokens")), "ollama": (ollama_cut, "length")}
# What a stream has sent of a call the limit cut once it had begun: OpenAI's and Anthropic's
# pieces went out as they came; the Responses API's item ends marked incomplete (and is left
# out of the response); Ollama sends a call whole, so none of it.
SENT = {"openai": [("add", None)], "anthropic": [("add", None)], "responses": [("add", "incomplete")], "ollama": []}


@pytest.mark.parametrize("api", CUT)
@pytest.mark.parametrize("where", ["in its markup", "in its arguments"])
def test_a_call_cut_by_the_token_limit_is_left_out_in_every_api_and_the_reply_ends_for_the_limit(
        tooled, api, where):
    """The one policy of every API: a call the token limit cut is no call of the reply, and
    the reply ends for the limit in the API's own words (OpenAI's and Ollama's length,
    Anthropic's max_tokens, the Responses API's incomplete for max_output_tokens)."""
    before = CALL.index('"add"') if where == "in its markup" else CALL.index('{"a"')
    limit = len(tooled.tokenizer.encode(CALL[:before])) + 2  # a piece of the name, or of the arguments
    assert limit < len(tooled.tokenizer.encode(CALL))
    run, ending = CUT[api]
    tooled.script = [CALL, CALL]
    text, calls, whole_ending, sent = run(tooled, limit, False)
    assert (calls, whole_ending, sent) == ([], ending, [])
    assert text.startswith("<tool_call>") == (where == "in its markup")
    streamed_text, calls, streamed_ending, sent = run(tooled, limit, True)
    assert (streamed_text, calls, streamed_ending) == (text, [], ending)
    assert sent == (SENT[api] if where == "in its arguments" else [])
