"""Values asked for that the engine lowers: max_tokens past the context left after the
prompt, expert_slots past the experts of a layer. The caps stay (OpenAI answers 400 past
the context; the plugin chooses the cap) and are named once: in the reply's figures
(`capped`), on stderr from `llm`, in the server's x-mlx-stream-capped header and log line.
"""

from __future__ import annotations

from typing import Optional

from ..checkpoints.config import moe_shape, read_config
from ..errors import CheckpointError

REASONS = {"max_tokens": "the context left after the prompt", "expert_slots": "the experts of a layer"}


def capped(run, max_tokens: Optional[int]) -> dict[str, list[int]]:
    """{name: [asked, given]} of what `run` (a RunConfig) asked for and the engine lowered;
    `max_tokens`: the tokens the engine lets the reply generate (engine/respond.token_budget)."""
    out = {}
    if run.max_tokens >= 1 and max_tokens is not None and max_tokens < run.max_tokens:
        out["max_tokens"] = [run.max_tokens, max_tokens]
    asked = run.load.expert_slots
    if isinstance(asked, int) and run.slots_source != "plan":
        try:
            experts = (moe_shape(read_config(run.path)) or (0, 0))[0]
        except (CheckpointError, OSError, ValueError):
            experts = 0
        if 0 < experts < asked:
            out["expert_slots"] = [asked, experts]
    return out


def notice(caps: dict) -> Optional[str]:
    """The one line that names the caps of a reply (None: none)."""
    if not caps:
        return None
    named = "; ".join(f"{name} {asked} capped at {given} ({REASONS.get(name, 'the most it can be')})"
                      for name, (asked, given) in caps.items())
    return f"mlx-stream: {named}"


def header(caps: dict) -> str:
    """The caps as the x-mlx-stream-capped header's value: `max_tokens=2047, expert_slots=16`."""
    return ", ".join(f"{name}={given}" for name, (_, given) in caps.items())
