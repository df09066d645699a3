"""The token ids of the server's own earlier replies, by text, so a client that sends
a reply back as text still extends the KV cache (messages.llm_messages asks here)."""

from __future__ import annotations

import json
from collections import OrderedDict


class ReplyMemory:
    """Replies this server generated, by text, with the token ids they were generated
    as: an OpenAI client sends a reply back as text, and re-encoding text does not
    always give the same ids, so without this a follow-up would not reuse the KV cache.
    At most `size` replies (the `reply_memory` setting), the least recently given first out."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._by_reply: OrderedDict[str, tuple[str, list[int]]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._by_reply)

    def remember(self, transcript) -> None:
        """Keep a finished reply's (transcript.Transcript) token ids, by its text and calls."""
        tokens = transcript.outcome.tokens
        if tokens and self.size:
            key = _key(transcript.text, transcript.outcome.complete_calls())
            self._by_reply[key] = (transcript.reasoning, tokens)
            self._by_reply.move_to_end(key)
            while len(self._by_reply) > self.size:
                self._by_reply.popitem(last=False)

    def known(self, text: str, calls=()):
        """(reasoning, token ids) of a reply this server gave with this text and these
        tool calls (the core's ToolCall), or None."""
        return self._by_reply.get(_key(text, calls))


def _key(text: str, calls) -> str:
    """A reply by what a client sends back: its text and its calls (their ids are the
    server's, but a client may rewrite them)."""
    return json.dumps([text, [[c.name, c.arguments] for c in calls]])
