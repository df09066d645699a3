"""Tool calling through the model's own chat template and mlx-lm's tool parsers.

llm's tools go to the template as OpenAI-style function specs (`tools=`), earlier
tool calls as the assistant message's `tool_calls`, and tool results as `tool`
messages, which is what Hugging Face chat templates with tool support read. The
model's tool-call markup (`tokenizer.tool_call_start` ... `tool_call_end`, found by
mlx-lm from the template) is cut out of the reply by `replies.ReplySplitter` and
parsed by the tokenizer's `tool_parser`, the same parser `mlx_lm.server` uses.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Optional


class ToolError(ValueError):
    """The model cannot take the tools it was given; the message is one line."""


def template_tools(tools) -> list[dict]:
    """llm `Tool`s as the function specs chat templates expect."""
    return [
        {
            "type": "function",
            "function": {
                "name": tool.name,
                "description": tool.description or "",
                "parameters": tool.input_schema or {"type": "object", "properties": {}},
            },
        }
        for tool in tools
    ]


def function_tools(prompt) -> list:
    """The prompt's tools that the model calls (llm's server-side tools are not ours)."""
    import llm

    return [t for t in (prompt.tools or []) if isinstance(t, llm.Tool)]


def check_tool_support(tokenizer, model_name: str = "this model") -> None:
    """A ToolError unless mlx-lm found a tool-call format in the chat template."""
    if not getattr(tokenizer, "has_tool_calling", False):
        raise ToolError(
            f"{model_name}'s chat template has no tool support (mlx-lm finds no tool-call "
            "format in it), so it cannot be given tools (-T)"
        )


def assistant_tool_calls(parts) -> list[dict]:
    """An assistant message's tool calls, as the template's `tool_calls`."""
    from llm.parts import ToolCallPart

    return [
        {
            "id": part.tool_call_id,
            "type": "function",
            "function": {"name": part.name, "arguments": part.arguments or {}},
        }
        for part in parts
        if isinstance(part, ToolCallPart) and not part.server_executed
    ]


def tool_result_messages(message) -> list[dict]:
    """A `tool` message's results, one template message each."""
    from llm.parts import ToolResultPart

    out = []
    for part in message.parts:
        if not isinstance(part, ToolResultPart):
            raise ToolError(f"mlx-stream cannot send {type(part).__name__} in a tool message")
        content = part.output if not part.exception else f"Error: {part.exception}"
        out.append({"role": "tool", "content": content, "name": part.name, "tool_call_id": part.tool_call_id})
    return out


def parse_tool_calls(tokenizer, markup: str, tools: list[dict]) -> Optional[list[dict]]:
    """[{"id", "name", "arguments"}] from one tool-call block; None if it does not parse."""
    parser = getattr(tokenizer, "tool_parser", None)
    if parser is None:
        return None
    try:
        parsed: Any = parser(markup, tools)
    except Exception:  # the model wrote markup its parser cannot read
        return None
    calls = parsed if isinstance(parsed, list) else [parsed]
    out = []
    for call in calls:
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        arguments = call.get("arguments") or {}
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return None
        if not isinstance(arguments, dict):
            return None
        out.append({"id": f"call_{uuid.uuid4().hex[:24]}", "name": call["name"], "arguments": arguments})
    return out
