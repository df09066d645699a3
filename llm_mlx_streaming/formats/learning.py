"""Learning a checkpoint's tool-call format from its chat template, as llama.cpp's
autoparser does (ggml-org/llama.cpp PR #18675): probe conversations are rendered through
the template, in the Jinja environment the engine renders prompts with (transformers'
`render_jinja_template`, which `apply_chat_template` calls), and the renderings compared.
A template is the model's own statement of its format: a model writes its calls the way
its template renders them.

- Reasoning: an assistant turn with and without reasoning, with the template's thinking
  switch on and off, and the generation prompt on and off: the markup around the thought.
- Calls: a turn without calls, with one and with two: the markup the calls add, where a
  call's name is (inside a JSON object, or in markup before its arguments), where a
  block starts and ends, what separates two calls, whether each has a block of its own.
- Arguments: one and two arguments of each type, and none: where a key and a value are,
  what closes them, what separates two, how values other than strings are written.

What the probes cannot separate is said in one line (`Learning.note`), and nothing is
guessed: the format learned must read its own probes back. learned.py is what the
result is made of.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from dataclasses import dataclass
from typing import Optional

from .learned import COUNTER, JSON_ARGUMENTS, OBJECT, TAGGED, Call, Learned, Tagged, json_values
from .tool_format import ReasoningMarks

# Markup: <tag>, <|token|>, <｜token｜>, [TOKEN]
MARKER = re.compile(r"<[^<>\s]*(?:\s[^<>]*)?>|\[[^\[\]\s]+\]")
WORDED = re.compile(r"[\w:.\-]+(?=<|\[)")  # a word inside a group of markup, before its next tag
OPENS = re.compile(r"<(?=[\w|｜/])|\[(?=[\w/])")  # where markup begins, closed or not (<function=, <|open|>call tool=")
USER = {"role": "user", "content": "USERMSG"}
THOUGHT, ANSWER = "THOUGHTS", "ANSWERTEXT"
ONE, TWO = ("foofoo", "barbar")
ON = {"enable_thinking": True, "thinking": True}
OFF = {"enable_thinking": False, "thinking": False}
# One argument of each kind, a second of the same kind (keys in the order of their names),
# and how a value of the kind may be written
PROBES = {
    "string": (("first", "XXXX"), ("second", "ZZZZ")),
    "number": (("count", 1234), ("other", 5678)),
    "boolean": (("flag", True),),
    "object": (("data", {"k": "v"}),),
    "array": (("items", ["v"]),),
}


def _spelled(value) -> tuple[tuple[str, bool], ...]:
    """How a template may write a value: (text, as a Python literal)."""
    if isinstance(value, str):
        return ((value, False),)
    out = [(json.dumps(value, ensure_ascii=False), False), (json.dumps(value, separators=(",", ":")), False)]
    return (*out, (repr(value), True))


def _tools() -> list[dict]:
    types = {"string": "string", "number": "integer", "boolean": "boolean", "object": "object", "array": "array"}
    properties = {key: {"type": types[kind], "description": key} for kind, pairs in PROBES.items()
                  for key, _ in pairs}
    properties["data"]["properties"] = {"k": {"type": "string"}}
    properties["items"]["items"] = {"type": "string"}
    return [{"type": "function", "function": {"name": name, "description": f"{name} something",
                                              "parameters": {"type": "object", "properties": properties}}}
            for name in (ONE, TWO)]


@dataclass(frozen=True)
class Learning:
    """What learning found: the format (None where it found none) and, where it could not
    tell, why, in one line."""

    learned: Optional[Learned]
    note: str = ""


class _Probe:
    """The template, rendering probe conversations (None where it cannot)."""

    def __init__(self, template: str, special: dict):
        self.template, self.special, self.tools = template, special, _tools()
        self.as_text = False  # the calls' arguments given as JSON text (DeepSeek-V3.1 concatenates them)

    def render(self, messages: list[dict], generation: bool = False, **switch) -> Optional[str]:
        from transformers.utils.chat_template_utils import render_jinja_template

        try:
            rendered, _ = render_jinja_template([messages], tools=self.tools, chat_template=self.template,
                                                add_generation_prompt=generation, **self.special, **switch)
        except Exception:  # the template's own error, whatever its type
            return None
        return rendered[0]

    def turn(self, message: dict, **switch) -> Optional[str]:
        return self.render([USER, message], **switch)

    def after_user(self, message: Optional[dict] = None, **switch) -> Optional[str]:
        """What the template writes after the user's message: an assistant turn, or
        (`message` None) the generation prompt; the system part, which a thinking switch
        may change too, left out."""
        rendered = self.render([USER, message] if message else [USER], message is None, **switch)
        return rendered[rendered.rindex(USER["content"]) + len(USER["content"]):] if rendered else None

    def assistant(self, calls=(), content: str = "", reasoning: Optional[str] = None) -> dict:
        message: dict = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [
                {"id": f"call{i + 1:05d}", "type": "function",
                 "function": {"name": name, "arguments": json.dumps(arguments) if self.as_text else arguments}}
                for i, (name, arguments) in enumerate(calls)]
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        return message

    @functools.cached_property
    def empty(self) -> Optional[str]:
        return self.turn(self.assistant())

    def section(self, calls) -> Optional[str]:
        """The markup a turn's calls add to it (layout before it left out)."""
        rendered = self.turn(self.assistant(calls))
        if rendered is None or self.empty is None:
            return None
        _, left, right, _ = split(self.empty, rendered)
        if left.strip() and right.strip():
            raise _Unclear("the template writes a turn with calls in another shape than one without "
                           "(no markup after the turn's text opens them)")
        right = right.strip()
        for token in self.special.values():  # the turn's end a turn with calls writes and an empty one does not
            right = right[:len(right) - len(token)].rstrip() if token and right.endswith(token) else right
        return right or None


def learn(template: Optional[str], special: dict) -> Learning:
    """The format a chat template shows (`special`: the tokens it reads, bos_token ...)."""
    if not isinstance(template, str) or not template.strip():
        return Learning(None, "the checkpoint has no chat template to learn from")
    probe = _Probe(template, special)
    try:
        learned = _calls(probe)
        problem = _reads_back(probe, learned)
    except _Unclear as unclear:
        return Learning(None, str(unclear))
    return Learning(None, problem) if problem else Learning(dataclasses.replace(learned, reasoning=_reasoning(probe)))


class _Unclear(ValueError):
    """The probes cannot tell (the message, one line, says what)."""


# -- comparing renderings --------------------------------------------------------------

def split(a: str, b: str) -> tuple[str, str, str, str]:
    """(common prefix, the rest of a, the rest of b, common suffix), the cuts moved out
    of any markup they fall in, as llama.cpp's `calculate_diff_split` does."""
    p = _prefix(a, b)
    opened = max(a.rfind("<", 0, p), a.rfind("[", 0, p))
    if opened >= 0 and a.find(">" if a[opened] == "<" else "]", opened, p) < 0:
        p = opened
    grouped = re.search(r"(?:<[^<>]*>|\[[^\[\]]*\])\Z", a[:p])
    if grouped and all(WORDED.match(x, p) for x in (a, b)):  # <|open|> | think<|sep|>: the cut moves before the group
        p = grouped.start()
    s = _prefix(a[p:][::-1], b[p:][::-1])
    tail = a[len(a) - s:]
    closed = min((i for i in (tail.find(">"), tail.find("]")) if i >= 0), default=-1)
    if closed >= 0 and "<" not in tail[:closed] and "[" not in tail[:closed]:
        s = len(tail) - closed - 1
    grouped = re.search(r"(?:<[^<>]*>|\[[^\[\]]*\])\Z", a[p:len(a) - s])
    if s and grouped and WORDED.match(a, len(a) - s) and b[p:len(b) - s].endswith(grouped.group()):
        s += len(grouped.group())  # likewise at the other end
    return a[:p], a[p:len(a) - s], b[p:len(b) - s], a[len(a) - s:]


def _prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _suffix(a: str, b: str) -> str:
    return a[len(a) - _prefix(a[::-1], b[::-1]):]


def _markers(text: str) -> list[re.Match]:
    return list(MARKER.finditer(text))


def _around(text: str, at: int, end: int) -> tuple[str, str]:
    """The markup next to text[at:end]: the marker just before it, the one just after."""
    before = [m for m in _markers(text) if m.end() <= at]
    after = [m for m in _markers(text) if m.start() >= end]
    return (before[-1].group() if before else "", after[0].group() if after else "")


# -- reasoning -------------------------------------------------------------------------

def _reasoning(probe: _Probe) -> Optional[ReasoningMarks]:
    """Where the template's reasoning opens and closes (both markup), or None."""
    thinking = probe.assistant(content=ANSWER, reasoning=THOUGHT)
    plain = probe.assistant(content=ANSWER)
    with_on, with_off = probe.after_user(thinking, **ON), probe.after_user(thinking, **OFF)
    without = probe.after_user(plain, **ON)
    start = end = ""
    for other in (with_off, without):
        if with_on and other and THOUGHT in with_on and THOUGHT not in other:
            _, _, right, _ = split(other, with_on)
            if THOUGHT in right:
                before, after = right.split(THOUGHT, 1)
                at = with_on.index(THOUGHT)
                near = _around(with_on, at, at + len(THOUGHT))
                start, end = before.strip() or near[0], after.strip() or near[1]
                break
    if with_on and THOUGHT in with_on and not (start and end):
        at = with_on.index(THOUGHT)
        start, end = _around(with_on, at, at + len(THOUGHT))
    prompt_start, prompt_end = _prompt_reasoning(probe)
    start, end = start or prompt_start, end or prompt_end
    if start and end and start != end and _markers(start) and _markers(end):
        return ReasoningMarks(start, end)
    return None


def _prompt_reasoning(probe: _Probe) -> tuple[str, str]:
    """What the generation prompt says of reasoning: the markup it opens with thinking on
    (and what it writes instead with it off: a closed block, or the closing markup)."""
    on, off = probe.after_user(**ON), probe.after_user(**OFF)
    if not on or not off or on == off:
        return "", ""
    _, left, right, _ = split(on, off)
    last = _markers(on)[-1].group() if _markers(on) else ""
    if last and last in right and not left.endswith(last):
        right = right[right.rindex(last) + len(last):]  # the block the off prompt adds after the same head
    left, right = left.strip(), right.strip()
    if left and not right:
        return left, ""
    markers = _markers(right)
    if not left and len(markers) >= 2 and right.endswith(markers[-1].group()):
        return right[:markers[-1].start()].strip(), markers[-1].group()  # an empty block when off
    if left and len(markers) == 1 and markers[0].group() == right:
        return left, right  # the off prompt closes what the on prompt opens
    return left, ""


# -- calls -----------------------------------------------------------------------------

ARGUMENTS = {"first": "XXXX"}


def _calls(probe: _Probe) -> Learned:
    for as_text in (False, True):
        probe.as_text = as_text
        one = probe.section([(ONE, ARGUMENTS)])
        if one and "XXXX" in one:
            break
    else:
        raise _Unclear("the template renders no tool calls")
    if ONE not in one:
        raise _Unclear("the template writes a call without its function's name (an id where the name goes)")
    two = probe.section([(ONE, ARGUMENTS), (TWO, ARGUMENTS)])
    if not two or two.count(ONE) != 1 or two.count(TWO) != 1 or two.index(ONE) > two.index(TWO):
        raise _Unclear("the template does not render two calls of one turn")
    objects = _call_objects(one)
    if objects:
        return _object_format(probe, one, two, objects)
    return _markup_format(probe, one, two)


def _call_objects(text: str) -> list[tuple[int, int, object]]:
    """The JSON values of a section that hold a call object naming the probe's function."""
    return [(a, b, v) for a, b, v in json_values(text)
            if any(_object_fields(item) for item in (v if isinstance(v, list) else [v]))]


def _object_fields(item) -> Optional[tuple[str, str, str, bool]]:
    """(the field naming the function, the arguments' field, the field both are in, the
    arguments as JSON text) of a probe's call object, or None."""
    for function in ("", "function"):
        fields = item.get(function) if function and isinstance(item, dict) else item
        if not isinstance(fields, dict):
            continue
        name = next((k for k, v in fields.items() if v in (ONE, TWO)), None)
        arguments = next((k for k, v in fields.items() if v == ARGUMENTS or v == json.dumps(ARGUMENTS)), None)
        if name and arguments:
            return name, arguments, function, isinstance(fields[arguments], str)
    return None


def _object_format(probe: _Probe, one: str, two: str, objects) -> Learned:
    """Calls as JSON objects: in a block each, in one block, or in a JSON list."""
    start, end, value = objects[0]
    items = value if isinstance(value, list) else [value]
    name_field, arguments_field, function, as_text = _object_fields(items[0])
    call = Call(OBJECT, name_field=name_field, arguments_field=arguments_field, function=function,
                arguments_text=as_text)
    found = _call_objects(two)
    head, tail = _head(one[:start]), _tail(one[end:])
    if isinstance(value, list):
        if len(found) != 1 or len(found[0][2]) != 2:
            raise _Unclear("the template's list of calls holds one call of two")
        inner = two[found[0][0] + 1:found[0][1] - 1]
        objects_in = json_values(inner)
        separator = inner[objects_in[0][1]:objects_in[1][0]]
        return Learned(head[0], tail[1], call, opening=head[1] + "[", closing="]" + tail[0], separator=separator)
    if len(found) != 2:
        raise _Unclear("the template's two calls are not two JSON objects")
    between = two[found[0][1]:found[1][0]]
    if head[0] in between:  # a block a call
        gap = between[len(tail[0]) + len(tail[1]):len(between) - len(head[0]) - len(head[1])]
        if not between.startswith(tail[0] + tail[1]) or not between.endswith(head[0] + head[1]):
            raise _Unclear("the template's blocks of calls differ")
        return Learned(head[0], tail[1], call, opening=head[1], closing=tail[0], separator=gap, blocks=True)
    return Learned(head[0], tail[1], call, opening=head[1], closing=tail[0], separator=between)


def _head(text: str) -> tuple[str, str]:
    """(the markup a block opens with, the layout or brackets after it)."""
    text = text.lstrip()
    markers = _markers(text)
    if not markers or markers[0].start() != 0:
        raise _Unclear("a call is not opened by markup")
    last = markers[0]
    for marker in markers[1:]:  # markup written together, with words between (<|open|>tools<|sep|>)
        if not re.fullmatch(r"[\w:.\-]+", text[last.end():marker.start()]):
            break
        last = marker
    return text[:last.end()], text[last.end():]


def _tail(text: str) -> tuple[str, str]:
    """(what comes after the last call before the closing markup, that markup; "" where
    the turn's end closes the calls)."""
    text = text.rstrip()
    markers = _markers(text)
    if not markers or markers[-1].end() != len(text):
        return text, ""
    first = markers[-1]
    for marker in reversed(markers[:-1]):
        if not re.fullmatch(r"[\w:.\-]+", text[marker.end():first.start()]):
            break
        first = marker
    return text[:first.start()], text[first.start():]


def _markup_format(probe: _Probe, one: str, two: str) -> Learned:
    """Calls whose function's name is in markup: its arguments are JSON, or in markup."""
    at1, at2 = two.index(ONE), two.index(TWO)
    before, middle, after = two[:at1], two[at1 + len(ONE):at2], two[at2 + len(TWO):]
    start, _ = _head(before)
    blocks = start in middle
    if blocks:
        head = before[len(start):]
        opening = ""
    else:
        common = _suffix(before, middle)
        cuts = [m.start() for m in OPENS.finditer(common)]
        head = common[cuts[-1]:] if cuts else ""
        start, opening = _head(before[:len(before) - len(head)])
    first = middle[:len(middle) - len(start) - len(head)] if blocks else middle[:len(middle) - len(head)]
    shared, counters = _shared(first, after)
    if not blocks and _markers(shared) and not shared.endswith(_markers(shared)[-1].group()):
        shared = shared[:_markers(shared)[-1].end()]  # layout after a call's last markup is the separator's
    separator, rest = first[len(shared):], after[len(shared):]
    if blocks:
        body, end = _tail(shared)
        closing, separator = _split_layout(body), separator
        body = body[:len(body) - len(closing)]
    else:
        closing, end = _tail(rest)
        body = shared
    extract = lambda section: _body(section, start + opening + head, end, closing, blocks)  # noqa: E731
    if extract(one) is None:
        raise _Unclear("a lone call is written otherwise than the first of two")
    call = _call_shape(probe, head, extract, counters, len(body))
    return Learned(start, end, call, opening=opening, closing=closing, separator=separator, blocks=blocks)


def _split_layout(text: str) -> str:
    """The layout (whitespace) a text ends with."""
    return text[len(text.rstrip()):]


def _shared(a: str, b: str) -> tuple[str, list[tuple[int, int]]]:
    """The common prefix of two calls' texts, numbers that differ between them taken as
    the same (a counter); with where those numbers are in `a` ((offset, length), ...)."""
    i = j = 0
    counters = []
    while i < len(a) and j < len(b):
        if a[i].isdigit() and b[j].isdigit():
            m, n = re.match(r"\d+", a[i:]).end(), re.match(r"\d+", b[j:]).end()
            if a[i:i + m] != b[j:j + n]:
                counters.append((i, m))
            i, j = i + m, j + n
        elif a[i] == b[j]:
            i, j = i + 1, j + 1
        else:
            break
    return a[:i], counters


def _body(section: Optional[str], head: str, end: str, closing: str, blocks: bool) -> Optional[str]:
    """A lone call's text after its name, without what closes its block."""
    if not section or not section.startswith(head + ONE):
        return None
    body = section[len(head) + len(ONE):].rstrip()
    tail = (closing.rstrip() + end) if end else closing.rstrip()
    at = body.rfind(tail) if tail else len(body)
    if at < 0 or MARKER.sub("", body[at + len(tail):]).strip():  # after it, only a turn's end (<eos>)
        return None
    body = body[:at]
    return body if not blocks else body[:len(body.rstrip())]


def _call_shape(probe: _Probe, head: str, extract, counters, length: int) -> Call:
    single = lambda arguments: extract(probe.section([(ONE, arguments)]))  # noqa: E731
    text = single(ARGUMENTS)
    for start, end, value in json_values(text or ""):
        if value == ARGUMENTS:
            after_name, call_end = _counted(text[:start], text[end:], text, counters, length)
            two = single({"first": "XXXX", "second": "ZZZZ"})
            if two is None or not two.startswith(text[:start]) or not two.endswith(text[end:]):
                raise _Unclear("calls' arguments are not one JSON object each")
            return Call(JSON_ARGUMENTS, head=head, after_name=after_name, end=call_end)
    return _tagged(single, head, counters, length)


def _counted(before: str, after: str, text: str, counters, length: int) -> tuple[str, str]:
    """The call's pieces before and after its arguments, with a counter where the two
    calls of a turn were numbered."""
    for offset, size in counters:
        if offset + size <= len(before):
            before = before[:offset] + COUNTER + before[offset + size:]
        elif offset >= length - len(after):
            at = offset - (length - len(after))
            after = after[:at] + COUNTER + after[at + size:]
        else:
            raise _Unclear("the calls are numbered inside their arguments")
    return before, after


def _tagged(single, head: str, counters, length: int) -> Call:
    """Arguments in markup: solved from one and two arguments of each kind."""
    seen = {}
    for kind, pairs in PROBES.items():
        for n in range(1, len(pairs) + 1):
            seen[kind, n] = single(dict(pairs[:n]))
    none = single({})
    if seen["string", 1] is None or seen["string", 2] is None:
        raise _Unclear("calls with arguments are not rendered")
    parts = {kind: _parts(seen, kind) for kind in ("string", "number")}
    if any(p is None for p in parts.values()) or parts["string"][0] != parts["number"][0]:
        raise _Unclear("a call's arguments are written in markup the probes cannot separate")
    solution = _solve(parts, none)
    if solution is None:
        raise _Unclear("a call's arguments are written in markup the probes cannot separate")
    after_name, key_open, separator, call_end, value_close = solution
    key_close = {"string": parts["string"][1], "number": parts["number"][1]}
    python = False
    for kind in ("boolean", "object", "array"):
        found = _spelled_in(seen[kind, 1], after_name + key_open, call_end, PROBES[kind][0])
        key_close[kind], value_close[kind], as_python = found or (key_close["number"], value_close["number"], False)
        python = python or as_python
    after_name, call_end = _counted(after_name, call_end, seen["string", 1], counters, length)
    order = single({"second": "ZZZZ", "first": "XXXX"})
    by_name = bool(order) and order.index("first") < order.index("second")
    tagged = Tagged(key_open, tuple(key_close.items()), tuple(value_close.items()), separator, python, by_name)
    return Call(TAGGED, head=head, after_name=after_name, end=call_end, tagged=tagged)


def _parts(seen, kind: str):
    """(before the first key, between a key and its value, after the last value, between
    two arguments) of a kind's probes, or None where they are not written so."""
    (k1, v1), (k2, v2) = PROBES[kind]
    one, two = seen[kind, 1], seen[kind, 2]
    s1, s2 = _spelled(v1)[0][0], _spelled(v2)[0][0]
    try:
        a = one[:one.index(k1)]
        key_close = one[one.index(k1) + len(k1):one.index(s1, one.index(k1))]
        b = one[one.index(s1, one.index(k1)) + len(s1):]
        c = two[two.index(s1) + len(s1):two.index(k2)]
        if two[two.index(k2) + len(k2):two.index(s2, two.index(k2))] != key_close or not two.endswith(s2 + b):
            return None
    except (ValueError, TypeError, AttributeError):
        return None
    return a, key_close, b, c


def _solve(parts, none: Optional[str]):
    """(after_name, key_open, separator, end, {kind: value_close}) that write both
    kinds' probes (and the call with no arguments), in the order llama.cpp's analyzer
    prefers: no separator if it can, a key that opens with markup."""
    a, _, b_s, c_s = parts["string"]
    _, _, b_n, c_n = parts["number"]
    found = []
    for k in range(len(a) + 1):
        key_open = a[len(a) - k:]
        if not (c_s.endswith(key_open) and c_n.endswith(key_open)):
            continue
        rest_s, rest_n = c_s[:len(c_s) - k], c_n[:len(c_n) - k]
        common = _suffix(rest_s, rest_n)
        for size in range(len(common) + 1):
            separator = common[len(common) - size:]
            close_s, close_n = rest_s[:len(rest_s) - size], rest_n[:len(rest_n) - size]
            if not (b_s.startswith(close_s) and b_n.startswith(close_n)):
                continue
            end = b_s[len(close_s):]
            after_name = a[:len(a) - k]
            if end != b_n[len(close_n):] or (none is not None and none != after_name + end):
                continue
            marked = bool(re.match(r"[<\[]", key_open))
            found.append(((size, not marked, len(key_open) if marked else -len(key_open)),
                          (after_name, key_open, separator, end, {"string": close_s, "number": close_n})))
    return min(found, key=lambda f: f[0])[1] if found else None


def _spelled_in(text: Optional[str], before: str, after: str, pair) -> Optional[tuple[str, str, bool]]:
    """(key close, value close, as a Python literal) of one argument of a kind, from a
    call with it alone, or None where its value is written in no way known."""
    key, value = pair
    if not text or not text.startswith(before + key) or not text.endswith(after):
        return None
    middle = text[len(before) + len(key):len(text) - len(after)]
    for spelled, python in _spelled(value):
        if spelled in middle:
            at = middle.index(spelled)
            return middle[:at], middle[at + len(spelled):], python
    return None


# -- checking ------------------------------------------------------------------------------

def _reads_back(probe: _Probe, learned: Learned) -> str:
    """"" when the learned format reads the probes' calls back as they were given, else
    what it could not read."""
    cases = [[(ONE, ARGUMENTS)], [(ONE, ARGUMENTS), (TWO, ARGUMENTS)],
             [(ONE, {"count": 1234, "first": "XXXX"})]]
    for calls in cases:
        section = probe.section(calls)
        found = []
        for block in _blocks(section or "", learned):
            try:
                found += learned.parse_tool_call(block, probe.tools)
            except ValueError:
                pass
        if [(c["name"], c["arguments"]) for c in found] != [(n, a) for n, a in calls]:
            return "the format learned from the template does not read the template's own calls back"
    return ""


def _blocks(section: str, learned: Learned) -> list[str]:
    """The markup of each block in a section, as the reply splitter gives it."""
    out = []
    for piece in section.split(learned.tool_call_start)[1:]:
        out.append(piece.split(learned.tool_call_end)[0] if learned.tool_call_end else piece)
    return out
