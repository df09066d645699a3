"""Every MoE family's own chat template and tool-call format, through every door of
`llm mlxs serve` and through llm itself: a tiny checkpoint per family carries the
family's real template and special tokens (fixtures/families.py), and its reply is
forced to what the family's model writes (a reasoning block where it thinks, then two
parallel calls, or one where a turn holds one; after the results, an answer). Each API
must give the reasoning as its own reasoning, the calls as its own tool calls (streamed
as they are written, whole when not streamed), no markup in the text, and render the
round trip (the calls and their results back in the template's terms). The recorded
Claude Code and Codex requests must render for every family (their token counts)."""

from __future__ import annotations

import json

import llm
import pytest

from doors_support import ASK, DOORS, TOOLS, Turn
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
RECORDED = {"anthropic": ("claude_code_turn1", "claude_code_tool_result"), "responses": ("codex_turn1", "codex_tool_output")}
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
