"""Split a reply's streamed text into answer text, reasoning and tool-call blocks, with
mlx-lm's own text state machine (`make_text_state_machine`): think tags, the format's
tool markup (an empty end tag: the turn's end closes the block), a call begun inside
reasoning, structural markers and multi-channel response formats (harmony's channels,
formats/harmony.py). Tags and markup are never emitted as text; a tag split across
the detokenizer's segments is held back until the next one decides it.
"""

from __future__ import annotations

from typing import Optional

from ..formats.tool_format import ReasoningMarks
from ..formats.registry import format_of

TEXT, REASONING, TOOL = "text", "reasoning", "tool_call"
TOOL_TEXT = "tool_call_text"  # a piece of tool-call markup as it arrives (the block follows whole)
UNFINISHED_TOOL = "tool_call_unfinished"  # markup cut off by the end of the reply
KINDS = {"normal": TEXT, "reasoning": REASONING}  # mlx-lm's states that are the reply's; others are markup


class ReplySplitter:
    """`feed(text)` -> [(kind, chunk)]: "text" and "reasoning" pieces as they become
    certain, the pieces of a tool-call block ("tool_call_text") as they do, and
    ("tool_call", its markup) once the block is closed. With `thinking` off, what the
    model writes in a think block is answer text."""

    def __init__(self, tokenizer, initial: str = "normal", thinking: bool = True):
        from mlx_lm.generate import make_text_state_machine

        format_of(tokenizer)  # the format's markup on the tokenizer, wherever it was loaded
        self.state = make_text_state_machine(tokenizer).make_state(initial)
        self.kinds = KINDS if thinking else {**KINDS, "reasoning": TEXT}
        self._tool = ""
        self._fresh = initial == "reasoning"  # a reasoning block has just opened

    def feed(self, text: str) -> list[tuple[str, str]]:
        from mlx_lm.generate import TextStateMachine

        self.state, segments = TextStateMachine.split(self.state, text)
        out: list[tuple[str, str]] = []
        for i, (state, chunk) in enumerate(segments):
            left = i + 1 < len(segments)  # the machine moved on from this state
            self._emit(state, chunk, out)
            if left and state == "tool":
                out.append((TOOL, self._tool))
                self._tool = ""
            if left:
                self._fresh = segments[i + 1][0] == "reasoning"
        return out

    def _emit(self, state: Optional[str], chunk: str, out: list) -> None:
        if state == "tool":
            self._tool += chunk
            if chunk:
                out.append((TOOL_TEXT, chunk))
            return
        if state == "reasoning" and self._fresh:
            chunk = chunk.lstrip("\n")  # the line break after the opening tag is layout
            self._fresh = not chunk
        kind = self.kinds.get(state)
        if kind and chunk:
            out.append((kind, chunk))

    def flush(self) -> list[tuple[str, str]]:
        """What is left at the end of the reply; an unclosed tool call comes back as
        ("tool_call_unfinished", its markup so far)."""
        from mlx_lm.generate import TextStateMachine

        self.state, held, state = TextStateMachine.flush(self.state)
        if state == "tool":
            markup, self._tool = self._tool + held, ""
            return [(UNFINISHED_TOOL, markup)]
        out: list[tuple[str, str]] = []
        self._emit(state, held, out)
        return out


def initial_state(tokenizer, generation_prompt: str) -> str:
    """Where the reply starts: inside a think block the generation prompt opened, in
    the response format's first state, or in plain text."""
    start, end = getattr(tokenizer, "think_start", None), getattr(tokenizer, "think_end", None)
    if opens_thinking(generation_prompt, start, end):
        return "reasoning"
    return getattr(tokenizer, "response_initial_state", None) or "normal"


def opens_thinking(generation_prompt: str, start: Optional[str], end: Optional[str]) -> bool:
    """True when the template's generation prompt already opened a think block."""
    if not (start and end):
        return False
    i = generation_prompt.rfind(start)
    return i >= 0 and generation_prompt.find(end, i) < 0


def reasoning_of(tokenizer) -> Optional[ReasoningMarks]:
    """Where the tokenizer's model reasons: between mlx-lm's think tags, else in its
    format's reasoning channel (harmony's analysis), else nowhere (None)."""
    start, end = getattr(tokenizer, "think_start", None), getattr(tokenizer, "think_end", None)
    if start and end:
        return ReasoningMarks(start, end)
    fmt = format_of(tokenizer)
    return fmt.reasoning if fmt is not None else None
