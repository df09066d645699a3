"""OpenAI messages to llm messages, with the token ids of the server's own earlier
replies, so a client that sends a reply back as text still extends the KV cache."""

from __future__ import annotations

from collections import OrderedDict

from .schemas import ChatMessage


class ReplyMemory:
    """Replies this server generated, by text, with the token ids they were generated
    as: an OpenAI client sends a reply back as text, and re-encoding text does not
    always give the same ids, so without this a follow-up would not reuse the KV cache."""

    def __init__(self, size: int = 64) -> None:
        self.size = size
        self._by_text: OrderedDict[str, tuple[str, list[int]]] = OrderedDict()

    def remember(self, text: str, reasoning: str, tokens: list[int]) -> None:
        if tokens:
            self._by_text[text] = (reasoning, tokens)
            self._by_text.move_to_end(text)
            while len(self._by_text) > self.size:
                self._by_text.popitem(last=False)

    def llm_messages(self, messages: list[ChatMessage]) -> list:
        from llm.parts import Message, ReasoningPart, TextPart

        from ..prompting import reply_metadata

        out = []
        for m in messages:
            text = m.text()
            role = "system" if m.role == "developer" else m.role
            if role != "assistant":
                out.append(Message(role=role, parts=[TextPart(text=text)]))
                continue
            reasoning, tokens = m.reasoning_content or "", m.tokens
            if tokens is None and text in self._by_text:
                known_reasoning, tokens = self._by_text[text]
                reasoning = reasoning or known_reasoning
            parts = [ReasoningPart(text=reasoning)] if reasoning else []
            parts.append(TextPart(text=text, provider_metadata=reply_metadata(tokens) if tokens else None))
            out.append(Message(role="assistant", parts=parts))
        return out
