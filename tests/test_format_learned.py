"""Formats learned from chat templates (formats/learning.py, learned.py), checked against
the hand-written modules: every template of tests/data/templates is learned from alone,
and the format learned must read the family matrix's replies (fixtures/families.py) as
the family's module does, whole and streamed (calls, text, reasoning), and force the same
calls. Where learning cannot see what the module knows, the difference is named here and
in docs/formats.md ("What learning cannot see"), and the module wins."""

import json

import pytest
from format_support import WEATHER, accepts, family_tokenizer, forced, read_reply, rendered_call

from fixtures.families import FAMILIES, TEMPLATES, chat_format, chat_kwargs, native_reply, template
from llm_mlx_streaming.formats.learned import learned_format
from llm_mlx_streaming.formats.learning import learn
from llm_mlx_streaming.formats.registry import SPECIAL, set_format
from llm_mlx_streaming.prompt.split import reasoning_of

# What learning cannot see (the module wins), by family: learning finds no format and says why.
UNSEEN = {
    "kimi_k2_thinking": "the template writes a call without its function's name (an id where the name goes)",
    "kimi_k2": "the template renders no tool calls",
    "gpt_oss": "the template writes a turn with calls in another shape than one without "
               "(no markup after the turn's text opens them)",
}
# Where the forced calls differ: (a call the module forces and the learned format does not, or the
# other way round), and why.
FORCED_OTHERWISE = {
    # llama.cpp's glm_4_5.jinja lays calls out without the line breaks GLM-4.5 writes: learning
    # forces the template's layout, the module either
    "glm45": "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>",
    # the module forces [TOOL_CALLS]NAME[ARGS]{...}, Mistral's later form (mlx-lm's parser reads
    # both); learning forces the list this template renders (without the ids it renders)
    "mistral": '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',
    # the module closes the response block a turn's calls follow, as the template writes a turn;
    # learning sees the calls only, after an empty response block in every turn it compares
    "kimi_k3": '<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>'
               '<|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|><|close|>call<|sep|>'
               '<|close|>tools<|sep|>',
}
# Where the reasoning markers differ: Qwen3-Coder's template renders no reasoning (its
# tokenizer has Qwen3's think tags, which mlx-lm finds; the model does not think).
NO_REASONING_SHOWN = {"qwen3_coder"}
MODULES = sorted(f for f in FAMILIES if f != "seed_oss")  # seed_oss: no module, its format is learned
TOOLS = [WEATHER, {"type": "function", "function": {
    "name": "get_time", "description": "get_time something",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]
CALLS = [("get_weather", {"city": "Paris"}), ("get_time", {"city": "Paris", "days": 2})]
PARIS, ROME = ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})


def learned_from(family: str):
    """What learning finds in the family's template alone (with the special tokens its
    tokenizer config names, as the registry gives them)."""
    config = chat_format(family)["tokenizer_config"]
    return learn(template(family), {name: config[name] for name in SPECIAL if config.get(name)})


@pytest.fixture(scope="module")
def tokenizers():
    """tokenizers(family) -> (the family's tokenizer with its module's format, one with the
    format learned from its template), built once."""
    cache = {}

    def get(family):
        if family not in cache:
            learned = family_tokenizer(family)
            set_format(learned, learned_format(learned_from(family).learned))
            cache[family] = (family_tokenizer(family), learned)
        return cache[family]

    return get


def test_every_template_is_learned_or_says_in_one_line_why_not():
    by_file = {spec.template: family for family, spec in FAMILIES.items()}
    files = sorted(p.name for p in TEMPLATES.glob("*.jinja"))
    assert set(files) == set(by_file)  # every template is a family's
    for name in files:
        family = by_file[name]
        learning = learned_from(family)
        if family in UNSEEN:
            assert learning.learned is None and learning.note == UNSEEN[family], name
        else:
            assert learning.learned is not None and learning.note == "", (name, learning.note)


def _replies(family):
    """The family matrix's replies (fixtures/families.py): reasoning and calls, answer text,
    text and a call; with the generation prompt each follows."""
    reasoning = "I should look it up." if FAMILIES[family].reasons else None
    for case in (dict(reasoning=reasoning, calls=CALLS[:1] if family == "gpt_oss" else CALLS),
                 dict(text="It is sunny in Paris."), dict(reasoning=reasoning, text="Let me look.", calls=CALLS[1:])):
        yield case, native_reply(family, **case)


def _prompt(tokenizer, family, thinking: bool) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": "Weather?"}], tools=TOOLS, tokenize=False,
                                         add_generation_prompt=True, **chat_kwargs(family, thinking))[-200:]


def _read(tokenizer, pieces, prompt):
    reply = read_reply(tokenizer, pieces, TOOLS, prompt)
    return reply.text().strip(), reply.text("reasoning").strip(), reply.found(), reply


@pytest.mark.parametrize("family", [f for f in MODULES if f not in UNSEEN])
def test_the_learned_format_reads_the_familys_replies_as_its_module_does_whole_and_streamed(tokenizers, family):
    module, learned = tokenizers(family)
    for case, text in _replies(family):
        prompt = _prompt(module, family, case.get("reasoning") is not None)
        *expected, _ = _read(module, [text], prompt)
        assert [(c["name"], c["arguments"]) for c in expected[2]] == [tuple(c) for c in case.get("calls", ())]
        for pieces in ([text], list(text)):
            *found, reply = _read(learned, pieces, prompt)
            assert found == expected, (case, len(pieces))
            assert reply.arguments() == [c["arguments"] for c in reply.found()]  # the pieces make the JSON
        if case.get("calls"):  # streamed: the first call's name comes before its block closes
            start, end = learned.tool_call_start, learned.tool_call_end
            assert reply.when("name")[0] < (text.index(end, text.index(start)) if end else len(text) - 1)


@pytest.mark.parametrize("family", [f for f in MODULES if f not in UNSEEN])
def test_the_learned_format_finds_the_reasoning_markers_the_module_reads(tokenizers, family):
    module, _ = tokenizers(family)
    marks = learned_from(family).learned.reasoning
    if family in NO_REASONING_SHOWN:
        assert marks is None and not FAMILIES[family].reasons
    else:
        assert marks == reasoning_of(module)


def _forced_texts(tokenizer, family):
    """({name: a get_weather call as the family writes it, as its template renders it},
    {name: a reply that is not one})."""
    def markup(text):
        return text[text.index(tokenizer.tool_call_start):] if tokenizer.tool_call_start in text else text

    def rendered(*cities):
        for written in (lambda c: {"city": c}, lambda c: json.dumps({"city": c})):  # DeepSeek-V3.1's: JSON text
            try:
                return rendered_call(tokenizer, [{"name": "get_weather", "arguments": written(c)} for c in cities],
                                     [WEATHER])
            except Exception:  # the template's own error
                continue
        raise AssertionError(f"{family}'s template renders no calls")

    calls = {"written": markup(native_reply(family, calls=[PARIS])),
             "written, two": markup(native_reply(family, calls=[PARIS, ROME])),
             "rendered": rendered("Paris"), "rendered, two": rendered("Paris", "Rome")}
    other = {"text": "Paris is sunny.", "another function": markup(native_reply(family, calls=[("get_time", {"city": "Paris"})])),
             "cut short": calls["written"][:-3]}
    return calls, other


@pytest.mark.parametrize("family", [f for f in MODULES if f not in UNSEEN])
def test_the_learned_format_forces_the_calls_its_module_forces(tokenizers, family):
    module, learned = tokenizers(family)
    by_module, by_learned = forced(module, [WEATHER]), forced(learned, [WEATHER])
    calls, other = _forced_texts(learned, family)
    for name, text in {**({} if family in FORCED_OTHERWISE else calls), **other}.items():
        assert accepts(module, by_module, text) == accepts(learned, by_learned, text), name
    named = forced(learned, [WEATHER, TOOLS[1]], choice="get_time")
    assert not accepts(learned, named, calls["written"])
    if family in FORCED_OTHERWISE:
        text = FORCED_OTHERWISE[family]
        assert accepts(module, by_module, text) != accepts(learned, by_learned, text)


def test_a_family_no_module_knows_is_learned_and_its_calls_read_streamed_and_forced():
    """Seed-OSS: <seed:tool_call> blocks of <function=NAME> and <parameter=KEY>VALUE</parameter>,
    values other than strings as Python writes them, reasoning in <seed:think>."""
    tokenizer = family_tokenizer("seed_oss")
    fmt = tokenizer.tool_format
    assert fmt.origin == "learned" and fmt.name == "learned" and fmt.grammar is not None
    assert (tokenizer.tool_call_start, tokenizer.tool_call_end) == ("<seed:tool_call>", "</seed:tool_call>")
    assert (tokenizer.think_start, tokenizer.think_end) == ("<seed:think>", "</seed:think>")  # mlx-lm knows none
    typed = {"type": "function", "function": {"name": "book", "description": "", "parameters": {
        "type": "object", "required": ["title", "copies", "gift"],
        "properties": {"title": {"type": "string"}, "copies": {"type": "integer"}, "gift": {"type": "boolean"}}}}}
    arguments = {"title": "Dune", "copies": 2, "gift": True}
    text = native_reply("seed_oss", reasoning="Books.", text="One moment.", calls=[("book", arguments), PARIS])
    for pieces in ([text], list(text)):
        reply = read_reply(tokenizer, pieces, [typed, WEATHER])
        assert reply.found() == [{"name": "book", "arguments": arguments}, {"name": "get_weather",
                                                                             "arguments": {"city": "Paris"}}]
        assert reply.arguments() == [arguments, {"city": "Paris"}]
        assert reply.text("reasoning") == "Books." and reply.text().strip() == "One moment."
    assert reply.when("name")[0] < text.index("</seed:tool_call>")
    grammar = forced(tokenizer, [typed], choice="book")
    call = text[text.index("<seed:tool_call>"):text.index("</seed:tool_call>") + len("</seed:tool_call>")]
    assert accepts(tokenizer, grammar, call)
    assert not accepts(tokenizer, grammar, call.replace("book", "look"))
    assert not accepts(tokenizer, grammar, call.replace("True", "yes"))


@pytest.mark.parametrize("template_text,note", [
    ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}", "the template renders no tool calls"),
    ("{% for m in messages %}{{ m.role }}: {{ m.content }}{% for c in m.tool_calls or [] %} calling "
     "{{ c.function.name }} with {{ c.function.arguments | tojson }}{% endfor %}\n{% endfor %}",
     "a call is not opened by markup"),
    ("{% for m in messages %}{{ m.content }}{% if m.tool_calls %}<call>{{ m.tool_calls[0].function.name }} "
     "{{ m.tool_calls[0].function.arguments | tojson }}</call>{% endif %}{% endfor %}",
     "the template does not render two calls of one turn"),
])
def test_a_template_learning_cannot_read_is_said_so_in_one_line_and_nothing_is_guessed(template_text, note):
    learning = learn(template_text, {})
    assert learning.learned is None and learning.note == note


def test_a_learned_format_is_what_the_registry_finds_for_a_template_nobody_named():
    """No module of ours and no parser of mlx-lm's knows Seed-OSS's markup; one of ours
    knowing a family (Laguna, before mlx-lm's inference takes its template for GLM's)
    wins over learning and over mlx-lm's inference."""
    assert family_tokenizer("seed_oss").tool_format.origin == "learned"
    laguna = family_tokenizer("laguna")
    assert laguna.init_kwargs["tool_parser_type"] == "glm47" and laguna.tool_format.name == "laguna"
