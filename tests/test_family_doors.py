"""Every MoE family's own chat template and tool-call format, through every door of
`llm mlxs serve` and through llm itself: a tiny checkpoint per family carries the
family's real template and special tokens (fixtures/families.py), and its reply is
forced to what the family's model writes (a reasoning block where it thinks, then two
parallel calls, or one where a turn holds one; after the results, an answer). Each API
must give the reasoning as its own reasoning, the calls as its own tool calls (streamed
as they are written, whole when not streamed), no markup in the text, and render the
round trip (the calls and their results back in the template's terms). The recorded
Claude Code and Codex requests must render for every family (their token counts), and
Claude Code's two thinking shapes (adaptive; enabled with a budget) are answered on every
family; a budget ends the reasoning with the family's own closing tokens, as stock mlx-lm
fed the same tokens writes it."""

from __future__ import annotations

import json

import llm
import pytest

from doors_support import ASK, DOORS, TOOLS, Turn
from exactness import greedy_tokens
from fixtures.families import FAMILIES, build_family_checkpoint, end_of_turn, native_reply
from fixtures.scripted import Force
from fixtures.traffic import load
from plugin_support import LlmEnv, serving

THOUGHT = "I should look it up."
CALLS = [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"city": "Paris"})]
ANSWER = "It is sunny, and noon."
ONE_CALL_A_TURN = {"gpt_oss"}  # harmony: a turn ends at its call
# DeepSeek-V3.1 calls tools in non-thinking mode: after the results its template opens no think block
ANSWERS_WITHOUT_REASONING = {"deepseek_v31"}
RECORDED = {"anthropic": ("claude_code_turn1", "claude_code_tool_result", "claude_code_sonnet_turn1"),
            "responses": ("codex_turn1", "codex_tool_output")}
# Claude Code's thinking shapes: its default tier's (adaptive) and its Sonnet tier's (enabled, budget 31999 of 32000)
CLAUDE_CODE = {"adaptive": "claude_code_turn1", "budget": "claude_code_sonnet_turn1"}
BUDGET = 8
FINISH = {"openai": "tool_calls", "responses": "completed", "anthropic": "tool_use", "ollama": "stop"}
# Each API's own way to turn the template's thinking switch on
THINKING = {"openai": {"reasoning_effort": "medium"}, "responses": {"reasoning": {"effort": "medium"}},
            "anthropic": {"thinking": {"type": "adaptive"}}, "ollama": {"think": True}}


def switch(family: str, door: str) -> dict:
    """The door's thinking field, for a family whose template has a switch."""
    return THINKING[door] if FAMILIES[family].thinking_kwarg else {}


def expected_calls(family: str) -> list:
    return CALLS[:1] if family in ONE_CALL_A_TURN else CALLS


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """A server for every family's checkpoint (model id: the family's name), whose
    replies are forced to `env.script`'s texts in turn."""
    from llm_mlx_streaming.engine.manager import get_manager

    root = tmp_path_factory.mktemp("families")
    paths = {family: build_family_checkpoint(root / family, family) for family in FAMILIES}
    user_dir = root / "llm"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LLM_USER_PATH", str(user_dir))
        env = LlmEnv(user_dir, paths["qwen3"])
        env.write_settings(default_model="qwen3", max_context=32768, conversation_cache=False,
                           models={f: {"path": str(p), "expert_slots": 4} for f, p in paths.items()})
        env.paths, env.script = paths, []
        engine = get_manager()
        real_run = engine.run

        def run(load_spec, request):
            if env.script:
                family, reply, calls = env.script.pop(0)
                tokenizer = env.tokenizer(family)
                ids = tokenizer.encode(reply, add_special_tokens=False) + [end_of_turn(family, tokenizer, calls)]
                request.logits_processors.append(Force(ids))
            return real_run(load_spec, request)

        tokenizers = {}

        def tokenizer(family):
            if family not in tokenizers:
                from mlx_lm.utils import load_tokenizer
                tokenizers[family] = load_tokenizer(paths[family])
            return tokenizers[family]

        env.tokenizer = tokenizer
        mp.setattr(engine, "run", run)
        with serving(env, any_model=True):
            yield env


@pytest.fixture
def served(families):
    """The families' server, with no forced reply left over from a failed test."""
    families.script.clear()
    yield families
    families.script.clear()


def _script(env, family: str, *, answer: bool = False) -> None:
    """The next generation's forced reply: the thought and the calls, or the answer."""
    thinks = FAMILIES[family].reasons and not (answer and family in ANSWERS_WITHOUT_REASONING)
    if answer:
        env.script.append((family, native_reply(family, reasoning=THOUGHT if thinks else None, text=ANSWER), False))
    else:
        env.script.append((family, native_reply(family, reasoning=THOUGHT if thinks else None,
                                                calls=expected_calls(family)), True))


def _check_calls(family: str, turn: Turn, door: str, stream: bool) -> None:
    assert turn.called() == expected_calls(family), turn
    assert turn.text.strip() == "", turn.text  # no markup (nor anything else) left in the text
    if FAMILIES[family].reasons:
        assert turn.reasoning.strip() == THOUGHT, turn.reasoning
    else:
        assert not turn.reasoning.strip()
    assert turn.finish == FINISH[door]
    if stream and door != "ollama":  # Ollama sends a call whole, in one chunk
        for _, _, arguments, pieces in turn.calls:
            assert json.loads("".join(pieces)) == arguments


# scope="module" runs every test of one family before the next family's: the engine loads
# each family's model once, not once per test function
@pytest.mark.parametrize("door", list(DOORS))
@pytest.mark.parametrize("family", list(FAMILIES), scope="module")
def test_a_familys_calls_and_reasoning_come_through_each_door_whole_streamed_and_answered(served, family, door):
    ask, answered, first = DOORS[door]
    url = served.server.url
    request = first(ASK)
    for stream in (False, True):
        _script(served, family)
        turn = ask(url, family, request, stream, **switch(family, door))
        _check_calls(family, turn, door, stream)
    _script(served, family, answer=True)
    results = answered(request, turn, json.dumps({"temperature": 18}))
    final = ask(url, family, results, False, **switch(family, door))
    assert final.text.strip() == ANSWER and not final.calls, final
    assert not served.script


def get_weather(city: str, days: int = 1) -> str:
    """The weather in a city"""
    return json.dumps({"temperature": 18})


def get_time(city: str) -> str:
    """The local time in a city"""
    return "12:00"


@pytest.mark.parametrize("family", list(FAMILIES), scope="module")
def test_a_familys_calls_run_as_llm_tools_and_the_answer_follows(served, family):
    _script(served, family)
    _script(served, family, answer=True)
    model = llm.get_model(f"mlx-stream/{family}")
    thinking = {"thinking": True} if FAMILIES[family].thinking_kwarg else {}
    chain = model.chain(ASK, tools=[get_weather, get_time], options={"server": "off", **thinking})
    replies = list(chain.responses())
    assert [(c.name, c.arguments) for c in replies[0].tool_calls()] == expected_calls(family)
    assert replies[-1].text().strip() == ANSWER
    assert not served.script


@pytest.mark.parametrize("door", list(RECORDED))
@pytest.mark.parametrize("family", list(FAMILIES), scope="module")
def test_the_recorded_agent_requests_render_with_every_familys_template(served, family, door):
    from server_support import call

    path = "/v1/messages/count_tokens" if door == "anthropic" else "/v1/responses/input_tokens"
    for name in RECORDED[door]:
        body = {**load(name)["body"], "model": family}
        for key in ("stream", "max_tokens", "max_output_tokens"):
            body.pop(key, None)
        status, _, reply = call(served, "POST", path, body)
        assert status == 200 and reply["input_tokens"] > 1000, (name, reply)


@pytest.mark.parametrize("shape", list(CLAUDE_CODE))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_claude_codes_thinking_shapes_are_answered_on_every_family_whole_and_streamed(served, family, shape):
    body = load(CLAUDE_CODE[shape])["body"]
    ask, _, first = DOORS["anthropic"]
    request = first(ASK)
    for stream in (False, True):
        _script(served, family)
        turn = ask(served.server.url, family, request, stream, thinking=body["thinking"], max_tokens=body["max_tokens"])
        _check_calls(family, turn, "anthropic", stream)
    assert not served.script


@pytest.mark.parametrize("family", [f for f in FAMILIES if not FAMILIES[f].reasons and not FAMILIES[f].thinking_kwarg])
def test_a_budget_for_a_family_that_does_not_reason_is_accepted_and_named(served, family):
    from server_support import call

    _script(served, family, answer=True)
    status, headers, reply = call(served, "POST", "/v1/messages", {
        "model": family, "max_tokens": 64, "messages": [{"role": "user", "content": ASK}],
        "thinking": {"type": "enabled", "budget_tokens": BUDGET}})
    assert status == 200 and reply["content"][-1]["text"].strip() == ANSWER, reply
    assert "thinking" in headers["x-mlx-stream-ignored"].split(", ")


class Writes:
    """A logits processor put before the plugin's own: the reply's token at each
    position `script(reply so far)` names is forced (None: the logits pass as they are),
    and the reply it saw is kept (mlx-lm computes a step past the end of the turn, so
    it holds the token that ended it)."""

    def __init__(self, script):
        self.script, self.prompt, self.reply = script, None, []

    def __call__(self, tokens, logits):
        import mlx.core as mx

        history = tokens.tolist()
        self.prompt = history if self.prompt is None else self.prompt
        self.reply = history[len(self.prompt):]
        token = self.script(self.reply)
        if token is None:
            return logits
        hit = mx.arange(logits.shape[-1]) == token
        return mx.where(hit, mx.zeros_like(logits), mx.full(logits.shape, -mx.inf, dtype=logits.dtype))


@pytest.fixture
def first(served, monkeypatch):
    """Processors the next generations run before their own, one each, in order."""
    from llm_mlx_streaming.engine.manager import get_manager

    engine, pending = get_manager(), []
    scripted = engine.run

    def run(load_spec, request):
        if pending:
            request.logits_processors.insert(0, pending.pop(0))
        return scripted(load_spec, request)

    monkeypatch.setattr(engine, "run", run)
    return pending


def _closing(family: str, tokenizer) -> tuple[list[int], list[int]]:
    """(the ids that open the family's reasoning, those that close it and begin the
    answer), from the text its model writes (fixtures/families.py)."""
    reply = native_reply(family, reasoning="\0", text="\1")
    opening, rest = reply.split("\0")
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    return encode(opening.rstrip("\n")), encode(rest.split("\1")[0])  # Gemma's line break is reasoning


def _position(reply: list[int], part: list[int]):
    return next((i for i in range(len(reply)) if reply[i:i + len(part)] == part), None)


@pytest.mark.parametrize("family", ["gpt_oss", "gemma4"])
def test_a_budget_ends_the_reasoning_with_the_familys_closing_tokens_and_the_answer_follows(served, first, family):
    tokenizer = served.tokenizer(family)
    opening, close = _closing(family, tokenizer)
    thought = tokenizer.encode(" ".join([THOUGHT] * 8), add_special_tokens=False)
    answer = tokenizer.encode(ANSWER, add_special_tokens=False) + [end_of_turn(family, tokenizer, False)]

    def script(reply):  # a thought that never ends by itself; once the budget ended it, the answer
        at = _position(reply[len(opening):], close[:1])  # the reasoning's end tag (forced)
        if at is None:
            return [*opening, *thought][len(reply)] if len(reply) < len(opening) + len(thought) else None
        done, rest = len(reply) - len(opening) - at - 1, [*close[1:], *answer]  # harmony's header: the model's
        return rest[done] if done < len(rest) else None  # mlx-lm computes a step past the end

    ask, _, ask_first = DOORS["anthropic"]
    for stream in (False, True):
        first.append(writes := Writes(script))
        turn = ask(served.server.url, family, ask_first(ASK), stream,
                   thinking={"type": "enabled", "budget_tokens": BUDGET})
        assert writes.reply == [*opening, *thought[:BUDGET], *close, *answer]
        assert turn.reasoning.strip() == tokenizer.decode(thought[:BUDGET]).strip()
        assert turn.text.strip() == ANSWER and not turn.calls, turn


@pytest.mark.parametrize("family", ["gpt_oss", "gemma4"])
def test_stock_mlx_lm_fed_the_same_forced_tokens_writes_the_same_reply(served, first, family):
    """Greedy, the reasoning opened and then free: the budget's closing tokens are the
    only other forced ones, and stock mlx-lm forced the same at the same places agrees
    (without tools: with them, what follows harmony's forced end is the model's choice
    of the answer or a call, test_format_harmony.py)."""
    from mlx_lm import load as stock_load

    opening, close = _closing(family, served.tokenizer(family))
    n = len(opening) + BUDGET + len(close) + 6
    writes = Writes(lambda reply: opening[len(reply)] if len(reply) < len(opening) else None)
    first.append(writes)
    DOORS["anthropic"][0](served.server.url, family, DOORS["anthropic"][2](ASK), False, tools=[],
                          extra_body={"temperature": 0}, max_tokens=n,
                          thinking={"type": "enabled", "budget_tokens": BUDGET})
    assert writes.reply[len(opening) + BUDGET:][:len(close)] == close
    forced = {**dict(enumerate(opening)), **{len(opening) + BUDGET + i: t for i, t in enumerate(close)}}
    stock = greedy_tokens(stock_load(str(served.paths[family]))[0], writes.prompt, n,
                          [Writes(lambda reply: forced.get(len(reply)))])
    assert len(writes.reply) > len(opening) + BUDGET + len(close)
    assert writes.reply == stock[:len(writes.reply)]


@pytest.mark.parametrize("family", ["gpt_oss", "gemma4", "qwen3"])
def test_a_reasoning_its_budget_closed_may_still_call_a_tool(served, first, family):
    """A model that meant to call a tool still can once its budget closed the reasoning:
    after the forced end (harmony's analysis channel; Gemma 4's thought; a think tag)
    it writes its call (harmony: a new message in the commentary channel, which the
    budget no longer forces to the final channel), given as a tool call by the API."""
    from llm_mlx_streaming.prompt.split import reasoning_of

    tokenizer = served.tokenizer(family)
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    opening, _ = _closing(family, tokenizer)
    thought = encode(" ".join([THOUGHT] * 8))
    end = reasoning_of(tokenizer).end  # the tag the budget forces
    called = native_reply(family, reasoning="\0", calls=CALLS[:1]).split("\0")[1]
    rest = [*encode(end), *encode(called[called.index(end) + len(end):]), end_of_turn(family, tokenizer, True)]

    def script(reply):  # a thought that never ends by itself; once the budget ended it, the call
        at = _position(reply[len(opening):], encode(end))
        if at is None:
            return [*opening, *thought][len(reply)] if len(reply) < len(opening) + len(thought) else None
        done = len(reply) - len(opening) - at
        return rest[done] if done < len(rest) else None

    ask, _, ask_first = DOORS["anthropic"]
    for stream in (False, True):
        first.append(writes := Writes(script))
        turn = ask(served.server.url, family, ask_first(ASK), stream,
                   thinking={"type": "enabled", "budget_tokens": BUDGET})
        assert writes.reply == [*opening, *thought[:BUDGET], *rest]
        assert turn.reasoning.strip() == tokenizer.decode(thought[:BUDGET]).strip()
        assert [(name, arguments) for _, name, arguments, _ in turn.calls] == CALLS[:1], turn
        assert turn.finish == "tool_use" and not turn.text.strip(), turn


def test_a_budget_that_cannot_bind_adds_nothing(served, first, family="gpt_oss"):
    """Claude Code's 31999 of 32000, scaled down: a reply of max_tokens would end before
    the budget, its closing tokens and a token of answer, so nothing is forced (harmony:
    the budget would otherwise bind, its opening is shorter than its closing)."""
    tokenizer = served.tokenizer(family)
    opening, close = _closing(family, tokenizer)
    thought = tokenizer.encode(" ".join([THOUGHT] * 8), add_special_tokens=False)
    script = [*opening, *thought]
    first.append(writes := Writes(lambda reply: script[len(reply)]))
    turn = DOORS["anthropic"][0](served.server.url, family, DOORS["anthropic"][2](ASK), False,
                                 max_tokens=BUDGET + len(close), thinking={"type": "enabled", "budget_tokens": BUDGET})
    assert writes.reply[:BUDGET + len(close)] == script[:BUDGET + len(close)]
    assert turn.finish == "max_tokens" and not turn.text.strip(), turn
