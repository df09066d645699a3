"""A reply as the server keeps it while it streams, and the `mlx_stream` field every
API's answer carries (what `llm` logs for a prompt a server answered)."""

from __future__ import annotations

from ..reply.events import Chunk, Event, Finished, Outcome


class Transcript:
    """What a reply said, gathered as it streams: the text, the reasoning, the outcome."""

    def __init__(self) -> None:
        self._text: list[str] = []
        self._reasoning: list[str] = []
        self.outcome = Outcome()

    def add(self, event: Event) -> None:
        if isinstance(event, Finished):
            self.outcome = event.outcome
        elif isinstance(event, Chunk):  # the outcome holds the tool calls
            (self._reasoning if event.kind == "reasoning" else self._text).append(event.text)

    @property
    def text(self) -> str:
        return "".join(self._text)

    @property
    def reasoning(self) -> str:
        return "".join(self._reasoning)


def extension(outcome: Outcome) -> dict:
    return {"stats": outcome.figures, "tokens": outcome.tokens, "resolved_model": outcome.resolved_model}
