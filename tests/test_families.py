"""The MoE families' chat formats (fixtures/families.py): each family's checkpoint loads
with mlx-lm, keeps the family's tokens whole and renders its real template, a model made
to write the family's native reply writes exactly that text and stops at the family's
end of turn, and the replies are the markup the templates render for an earlier turn."""

import json
import re

import mlx_lm
import pytest

from fixtures.families import (
    FAMILIES,
    build_family_checkpoint,
    chat_kwargs,
    end_of_turn,
    native_reply,
    template,
)
from fixtures.scripted import Force

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris and in Rome?"}]
PARIS, ROME = ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})
REASONING = "The user wants the weather in two cities."

# What each template's generation prompt ends with after the question, reasoning on and
# off: the text native_reply continues.
PROMPT_ENDS = {
    "qwen3": ("<|im_end|>\n<|im_start|>assistant\n",
              "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"),
    "qwen3_coder": ("<|im_end|>\n<|im_start|>assistant\n",) * 2,
    "glm45": ("<|assistant|>", "/nothink<|assistant|>\n<think></think>"),
    "glm46": ("<|assistant|>", "/nothink<|assistant|>\n<think></think>"),
    "minimax_m2": ("[e~[\n]~b]ai\n<think>\n",) * 2,
    "kimi_k2_thinking": ("<|im_end|><|im_assistant|>assistant<|im_middle|>",) * 2,
    "kimi_k2": ("<|im_end|><|im_assistant|>assistant<|im_middle|>",) * 2,
    "lfm2": ("<|im_end|>\n<|im_start|>assistant\n",) * 2,
    "step3": ("<|im_end|>\n<|im_start|>assistant\n<think>\n",) * 2,
    "deepseek_v31": ("<｜Assistant｜><think>", "<｜Assistant｜></think>"),
    # the template opens the assistant turn twice: after the question and again
    "deepseek_v32": ("<｜Assistant｜><think><｜User｜>\n<｜Assistant｜><think>",
                     "<｜Assistant｜></think><｜User｜>\n<｜Assistant｜></think>"),
    "gemma4": ("<turn|>\n<|turn>model\n", "<turn|>\n<|turn>model\n<|channel>thought\n<channel|>"),
    "mistral": ("[/INST]",) * 2,
    "gpt_oss": ("<|end|><|start|>assistant",) * 2,
    "kimi_k3": ('<|close|>message<|sep|><|end_of_msg|><|open|>message role="assistant"<|sep|><|open|>think<|sep|>',
                '<|close|>message<|sep|><|end_of_msg|><|open|>message role="assistant"<|sep|><|open|>response<|sep|>'),
    "laguna": ("\n</user>\n<assistant>\n<think>", "\n</user>\n<assistant>\n</think>"),
    "seed_oss": ("<seed:eos><seed:bos>assistant\n",) * 2,
}


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """loaded(family) -> (path, model, tokenizer) of the family's checkpoint, built once."""
    cache = {}

    def get(family):
        if family not in cache:
            path = build_family_checkpoint(tmp_path_factory.mktemp(family), family)
            cache[family] = (path, *mlx_lm.load(str(path)))
        return cache[family]

    return get


def prompt(tokenizer, family, reasoning: bool, tokenize=False):
    return tokenizer.apply_chat_template(ASK, tools=[WEATHER], add_generation_prompt=True,
                                         tokenize=tokenize, **chat_kwargs(family, reasoning))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_checkpoint_loads_with_the_familys_template_and_tokens(loaded, family):
    path, model, tokenizer = loaded(family)
    spec = FAMILIES[family]
    assert tokenizer.has_chat_template and tokenizer.chat_template == template(family)
    for token in spec.tokens:
        ids = tokenizer.encode(token, add_special_tokens=False)
        assert ids == [tokenizer.convert_tokens_to_ids(token)], token
        # a decode that skips special tokens drops the special ones, keeps the others
        kept = tokenizer.decode(ids, skip_special_tokens=True)
        assert kept == ("" if token in spec.special else token), token
    assert tokenizer.eos_token == spec.eos_token and tokenizer.bos_token == spec.bos_token
    eos_ids = [tokenizer.convert_tokens_to_ids(t) for t in spec.eos_tokens]
    generation = json.loads((path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == eos_ids
    assert set(eos_ids) <= tokenizer.eos_token_ids  # mlx-lm stops at each
    config = json.loads((path / "config.json").read_text())
    assert config["eos_token_id"] == tokenizer.eos_token_id
    assert len(tokenizer) <= config["vocab_size"] == model.model.embed_tokens.weight.shape[0]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_template_renders_a_tool_prompt_with_the_generation_prompt(loaded, family):
    _, _, tokenizer = loaded(family)
    for reasoning, end in zip((True, False), PROMPT_ENDS[family]):
        text = prompt(tokenizer, family, reasoning)
        # DeepSeek-V3.1's template leaves tool declarations to the system message
        assert ("get_weather" in text) == (family != "deepseek_v31")
        assert text.endswith(ASK[0]["content"] + end), (reasoning, text[-120:])


def _cases(family):
    can_reason = FAMILIES[family].reasons
    calls = (PARIS,) if family == "gpt_oss" else (PARIS, ROME)
    yield "calls", dict(reasoning=REASONING if can_reason else None, calls=calls)
    yield "text", dict(text="It is sunny in Paris and raining in Rome.")
    yield "text and call", dict(reasoning=REASONING if can_reason else None,
                                text="Let me look that up.", calls=(ROME,))


@pytest.mark.parametrize("family,case,reply", [
    (family, case, kwargs) for family in sorted(FAMILIES) for case, kwargs in _cases(family)])
def test_forced_generation_writes_the_native_reply_and_ends_the_turn(loaded, family, case, reply):
    _, model, tokenizer = loaded(family)
    text = native_reply(family, **reply)
    ids = tokenizer.encode(text, add_special_tokens=False)
    stop = end_of_turn(family, tokenizer, calls=bool(reply.get("calls")))
    ask = prompt(tokenizer, family, reply.get("reasoning") is not None, tokenize=True)
    responses = list(mlx_lm.stream_generate(model, tokenizer, ask, max_tokens=len(ids) + 8,
                                            logits_processors=[Force(ids + [stop])]))
    assert "".join(r.text for r in responses) == text
    assert [r.token for r in responses[:-1]] == ids
    assert responses[-1].token == stop and responses[-1].finish_reason == "stop"


# -- the replies against the templates ------------------------------------------------

# Where a template renders an earlier assistant turn the way the model writes it. Not:
# glm45 (llama.cpp's glm_4_5.jinja drops the newlines around <arg_key>/<arg_value>),
# kimi_k2 (the template drops tool calls), gpt_oss (the template writes the recipient in
# the role, `<|start|>assistant to=functions.x<|channel|>commentary json`, where the model
# writes `<|channel|>commentary to=functions.x <|constrain|>json`).
RENDERS_CALLS = sorted(set(FAMILIES) - {"glm45", "kimi_k2", "gpt_oss"})
# Templates that render content before the calls (gemma4 puts the calls first, mistral
# drops the content of a message with calls).
RENDERS_TEXT_WITH_CALLS = sorted(set(RENDERS_CALLS) - {"gemma4", "mistral"})
# Templates that render the last turn's reasoning, and the message field they read.
REASONING_FIELD = {"qwen3": "reasoning_content", "glm46": "reasoning_content",
                   "minimax_m2": "reasoning_content", "kimi_k2_thinking": "reasoning_content",
                   "step3": "reasoning_content", "deepseek_v32": "reasoning_content",
                   "lfm2": "thinking", "kimi_k3": "reasoning_content", "laguna": "reasoning_content",
                   "seed_oss": "reasoning_content"}


def assistant(family, calls, text, reasoning):
    """An earlier assistant turn in the shape the family's template takes."""
    tool_calls = []
    for i, (name, args) in enumerate(calls):
        call_id = f"functions.{name}:{i}" if family.startswith("kimi") else f"call{i}abcdefgh"
        arguments = json.dumps(args) if family == "deepseek_v31" else args  # it concatenates
        tool_calls.append({"id": call_id, "type": "function",
                           "function": {"name": name, "arguments": arguments}})
    message = {"role": "assistant", "content": text, "tool_calls": tool_calls}
    if reasoning is not None:
        message[REASONING_FIELD[family]] = reasoning
    return message


@pytest.mark.parametrize("family,with_text", [(f, False) for f in RENDERS_CALLS]
                         + [(f, True) for f in RENDERS_TEXT_WITH_CALLS])
def test_the_native_reply_is_how_the_template_renders_an_earlier_turn(loaded, family, with_text):
    _, _, tokenizer = loaded(family)
    reasoning = REASONING if family in REASONING_FIELD else None
    text = "Let me look that up." if with_text else ""
    turn = assistant(family, (PARIS, ROME), text, reasoning)
    rendered = tokenizer.apply_chat_template(ASK + [turn], tools=[WEATHER], tokenize=False,
                                             **chat_kwargs(family, reasoning is not None))
    if family == "mistral":  # the template writes back the ids the server gave the calls
        rendered = re.sub(r', "id": "\w+"', "", rendered)
    expected = native_reply(family, reasoning=reasoning, calls=(PARIS, ROME), text=text)
    assert expected in rendered, rendered[-600:]


def _segments(text, start, end):
    """The text between each start marker and its end marker (to the end without one)."""
    pieces = text.split(start)[1:]
    return [piece.split(end)[0] if end else piece for piece in pieces]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_mlx_lms_own_parser_reads_the_native_calls_back(loaded, family):
    _, _, tokenizer = loaded(family)
    if tokenizer.tool_parser is None:  # deepseek_v31/v32, kimi_k2, gpt_oss, seed_oss: none inferred
        assert family in {"deepseek_v31", "deepseek_v32", "kimi_k2", "gpt_oss", "seed_oss"}
        return
    reasoning = REASONING if FAMILIES[family].reasons else None
    reply = native_reply(family, reasoning=reasoning, text="Let me look.", calls=(PARIS, ROME))
    parsed = []
    for segment in _segments(reply, tokenizer.tool_call_start, tokenizer.tool_call_end):
        result = tokenizer.tool_parser(segment, [WEATHER])
        parsed += result if isinstance(result, list) else [result]
    assert [(c["name"], c["arguments"]) for c in parsed] == [PARIS, ROME]
