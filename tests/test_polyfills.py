"""What a real client sends, rendered by a real family's template (prompt/polyfills.py):
each fill-in applies where that template needs it, and leaves a template that renders
the request as it is untouched."""

from __future__ import annotations

import json

import pytest

from fixtures.families import build_family_checkpoint
from llm_mlx_streaming.prompt.messages import PromptError
from llm_mlx_streaming.prompt.polyfills import fill_in

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
# Claude Code's tools have parameters with a description and no type
UNTYPED = {"type": "function", "function": {"name": "Workflow", "description": "Run a workflow", "parameters": {
    "type": "object", "properties": {"spec": {"description": "anything"}, "steps": {"items": {"type": "string"}}}}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
ROUND_TRIP = [{"role": "user", "content": "Weather in Paris?"},
              {"role": "assistant", "content": "", "tool_calls": [CALL]},
              {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": '{"temperature": 18}'}]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    from mlx_lm.utils import load_tokenizer

    root = tmp_path_factory.mktemp("polyfills")
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = load_tokenizer(build_family_checkpoint(root / family, family))
        return cache[family]

    return get


def _render(tokenizer, messages, tools=None):
    def rendered(msgs, shown):
        return tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False,
                                             **({"tools": shown} if shown else {}))

    messages, tools, text = fill_in(tokenizer, messages, tools, rendered)
    return text, messages, tools


def test_a_template_that_renders_the_request_gets_it_untouched(tokenizers):
    text, messages, tools = _render(tokenizers("qwen3"), ROUND_TRIP, [WEATHER, UNTYPED])
    assert messages == ROUND_TRIP and tools == [WEATHER, UNTYPED]
    assert '"spec": {"description": "anything"}' in text


def test_gemma4_gets_tool_results_in_the_calling_turn(tokenizers):
    text, messages, tools = _render(tokenizers("gemma4"), ROUND_TRIP, [WEATHER])
    assert "<|turn>tool" not in text
    assert "<|tool_response>response:get_weather{temperature:18}<tool_response|>" in text
    assert messages[1]["tool_responses"] == [{"name": "get_weather", "response": {"temperature": 18}}]


def test_gemma4_renders_claude_codes_tools(tokenizers):
    from fixtures.traffic import chat_view, load

    messages, tools = chat_view(load("claude_code_turn1"))
    text, _, _ = _render(tokenizers("gemma4"), messages, tools)
    assert "declaration:Bash" in text and "declaration:Workflow" in text


def test_an_untyped_parameter_is_typed_only_when_the_template_fails_without_a_type(tokenizers):
    tokenizer = tokenizers("qwen3")
    strict = "{% for t in tools %}{{ t.function.parameters.properties.spec.type | upper }}{% endfor %}{{ messages[0].content }}"

    def rendered(msgs, shown):
        from jinja2 import StrictUndefined, Template

        return Template(strict, undefined=StrictUndefined).render(messages=msgs, tools=shown or [])

    _, tools, _ = fill_in(tokenizer, [{"role": "user", "content": "hi"}], [UNTYPED], rendered)
    assert tools[0]["function"]["parameters"]["properties"]["spec"]["type"] == "string"


def test_a_parameter_gets_the_type_its_schema_implies():
    from llm_mlx_streaming.prompt.polyfills import type_properties

    _, (tool,) = type_properties(None, [], [UNTYPED])
    spec = tool["function"]["parameters"]["properties"]
    assert spec["spec"]["type"] == "string" and spec["steps"]["type"] == "array"


def test_deepseek_v31_gets_its_tools_described_in_a_system_message_and_the_arguments_as_json_text(tokenizers):
    text, messages, _ = _render(tokenizers("deepseek_v31"), ROUND_TRIP, [WEATHER])
    assert messages[0]["role"] == "system" and "### get_weather\nDescription: The weather" in messages[0]["content"]
    assert text.startswith("<｜begin▁of▁sentence｜>## Tools\n")  # its template renders no `tools`
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'
    assert 'get_weather<｜tool▁sep｜>{"city": "Paris"}' in text


def test_mistral_gets_nine_character_ids_the_same_for_a_call_and_its_result(tokenizers):
    text, messages, _ = _render(tokenizers("mistral"), ROUND_TRIP, [WEATHER])
    call_id = messages[1]["tool_calls"][0]["id"]
    assert len(call_id) == 9 and call_id.isalnum() and messages[2]["tool_call_id"] == call_id
    assert _render(tokenizers("mistral"), ROUND_TRIP, [WEATHER])[1] == messages  # the same every time


def test_mistral_takes_a_later_system_message_as_part_of_the_users_turn(tokenizers):
    asked = [{"role": "user", "content": "Hi"}, {"role": "system", "content": "Be brief."}]
    text, messages, _ = _render(tokenizers("mistral"), asked)
    assert messages == [{"role": "user", "content": "Hi\n\nBe brief."}]


OPENING = [{"role": "system", "content": "Be brief."}, {"role": "system", "content": "Answer in French."},
           {"role": "user", "content": "Hi"}]


def test_opening_system_messages_are_joined_only_where_the_template_drops_or_refuses_the_second(tokenizers):
    for family in ("gpt_oss", "mistral"):  # gpt-oss renders the first only; Mistral refuses the second
        text, messages, _ = _render(tokenizers(family), OPENING)
        assert messages[0] == {"role": "system", "content": "Be brief.\n\nAnswer in French."}, family
        assert "Be brief.\n\nAnswer in French." in text
    text, messages, _ = _render(tokenizers("qwen3"), OPENING)
    assert messages == OPENING and "Answer in French." in text


def test_kimi_k2_gets_its_own_call_ids_and_the_instruct_template_the_calls_inline(tokenizers):
    text, messages, _ = _render(tokenizers("kimi_k2_thinking"), ROUND_TRIP, [WEATHER])
    assert "<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>" in text
    assert messages[2]["tool_call_id"] == "functions.get_weather:0"
    text, messages, _ = _render(tokenizers("kimi_k2"), ROUND_TRIP, [WEATHER])
    assert ('<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
            '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>') in text


def test_a_template_that_still_fails_is_one_line_naming_its_error(tokenizers):
    tokenizer = tokenizers("mistral")
    images = [{"role": "user", "content": [{"type": "audio", "audio": "x"}]}]
    with pytest.raises(PromptError, match=r"^the model's chat template cannot render this conversation: "
                                          r"TemplateError: Only text and image blocks") as e:
        _render(tokenizer, images)
    assert "\n" not in str(e.value) and json.dumps(str(e.value))
