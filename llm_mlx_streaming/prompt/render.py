"""llm's message chain -> chat-template token ids.

Why not just ``apply_chat_template(..., tokenize=True)``: re-encoding the
text of an earlier reply does not always give back the tokens the model
generated (byte-level BPE has many spellings of one string). The engine can
only reuse its KV cache up to the first differing token, so a chat turn would
prefill most of the previous reply again, and the model would see a
conversation it did not write. So each reply carries the ids it was generated
as (``provider_metadata``, logged with the message by llm), and the prompt is
built by splicing those ids between the canonically encoded template pieces.
Any process that gets the same messages (``llm chat``, ``llm -c``, Python's
``conversation.prompt``) builds the same ids. Messages without ids, or a
template that rewrites message content, fall back to plain encoding.
"""

from __future__ import annotations

import re
from typing import Optional

from .messages import METADATA_KEY, TOKENS, PromptError, shown, template_messages
from .polyfills import fill_in
from .tools import check_tool_support


def raw_text(messages) -> Optional[str]:
    """The text of a prompt of raw text (prompt.messages.raw_message), or None."""
    if len(messages) == 1 and ((messages[0].provider_metadata or {}).get(METADATA_KEY) or {}).get("raw"):
        return "".join(getattr(part, "text", "") for part in messages[0].parts)
    return None


def render_prompt(tokenizer, messages, *, thinking: Optional[bool] = None, effort: Optional[str] = None,
                  tools: Optional[list[dict]] = None) -> tuple[list[int], str, tuple]:
    """Token ids for the conversation (llm's `Message`s), the text of the generation
    prompt, and where the prompt's stable parts end (`boundaries`).

    `thinking` and `effort` set the template's thinking switch (None: the template's default);
    `tools` are function specs for the template (tools.py)."""
    raw = raw_text(messages)
    if raw is not None:
        return encode_text(tokenizer, raw), "", ()
    start = getattr(tokenizer, "think_start", None)
    end = getattr(tokenizer, "think_end", None)
    messages = template_messages(messages, start, end)
    uses_tools = bool(tools) or any(m["role"] == "tool" or m.get("tool_calls") for m in messages)
    if uses_tools:
        check_tool_support(tokenizer)
    if not getattr(tokenizer, "has_chat_template", False):
        if thinking is not None or effort is not None:
            raise PromptError("-o thinking: this model has no chat template, so no thinking switch")
        text = "\n\n".join(m["content"] for m in messages)
        return encode_text(tokenizer, text), "", ()
    extra = template_switches(tokenizer, thinking, effort)

    def rendered(msgs, specs, generation=True):
        return tokenizer.apply_chat_template(
            shown(msgs), add_generation_prompt=generation, tokenize=False, **extra, **({"tools": specs} if specs else {})
        )

    messages, tools, text = fill_in(tokenizer, messages, tools, rendered)
    render = lambda msgs, generation=True: rendered(msgs, tools, generation)  # noqa: E731
    try:
        head = render(messages, generation=False)
        generation_prompt = text[len(head):] if text.startswith(head) else ""
    except Exception:
        generation_prompt = ""
    tokens = with_stored_replies(tokenizer, render, messages, text)
    if tokens is None:
        tokens = encode_text(tokenizer, text)
    return tokens, generation_prompt, boundaries(tokenizer, render, messages, tokens, generation_prompt)


def boundaries(tokenizer, render, messages: list[dict], tokens: list[int], generation_prompt: str) -> tuple:
    """Where the prompt's stable parts end, as engine/snapshots.Boundary: the system
    prompt and tools (found as mlx-lm's server finds it: the template rendered with the
    system messages and an empty user message), and the earlier turns (the start of the
    generation prompt, which a thinking template may not render again the next turn)."""
    from mlx_lm.utils import common_prefix_len

    from ..engine.snapshots import SYSTEM, TURNS, Boundary

    found = []
    system = messages[:next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))]
    try:
        head = encode_text(tokenizer, render([*system, {"role": "user", "content": ""}], generation=False))
    except Exception:  # a template that refuses an empty user message
        head = []
    end = common_prefix_len(head, tokens)
    if 0 < end < len(tokens):
        found.append(Boundary(end, SYSTEM))
    tail = encode_text(tokenizer, generation_prompt) if generation_prompt else []
    if tail and tokens[-len(tail):] == tail and len(tokens) - len(tail) > end:
        found.append(Boundary(len(tokens) - len(tail), TURNS))
    return tuple(found)


def with_stored_replies(tokenizer, render, messages: list[dict], text: str) -> Optional[list[int]]:
    """`text` (`render(messages)`) encoded with each earlier reply's own ids (its
    message's TOKENS) in place of its re-encoded text, so the next turn reuses the whole
    reply's KV; None when no stored reply can be kept."""
    stored = {}  # message index -> its ids, where they spell its content
    overhang = {}  # message index -> what its ids spell past its content (tool-call markup)
    for i, message in enumerate(messages):
        if TOKENS not in message:
            continue
        past = _beyond(tokenizer.decode(message[TOKENS]), message["content"])
        if past is None or (past and not message.get("tool_calls")):
            continue
        stored[i] = message[TOKENS]
        if past:
            overhang[i] = past
    return _spliced(tokenizer, render, messages, stored, text, overhang) if stored else None


def template_switches(tokenizer, thinking: Optional[bool], effort: Optional[str] = None) -> dict:
    """Keyword arguments for the chat template's thinking switch, when asked for:
    `enable_thinking` (Qwen3, GLM, Gemma 4 and the like), `thinking` (DeepSeek-V3.1) or
    `reasoning_effort` (gpt-oss's harmony, whose reasoning cannot be turned off: off is
    its lowest effort). An effort level turns a plain switch on. A template that reads
    none cannot honour either, so that is an error rather than silence."""
    if thinking is None and effort is None:
        return {}
    switch = thinking_switch(getattr(tokenizer, "chat_template", None))
    if switch is None:
        raise PromptError(f"-o {'thinking' if effort is None else 'reasoning_effort'}: this model's chat template "
                          "has no thinking switch (enable_thinking, thinking or reasoning_effort)")
    off = thinking is False or (thinking is None and effort in NO_EFFORT)
    if switch == "reasoning_effort":
        return {switch: "low" if off or effort in NO_EFFORT else effort or "medium"}
    return {switch: not off}


NO_EFFORT = ("none", "minimal")


def thinking_switch(template) -> Optional[str]:
    """The variable a chat template turns its reasoning on or off with, or None."""
    if not isinstance(template, str):
        return None
    if "enable_thinking" in template:
        return "enable_thinking"
    if "reasoning_effort" in template:
        return "reasoning_effort"
    if re.search(r"(?<![\w.'\"\[])thinking\s+is\s+(?:not\s+)?defined|\{%-?\s*if\s+(?:not\s+)?thinking\b", template):
        return "thinking"
    return None


# Fill-in-the-middle markers of the code models that have them: (prefix, suffix, middle)
FIM_MARKERS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder, Qwen3-Coder
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, Granite
    ("<\uff5cfim\u2581begin\uff5c>", "<\uff5cfim\u2581hole\uff5c>", "<\uff5cfim\u2581end\uff5c>"),  # DeepSeek-Coder
)


def fill_in_the_middle(tokenizer, prefix: str, suffix: str) -> list[int]:
    """Token ids that ask the model for what goes between `prefix` and `suffix`, in the
    prefix-suffix-middle order with its own FIM tokens; a PromptError naming `suffix`
    when it has none."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    for pre, suf, mid in FIM_MARKERS:
        if all(marker in vocab for marker in (pre, suf, mid)):
            return [vocab[pre], *encode_text(tokenizer, prefix), vocab[suf], *encode_text(tokenizer, suffix),
                    vocab[mid]]
    raise PromptError("suffix: this model has no fill-in-the-middle tokens, so it cannot fill between a prompt "
                      "and a suffix")


def encode_text(tokenizer, text: str) -> list[int]:
    """Encode without special tokens and without HF's "longer than the maximum
    sequence length" warning (the context check gives a clearer error)."""
    try:
        return tokenizer.encode(text, add_special_tokens=False, verbose=False)
    except TypeError:
        return tokenizer.encode(text, add_special_tokens=False)


def _beyond(decoded: str, content: str) -> Optional[str]:
    """What the stored ids spell past the message's content ("" when they spell just
    it), None when they do not start with it. (The streaming detokenizer drops the
    leading space of a reply's first token, as mlx-lm's output does.)"""
    for text in (decoded, decoded[1:] if decoded.startswith(" ") else None):
        if text is not None and text.startswith(content):
            return text[len(content):]
    return None


def _spliced(tokenizer, render, messages, stored, text, overhang=None) -> Optional[list[int]]:
    """Encode the template around each stored reply, keeping the reply's own ids.

    A reply that ended in tool calls has ids that spell its content and then the
    call markup (`overhang`); they are kept when the template writes the calls the
    same way right after the content, so the next turn reuses the whole reply."""
    overhang = overhang or {}
    marks = {i: f"\x00mlx-stream-reply-{i}\x00" for i in stored}
    marked = [
        {**m, "content": marks[i]} if i in marks else m for i, m in enumerate(messages)
    ]
    try:
        pieces = re.split("(" + "|".join(map(re.escape, marks.values())) + ")", render(marked))
    except Exception:
        return None
    by_mark = {mark: i for i, mark in marks.items()}
    seen = [by_mark[p] for p in pieces if p in by_mark]
    if sorted(seen) != sorted(marks):  # a reply dropped or repeated by the template
        return None
    if "".join(messages[by_mark[p]]["content"] if p in by_mark else p for p in pieces) != text:
        return None  # the template rewrites content (e.g. strips old reasoning)
    differ = {
        by_mark[piece] for j, piece in enumerate(pieces)
        if overhang.get(by_mark.get(piece)) and not (j + 1 < len(pieces) and pieces[j + 1].startswith(overhang[by_mark[piece]]))
    }
    if differ:  # the template writes those calls otherwise: encode those replies' text
        kept = {i: ids for i, ids in stored.items() if i not in differ}
        return _spliced(tokenizer, render, messages, kept, text, overhang) if kept else None
    tokens: list[int] = []
    skip = 0
    for piece in pieces:
        if piece in by_mark:
            tokens.extend(stored[by_mark[piece]])
            skip = len(overhang.get(by_mark[piece], ""))
        elif piece[skip:]:
            tokens.extend(encode_text(tokenizer, piece[skip:]))
            skip = 0
        else:
            skip = 0
    return tokens
