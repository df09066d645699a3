"""keep_alive: how long a model stays loaded after a request, one field for every API.

Ollama's field, with Ollama's meaning, is also taken as an extension by the OpenAI
chat/completions, Responses and Anthropic routes, so a client of any API can unload a
model it is done with (0) or keep it (-1) while other models come and go (engine/residents.py).
"""

from __future__ import annotations

from typing import Optional, Union

from pydantic import Field, field_validator

from .. import values
from .fields import RequestModel

KeepAliveValue = Union[float, str]


class KeepAlive(RequestModel):
    """A request body's keep_alive field (a base of every generation request)."""

    keep_alive: Optional[KeepAliveValue] = Field(
        None, description="How long the model stays loaded after this request (seconds, or a duration like 5m): "
        "0 unloads it after the reply; negative: until its room is needed; left out: the server's keep_alive "
        "setting (another request for it cancels a pending unload). An extension outside Ollama's API")

    @field_validator("keep_alive")
    @classmethod
    def _a_duration(cls, value):
        if value is not None:
            values.duration_seconds(value)
        return value

    def keep_seconds(self) -> Optional[float]:
        """Seconds the model stays loaded after this request (negative: until it needs the
        room); None: the server's keep_alive setting."""
        return None if self.keep_alive is None else values.duration_seconds(self.keep_alive)

    def unloads(self) -> bool:
        return self.keep_seconds() == 0

