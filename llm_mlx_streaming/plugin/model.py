"""The ``llm.Model`` that serves ``mlx-stream`` and ``mlx-stream/<name>``.

It hands llm's prompt to the reply core (reply/), or to a running `llm mlxs serve`
through its client, and maps the core's events once into llm's: text, reasoning and
tool calls as they stream, then the reply's token ids, the figures and the usage.
The engine keeps the KV cache and reuses it when a new prompt extends the last one,
so each turn passes the *whole* conversation and `llm chat` prefills only what is new.
"""

from __future__ import annotations

from typing import Optional

import click
import llm

from ..client.client import ServerClient, running_server
from ..options import registry
from ..options.run_config import drafter
from ..options.settings import Options, load_settings
from ..prompt.constrained import cut_short_notice
from ..prompt.images import IMAGE_TYPES
from ..prompt.messages import reply_metadata
from ..prompt.tools import function_tools, template_tools
from ..reply import caps
from ..reply.build import Ask
from ..reply.core import reply
from ..reply.events import CallArguments, CallBegins, Chunk, Event, Finished, Outcome

class MlxStreamModel(llm.Model):
    can_stream = True
    supports_schema = True  # constrained decoding (prompt/constrained.py)
    supports_tools = True  # through the chat template (prompt/tools.py)
    Options = Options

    def __init__(self, name: Optional[str] = None):
        """``name=None`` is the ``mlx-stream`` id: whichever model is the default."""
        self.name = name
        self._attachment_types: Optional[frozenset[str]] = None
        self.model_id = registry.MODEL_PREFIX if name is None else f"{registry.MODEL_PREFIX}/{name}"

    def __str__(self) -> str:
        return f"MLX streaming: {self.model_id}"

    @property
    def attachment_types(self) -> frozenset[str]:
        """The image types `llm -a` may attach: a vision-language checkpoint's, none for a
        text-only one. Read when llm asks (a prompt with attachments, `llm models
        --options`), so registering the models reads no checkpoint."""
        if self._attachment_types is None:
            self._attachment_types = frozenset(IMAGE_TYPES if registry.takes_images(self.name) else ())
        return self._attachment_types

    def execute(self, prompt, stream, response, conversation):
        yield from self._execute(prompt, response)

    def _execute(self, prompt, response):
        """llm's stream events for `prompt`."""
        ask, server = self.asked(prompt)
        events = server.answer(self.model_id, ask) if server else reply(ask)
        for event in events:
            yield from llm_events(event, response)

    def asked(self, prompt) -> tuple[Ask, Optional[ServerClient]]:
        """llm's prompt as the reply core's `Ask`, and the running server it goes to
        (None: this process answers it)."""
        settings = load_settings()
        options = prompt.options
        drafter(options, settings)  # an unknown drafter is refused before a server sees it
        ask = Ask(self.name, prompt.messages, options, template_tools(function_tools(prompt)), schema_dict(prompt))
        return ask, running_server(options, settings)


def schema_dict(prompt) -> Optional[dict]:
    schema = prompt.schema
    return schema.model_json_schema() if hasattr(schema, "model_json_schema") else schema


def llm_events(event: Event, response) -> list:
    """One of the core's events as llm's; at the end the calls, the ids and the figures
    go on `response`."""
    from llm.parts import StreamEvent

    if isinstance(event, Chunk):
        return [StreamEvent(type=event.kind, chunk=event.text)]
    if isinstance(event, CallBegins):
        return [StreamEvent(type="tool_call_name", chunk=event.name, tool_call_id=event.id)]
    if isinstance(event, CallArguments):
        return [StreamEvent(type="tool_call_args", chunk=event.text, tool_call_id=event.id)]
    if isinstance(event, Finished):
        return _finish(event.outcome, response)
    return []


def _finish(outcome: Outcome, response) -> list:
    """The reply's own token ids ride on its last part, logged with it, so a later turn
    reuses the KV cache exactly (prompt/render.py): on the last call too, since a reply
    that ends in calls has no text part to carry them."""
    from llm.parts import StreamEvent

    metadata = reply_metadata(outcome.tokens)
    out = []
    for call in outcome.tool_calls:
        response.add_tool_call(llm.ToolCall(name=call.name, arguments=call.arguments, tool_call_id=call.id))
    if outcome.tool_calls:
        out.append(StreamEvent(type="tool_call_args", chunk="", tool_call_id=outcome.tool_calls[-1].id,
                               provider_metadata=metadata))
    out.append(StreamEvent(type="text", chunk="", provider_metadata=metadata))
    for notice in (cut_short_notice(outcome.figures), caps.notice(outcome.capped)):
        if notice:
            click.echo(notice, err=True)
    response.set_usage(input=outcome.prompt_tokens, output=outcome.figures.get("generated_tokens"))
    response.response_json = outcome.figures
    if outcome.resolved_model:
        response.set_resolved_model(outcome.resolved_model)
    return out
