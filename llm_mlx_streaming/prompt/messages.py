"""Messages in each direction: llm's chain to chat-template dicts (the engine's prompt)
and to OpenAI messages (a prompt sent to `llm mlxs serve`), and the server's
conversation back to llm's (a server request). Each reply carries the token ids it was
generated as, in its `provider_metadata` under METADATA_KEY, so every path can reuse
the KV cache exactly.
"""

from __future__ import annotations

from typing import Any, Optional

from .images import attachment_data_url, attachment_part
from .tools import assistant_tool_calls, tool_result_messages

METADATA_KEY = "mlx-stream"
TOKENS = "tokens"  # a template message's key for the ids its reply was generated as (never shown to the template)


class PromptError(ValueError):
    pass


class NoImages(PromptError):
    """A prompt with images for a model that takes none (its name goes in front)."""


def reply_metadata(tokens: list[int]) -> dict:
    return {METADATA_KEY: {"tokens": [int(t) for t in tokens]}}


def stored_tokens(message) -> Optional[list[int]]:
    found = None
    for part in message.parts:
        meta = getattr(part, "provider_metadata", None) or {}
        tokens = (meta.get(METADATA_KEY) or {}).get("tokens")
        if isinstance(tokens, list) and all(isinstance(t, int) for t in tokens):
            found = tokens
    return found


def template_messages(messages, think_start=None, think_end=None, images: Optional[list] = None) -> list[dict]:
    """Template dicts for the chain; an earlier reply's dict carries its stored token ids
    under TOKENS, so a fill-in that adds, folds or moves messages carries them along.

    Earlier replies keep their reasoning inside the think tags, so the
    rendered conversation is what the model generated; a model with no think tags
    gets it as the message's `thinking`, where its template looks for it. With `images` (a list), each
    image attachment is appended to it and its message says how many it has
    (`"images"`; the vision model's own format places them, prompt/images.py);
    without, an image is a NoImages error.
    """
    out = []
    for message in messages:
        if message.role == "tool":  # results of the tools the model called
            out.extend(tool_result_messages(message))
            continue
        pieces = _pieces(message)
        if images is None and any(kind == "image" for kind, _ in pieces):
            raise NoImages("takes no images: it is a text-only model")
        tagged = bool(think_start and think_end)
        content = "".join(f"{think_start}{text}{think_end}" if kind == "reasoning" else text
                          for kind, text in pieces if kind == "text" or (kind == "reasoning" and text and tagged))
        attached = [part for kind, part in pieces if kind == "image"]
        item = {"role": message.role, "content": content}
        if not tagged and (reasoning := "".join(text for kind, text in pieces if kind == "reasoning")):
            item["thinking"] = reasoning  # a model with no think tags (harmony's analysis channel)
        if attached:
            images.extend(attached)
            item["images"] = len(attached)
        if message.role == "assistant":
            tokens = stored_tokens(message)
            if tokens is not None:
                item[TOKENS] = tokens
            if calls := assistant_tool_calls(message.parts):
                item["tool_calls"] = calls
        out.append(item)
    return out


def shown(messages: list[dict]) -> list[dict]:
    """The template dicts as the template sees them: without their stored ids."""
    return [{k: v for k, v in m.items() if k != TOKENS} if TOKENS in m else m for m in messages]


def openai_messages(messages) -> list[dict]:
    """llm's message chain as OpenAI messages (tool calls and results included); replies
    carry the ids they were generated as (the `tokens` extension), so the server reuses
    its KV cache exactly."""
    import json

    out = []
    for message in messages:
        if message.role == "tool":
            out.extend({"role": "tool", "tool_call_id": m["tool_call_id"], "content": m["content"]}
                       for m in tool_result_messages(message))
            continue
        pieces = _pieces(message)
        item = {"role": message.role, "content": _openai_content(pieces)}
        if reasoning := "".join(text for kind, text in pieces if kind == "reasoning"):
            item["reasoning_content"] = reasoning
        if calls := assistant_tool_calls(message.parts):
            item["tool_calls"] = [{**c, "function": {"name": c["function"]["name"],
                                                     "arguments": json.dumps(c["function"]["arguments"])}}
                                  for c in calls]
        if message.role == "assistant" and (tokens := stored_tokens(message)) is not None:
            item["tokens"] = tokens
        out.append(item)
    return out


def _openai_content(pieces: list[tuple[str, Any]]):
    """A message's text, or with images its OpenAI content parts in order (each image a
    data URL, so the server needs nothing else to read it)."""
    text = "".join(value for kind, value in pieces if kind == "text")
    if not any(kind == "image" for kind, _ in pieces):
        return text
    return [{"type": "text", "text": value} if kind == "text" else
            {"type": "image_url", "image_url": {"url": attachment_data_url(value)}}
            for kind, value in pieces if kind in ("text", "image")]


def _pieces(message) -> list[tuple[str, Any]]:
    """A message's ("text" | "reasoning", text) and ("image", llm's Attachment) parts in
    order (its tool calls are read apart); a role or part this plugin cannot send is a
    PromptError."""
    from llm.parts import AttachmentPart, ReasoningPart, TextPart, ToolCallPart

    if message.role not in ("system", "user", "assistant"):
        raise PromptError(f"mlx-stream cannot send '{message.role}' messages")
    out = []
    for part in message.parts:
        if isinstance(part, ReasoningPart):
            out.append(("reasoning", part.text or ""))
        elif isinstance(part, TextPart):
            out.append(("text", part.text))
        elif isinstance(part, AttachmentPart) and part.attachment is not None and message.role == "user":
            out.append(("image", part.attachment))
        elif not isinstance(part, ToolCallPart):
            raise PromptError(f"mlx-stream supports text only, not {type(part).__name__}")
    return out


def llm_messages(messages, known=lambda text, calls=(): None) -> list:
    """The server's conversation (server/conversation.py's messages) as llm's; an
    assistant reply without its `tokens` gets them from `known(text, calls)` ->
    (reasoning, tokens) or None. A message's `parts` are text (str) and images (their
    `image()`, read by the server); its `calls` have an `id`, a `name` and `arguments` (a dict)."""
    from llm.parts import Message

    out, called = [], {}
    for i, m in enumerate(messages):
        text = m.text()
        if m.role == "tool":
            if m.tool_call_id not in called:
                raise PromptError(f"messages.{i}.tool_call_id: no earlier assistant message made the call "
                                  f"{m.tool_call_id!r}")
            out.append(tool_result_message(m.tool_call_id, called[m.tool_call_id], text))
        elif m.role == "assistant":
            called.update((c.id, c.name) for c in m.calls)
            reasoning, tokens = m.reasoning, m.tokens
            if tokens is None and (found := known(text, m.calls)) is not None:
                reasoning, tokens = reasoning or found[0], found[1]
            out.append(assistant_message(text, reasoning, tokens, m.calls))
        else:
            out.append(Message(role=m.role, parts=_user_parts(m.parts)))
    return out


def _user_parts(pieces: list) -> list:
    """A (system or user) message's text, with its images in order among it: a message
    without images is one text part."""
    from llm.parts import TextPart

    if all(isinstance(p, str) for p in pieces):
        return [TextPart(text="".join(pieces))]
    return [TextPart(text=p) if isinstance(p, str) else attachment_part(p.image()) for p in pieces]


def assistant_message(text: str, reasoning: str = "", tokens: Optional[list[int]] = None, calls=()):
    """An earlier reply as llm's message: its reasoning, text and tool calls (each with an
    `id`, a `name` and `arguments`, a dict), with the token ids it was generated as."""
    from llm.parts import Message, ReasoningPart, TextPart, ToolCallPart

    parts = [ReasoningPart(text=reasoning)] if reasoning else []
    parts.append(TextPart(text=text, provider_metadata=reply_metadata(tokens) if tokens else None))
    parts.extend(ToolCallPart(name=c.name, arguments=c.arguments, tool_call_id=c.id) for c in calls)
    return Message(role="assistant", parts=parts)


def tool_result_message(tool_call_id: str, name: str, output: str):
    """A tool's result, as llm's `tool` message."""
    from llm.parts import Message, ToolResultPart

    return Message(role="tool", parts=[ToolResultPart(name=name, output=output, tool_call_id=tool_call_id)])


def raw_message(text: str):
    """A prompt of plain text, encoded without the chat template (the server's
    /v1/completions): one user message marked in its metadata."""
    from llm.parts import Message, TextPart

    return Message(role="user", parts=[TextPart(text=text)], provider_metadata={METADATA_KEY: {"raw": True}})
