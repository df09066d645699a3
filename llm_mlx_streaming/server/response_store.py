"""The responses a server keeps for `previous_response_id` and `GET /v1/responses/{id}`:
the conversation each one continued, its reply and its body, the oldest dropped first
once `max_responses` are kept, each visible only to the key that made it."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Kept:
    owner: Optional[str]  # the API key it was made with (None: no key set)
    messages: list  # the conversation (conversation.ChatMessage), then the reply with its token ids
    body: dict  # the response object as answered


class ResponseStore:
    def __init__(self, size: int) -> None:
        self.size = size
        self._kept: OrderedDict[str, Kept] = OrderedDict()

    def __len__(self) -> int:
        return len(self._kept)

    def keep(self, response_id: str, kept: Kept) -> None:
        self._kept[response_id] = kept
        while len(self._kept) > self.size:
            self._kept.popitem(last=False)

    def find(self, response_id: str, owner: Optional[str]) -> Optional[Kept]:
        kept = self._kept.get(response_id)
        return kept if kept is not None and kept.owner == owner else None

    def drop(self, response_id: str, owner: Optional[str]) -> bool:
        if self.find(response_id, owner) is None:
            return False
        del self._kept[response_id]
        return True
