"""The conversation as the server hands it to the reply core, whatever API it came in.

Each API's routes turn their request's messages into these (OpenAI's messages,
Anthropic's blocks, Ollama's messages, the Responses API's items); `llm_chain` reads their
images (server/images.py) and makes llm's messages of them (prompt/messages.py). A
call in an assistant message is the core's own `ToolCall` (reply/events.py), so a
reply's calls go back into the next turn as they came out.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Optional, Union

from ..prompt.images import Image
from ..prompt.messages import llm_messages
from ..reply.events import ToolCall
from .images import read_images


@dataclass
class ImagePart:
    """An image in a user message: its URL (a data URL, or an http(s) URL) until
    server/images.py has read it."""

    url: str
    read: Optional[Image] = None

    def image(self) -> Image:
        if self.read is None:
            raise ValueError("an image was not read before the prompt was made")  # server/images.py reads each
        return self.read


@dataclass
class ChatMessage:
    role: str  # "system" | "user" | "assistant" | "tool"
    parts: list[Union[str, ImagePart]] = field(default_factory=list)  # text and images, in order
    reasoning: str = ""  # an assistant message's
    calls: list[ToolCall] = field(default_factory=list)  # an assistant message's
    tool_call_id: Optional[str] = None  # a tool message's: the call it answers
    tokens: Optional[list[int]] = None  # the ids an assistant message was generated as (the KV cache's)

    def text(self) -> str:
        return "".join(part for part in self.parts if isinstance(part, str))

    def images(self) -> list[ImagePart]:
        return [part for part in self.parts if isinstance(part, ImagePart)]


def text_message(role: str, text: str) -> ChatMessage:
    return ChatMessage(role, [text])


async def llm_chain(service, model_id: str, chat: list[ChatMessage]) -> list:
    """`chat` as llm's messages for `model_id`: its images read, and the token ids of the
    server's own replies in it found in the reply memory."""
    await read_images(service.policy, model_id, chat)
    return llm_messages(chat, service.replies.known)


def call_arguments(text: str) -> dict:
    """A call's arguments given back as JSON text (OpenAI's and the Responses API's
    layout) as a dict; ValueError when they are not a JSON object."""
    try:
        parsed = json.loads(text or "{}")
    except json.JSONDecodeError:
        parsed = None
    if not isinstance(parsed, dict):
        raise ValueError("the arguments must be a JSON object as text")
    return parsed
