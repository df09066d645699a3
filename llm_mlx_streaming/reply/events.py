"""What a reply says as it streams, and what it leaves when it ends.

Every door maps these once into its own shape: llm's stream events (plugin/model.py),
an API's frames (server/), or reads them back from a server's stream (client/).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Optional, Union


@dataclass(frozen=True)
class Chunk:
    """A piece of the reply's text or reasoning."""

    kind: str  # "text" | "reasoning"
    text: str


@dataclass(frozen=True)
class CallBegins:
    """A tool call starts: its id and the function's name."""

    id: str
    name: str


@dataclass(frozen=True)
class CallArguments:
    """A piece of a call's arguments, as JSON text in the order generated."""

    id: str
    text: str


@dataclass
class ToolCall:
    """A call of the finished reply; `complete` when its block closed (a call cut off by
    the end of the reply keeps what was written of it under `_raw`)."""

    id: str
    name: str
    arguments: dict
    complete: bool = True

    @property
    def arguments_text(self) -> str:
        return json.dumps(self.arguments)


@dataclass
class Outcome:
    """The figures and ids a finished reply leaves: what llm logs and an API reports."""

    figures: dict = field(default_factory=dict)  # the engine's and the plan's, plain JSON values
    tokens: list[int] = field(default_factory=list)  # the ids that spell the reply (reused by the next turn)
    tool_calls: list[ToolCall] = field(default_factory=list)
    resolved_model: Optional[str] = None

    @property
    def prompt_tokens(self) -> int:
        return int(self.figures.get("prompt_tokens") or 0)

    @property
    def cached_tokens(self) -> int:
        """The prompt tokens reused from the KV cache rather than prefilled."""
        return int(self.figures.get("reused_tokens") or 0)

    @property
    def completion_tokens(self) -> int:
        return int(self.figures.get("generated_tokens") or 0)

    @property
    def finish_reason(self) -> Optional[str]:
        return self.figures.get("finish_reason")

    @property
    def stop_sequence(self) -> Optional[str]:
        """The stop sequence that ended the reply, if one did."""
        return self.figures.get("stop_sequence")

    @property
    def seconds(self) -> float:
        """The generation's wall time, start to end."""
        return float(self.figures.get("seconds") or 0)

    @property
    def first_token_seconds(self) -> float:
        """From the generation's start to its first token (the prefill)."""
        return float(self.figures.get("ttft_seconds") or 0)

    @property
    def capped(self) -> dict:
        """{name: [asked, given]} of the values the engine lowered (reply/caps.py)."""
        return self.figures.get("capped") or {}

    @property
    def logprobs(self) -> Optional[list[dict]]:
        """Each generated token's {token, logprob, top_logprobs}, when they were asked for."""
        return self.figures.get("logprobs")

    def complete_calls(self) -> list[ToolCall]:
        """The calls an API's reply gives: a call the token limit cut off is left out (its
        arguments are no whole JSON, and an agent that ran it would break on them), and
        the finish reason, `length`, says why the reply ended."""
        return [call for call in self.tool_calls if call.complete]

    @property
    def ended_for_calls(self) -> bool:
        """Whether the reply ended to have its calls run (OpenAI's finish_reason
        `tool_calls`, Anthropic's stop_reason `tool_use`)."""
        return bool(self.complete_calls()) and self.finish_reason == "stop"


@dataclass(frozen=True)
class Finished:
    outcome: Outcome


Event = Union[Chunk, CallBegins, CallArguments, Finished]


def plain(value):
    """Figures as plain JSON values (numpy scalars and paths come out of the engine)."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "item"):
        return value.item()
    return str(value)
