"""What the tool-call format tests (tests/test_format_*.py) share.

- `family_tokenizer`: a real tokenizer with a family's tokens and real chat template
  (fixtures/families.py), loaded through mlx-lm as a checkpoint's is (mlx-lm infers the
  parser from the template, then `formats.registry.install` gives it our format). Build
  it once per module.
- `read_reply` and `every_way`: a reply's text, fed in pieces, split by
  `prompt.split.ReplySplitter` and its calls read by `prompt.tools.CallReader` as
  reply/core.py's Replier does.
- `forced`, `matcher` and `accepts`: a forced-call grammar, llguidance's matcher of a
  grammar over the tokenizer, and whether it takes a text whole.
- `assert_forces_one_call_or_the_named_one` and `assert_a_forced_call_waits_for_the_thought`:
  what every format's forced grammar must take and refuse.
- `opening_states`: where a reply starts after the prompt, with thinking on and off.
- `rendered_call`: the calls as the real template writes them in an earlier turn.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

from llm_mlx_streaming.prompt.tools import function_spec


def family_tokenizer(family: str, special: tuple[str, ...] = (), **fields):
    """mlx-lm's TokenizerWrapper for a family of fixtures/families.py: the tiny BPE of
    fixtures/tokenizer.py with the family's added tokens (and `special` ones more), its
    tokenizer_config.json fields (bos/eos/pad/unk, the real chat template; `fields`
    replace or add some) and the tokens its turns end at."""
    from mlx_lm.tokenizer_utils import load

    from fixtures.families import chat_format
    from fixtures.tokenizer import token_ids, write_tokenizer
    from llm_mlx_streaming.formats.registry import install

    spec = chat_format(family)
    added = tuple((token, is_special) for token, is_special in spec["tokens"]) + tuple((t, True) for t in special)
    ids = token_ids("tiny", added)
    with tempfile.TemporaryDirectory() as directory:
        write_tokenizer(Path(directory), added=added, fields={**spec["tokenizer_config"], **fields})
        tokenizer = load(Path(directory), eos_token_ids=[ids[t] for t in spec["eos_tokens"]])
    install(tokenizer)
    return tokenizer


def tool(name: str, properties: dict, required: Optional[Iterable[str]] = None) -> dict:
    """A function spec as the template and the parsers get it (all parameters required
    unless `required` says otherwise)."""
    return function_spec(name, f"{name} something", {
        "type": "object", "properties": properties, "required": list(properties if required is None else required)})


WEATHER = tool("get_weather", {"city": {"type": "string"}})
# A parameter of each JSON type.
TYPED = tool("book", {"title": {"type": "string"}, "copies": {"type": "integer"}, "price": {"type": "number"},
                      "gift": {"type": "boolean"},
                      "shelf": {"type": "object", "properties": {"row": {"type": "integer"}}},
                      "tags": {"type": "array", "items": {"type": "string"}}})
TYPED_ARGUMENTS = {"title": "Dune", "copies": 2, "price": 9.5, "gift": True, "shelf": {"row": 3},
                   "tags": ["sf", "classic"]}
ADD = tool("add", {"a": {"type": "number"}, "b": {"type": "number"}})
# Arguments of every JSON type, null and a string to escape among them, for the formats
# that write arguments as JSON whatever the schema says.
EVERY_TYPE = {"text": "Paris, \"France\" <b>", "count": 3, "ratio": -0.5, "flag": True, "none": None,
              "list": [1, "two", [3]], "object": {"nested": {"deep": False}}}


@dataclass
class Reply:
    """What a reply was read into: the events in order (("text" | "reasoning", chunk),
    ("name", id, name), ("arguments", id, piece)), the index of the piece fed when each
    came (`at`; the number of pieces for those of the end), and the calls at the end."""

    events: list = field(default_factory=list)
    at: list = field(default_factory=list)
    calls: list = field(default_factory=list)

    def text(self, kind: str = "text") -> str:
        return "".join(e[1] for e in self.events if e[0] == kind)

    def found(self) -> list[dict]:
        """The calls, as {"name", "arguments"}."""
        return [{"name": c["name"], "arguments": c["arguments"]} for c in self.calls]

    def names(self) -> list[str]:
        return [e[2] for e in self.events if e[0] == "name"]

    def arguments(self) -> list:
        """Each call's streamed argument pieces joined and parsed, in call order."""
        ids = [e[1] for e in self.events if e[0] == "name"]
        return [json.loads("".join(e[2] for e in self.events if e[0] == "arguments" and e[1] == i)) for i in ids]

    def when(self, kind: str) -> list[int]:
        """The pieces at which events of a kind came, in order."""
        return [at for at, e in zip(self.at, self.events) if e[0] == kind]


def read_reply(tokenizer, pieces: Iterable[str], tools: list[dict], generation_prompt: str = "") -> Reply:
    """The reply `pieces` make, ended by the model's end-of-turn token (which closes a
    block left open), read as reply/core.py's Replier reads it."""
    from llm_mlx_streaming.prompt.split import TOOL, TOOL_TEXT, UNFINISHED_TOOL, ReplySplitter, initial_state
    from llm_mlx_streaming.prompt.tools import CallReader

    splitter = ReplySplitter(tokenizer, initial_state(tokenizer, generation_prompt))
    reader = CallReader(tokenizer, tools)
    reply = Reply()

    def take(at: int, kind: str, chunk: str) -> None:
        events = []
        if kind == TOOL_TEXT:
            events = reader.piece(chunk)
        elif kind in (TOOL, UNFINISHED_TOOL):
            closed = reader.close(chunk, finished=kind == TOOL)
            if closed is None:
                end = tokenizer.tool_call_end if kind == TOOL else ""
                events = [("text", f"{tokenizer.tool_call_start}{chunk}{end}")]
            else:
                events = closed[0]
                reply.calls.extend(closed[1])
        elif chunk:
            events = [(kind, chunk)]
        reply.events.extend(events)
        reply.at.extend([at] * len(events))

    n = 0
    for n, piece in enumerate(pieces):
        for kind, chunk in splitter.feed(piece):
            take(n, kind, chunk)
    for kind, chunk in splitter.flush():
        take(n + 1, TOOL if kind == UNFINISHED_TOOL else kind, chunk)
    return reply


def every_way(tokenizer, text: str, tools: list[dict], generation_prompt: str = "") -> Iterable[tuple]:
    """(pieces, the Reply they make) for the text cut in two at every position, then in
    one-character pieces (the last)."""
    for i in range(1, len(text)):
        yield [text[:i], text[i:]], read_reply(tokenizer, [text[:i], text[i:]], tools, generation_prompt)
    yield list(text), read_reply(tokenizer, list(text), tools, generation_prompt)


def forced(tokenizer, tools: list[dict], choice: str = "required", parallel: Optional[bool] = None,
           thinking: bool = False) -> str:
    """The grammar that forces the reply to be calls of `tools`, as the server asks it."""
    from llm_mlx_streaming.prompt.tools import forced_call_grammar

    return forced_call_grammar(tokenizer, tools, choice, parallel=parallel, thinking=thinking)


def matcher(tokenizer, grammar: str):
    """llguidance's matcher of `grammar` over the tokenizer, ending at the tokens its
    turns end at (as prompt/constrained.py builds it)."""
    import llguidance

    from llm_mlx_streaming.prompt.constrained import ll_tokenizer

    hf = tokenizer._tokenizer
    return llguidance.LLMatcher(ll_tokenizer(hf, len(hf), sorted(tokenizer.eos_token_ids)), grammar, log_level=0)


def accepts(tokenizer, grammar: str, text: str) -> bool:
    """Whether a reply of exactly `text` (encoded as the model writes it: each tag its
    own token) is one the grammar allows, through to its end."""
    m = matcher(tokenizer, grammar)
    return m.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and m.is_accepting()


def assert_forces_one_call_or_the_named_one(tokenizer, tools: list[dict], paris: str, two: str, book: str) -> None:
    """The grammar forcing a single call takes the get_weather call `paris` and not the
    calls `two`; the one forcing `book` takes the call `book` and not `paris`."""
    one = forced(tokenizer, tools, parallel=False)
    assert accepts(tokenizer, one, paris) and not accepts(tokenizer, one, two), "a single call"
    named = forced(tokenizer, tools, choice="book")
    assert accepts(tokenizer, named, book) and not accepts(tokenizer, named, paris), "the named call"


def assert_a_forced_call_waits_for_the_thought(tokenizer, thought: str, paris: str) -> None:
    """The grammar forcing a get_weather call with thinking on takes `paris` once
    `thought` has closed the think block, and not while it is open."""
    grammar = forced(tokenizer, [WEATHER], thinking=True)
    assert accepts(tokenizer, grammar, thought + paris), "a call after the thought"
    assert not accepts(tokenizer, grammar, paris), "a call inside the think block"


def opening_states(tokenizer) -> tuple[str, str]:
    """Where a reply starts (prompt.split's initial state) after the template's generation
    prompt with enable_thinking on, then off."""
    from llm_mlx_streaming.prompt.split import initial_state

    user = [{"role": "user", "content": "Hi"}]
    return tuple(initial_state(tokenizer, tokenizer.apply_chat_template(
        user, tokenize=False, add_generation_prompt=True, enable_thinking=on)) for on in (True, False))


def rendered_call(tokenizer, calls: list[dict], tools: list[dict], ids: Optional[list[str]] = None) -> str:
    """What the real template writes for an assistant turn making `calls` ([{"name",
    "arguments"}], with `ids` or ids of nine digits): from its tool-call start tag through
    its last end tag (where the format has none, up to the end of the turn)."""
    ask, thanks = "@ask@", "@thanks@"
    ids = ids or [f"{i:09d}" for i in range(len(calls))]
    messages = [{"role": "user", "content": ask},
                {"role": "assistant", "content": "",
                 "tool_calls": [{"id": i, "type": "function", "function": c} for i, c in zip(ids, calls)]},
                {"role": "user", "content": thanks}]
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    turn = text[text.index(ask) + len(ask):text.index(thanks)]
    start, end = turn.index(tokenizer.tool_call_start), tokenizer.tool_call_end
    return turn[start:turn.rindex(end) + len(end)] if end else turn[start:turn.index(tokenizer.eos_token, start)]
