"""The token ids of the server's own earlier replies, by text, so a client that sends
a reply back as text still extends the KV cache (messages.llm_messages asks here)."""

from __future__ import annotations

from collections import OrderedDict


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

    def known(self, text: str):
        """(reasoning, token ids) of a reply this server gave with this text, or None."""
        return self._by_text.get(text)
