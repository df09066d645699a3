"""The ``llm.Model`` that serves ``mlx-stream`` and ``mlx-stream/<name>``.

It turns llm's message chain into chat-template tokens (``prompting.py``),
resolves options over the settings (``run_config.py``) and streams the engine's text, with
``<think>`` blocks as reasoning events. The engine (``engine.manager``) owns
the loaded model, the expert pools and the KV cache and reuses the cache when
a new prompt extends the last one, so each turn simply passes the *whole*
conversation and ``llm chat`` turns prefill only what is new.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

import click
import llm

from . import registry
from .errors import MlxStreamError, one_line
from .knobs import BUNDLED_REPETITION_PENALTY, REPETITION_CONTEXT, build_options
from .run_config import RunConfig, drafter, resolve
from .settings import load_settings
from .client.client import running_server
from .constrained import SchemaError, SchemaProcessor, cut_short_notice, schema_grammar
from .messages import PromptError, reply_metadata
from .prompting import encode_text, render_prompt, stream_event
from .reply_split import TOOL, TOOL_TEXT, UNFINISHED_TOOL, ReplySplitter, opens_thinking
from .tools import (AUTO, NONE, CallReader, ToolError, check_tool_choice, forced_call_grammar, function_tools,
                    shown_tools, template_tools)

__all__ = ["BUNDLED_REPETITION_PENALTY", "REPETITION_CONTEXT", "Options", "MlxStreamModel"]

Options = build_options(llm.Options)


def repetition_processors(penalty: float) -> list:
    """mlx-lm's repetition penalty as a logits processor, when it is on. It is a
    deterministic function of the logits and the history, so decoding stays exact at
    every pool size and under speculation (it is `Stateless`)."""
    if penalty == 1.0:
        return []
    from mlx_lm.sample_utils import make_logits_processors

    from .processors import Stateless

    return [Stateless(p) for p in make_logits_processors(repetition_penalty=penalty,
                                                          repetition_context_size=REPETITION_CONTEXT)]


@dataclass(frozen=True)
class BuiltPrompt:
    """What the model hands the engine for one prompt, rendered with the checkpoint's
    tokenizer before the request is queued."""

    tokens: list[int]
    generation_prompt: str  # the template's text after the last message (it may open a thinking block)
    processors: list  # logits processors, in the order they apply
    budget_aware: tuple = ()  # those of them told the reply's token budget (a schema's)


def build_prompt(tokenizer, prompt, *, thinking, tools, grammar, processors: list, forced=None,
                 thinking_budget: Optional[int] = None) -> BuiltPrompt:
    """Token ids for llm's `prompt`, with `processors` (and the reasoning cap of
    `thinking_budget`) and, for a `--schema` (`grammar`) or a forced tool call
    (`forced(generation prompt)` -> its grammar), the processor that constrains the reply to it."""
    tokens, generation_prompt = render_prompt(tokenizer, prompt, thinking=thinking, tools=tools)
    if thinking_budget and thinking is not False:
        processors = [*processors, _reasoning_cap(tokenizer, tokens, generation_prompt, thinking_budget)]
    if forced is not None:
        grammar = forced(generation_prompt)
    budget_aware: tuple = ()
    if grammar is not None:
        budget_aware = (SchemaProcessor(grammar, tokenizer),)
    return BuiltPrompt(tokens, generation_prompt, [*processors, *budget_aware], budget_aware)


def _reasoning_cap(tokenizer, tokens: list[int], generation_prompt: str, budget: int):
    from .processors import reasoning_cap

    start, end = getattr(tokenizer, "think_start", None), getattr(tokenizer, "think_end", None)
    ids = [tokenizer.encode(tag, add_special_tokens=False) if tag else [] for tag in (start, end)]
    if not all(len(i) == 1 for i in ids):
        raise PromptError("thinking_budget: this model's think tags are not single tokens, so the block "
                          "cannot be closed at a budget")
    return reasoning_cap(len(tokens), opens_thinking(generation_prompt, start, end), ids[0][0], ids[1][0], budget)


class MlxStreamModel(llm.Model):
    can_stream = True
    supports_schema = True  # constrained decoding (constrained.py)
    supports_tools = True  # through the chat template (tools.py)
    Options = Options

    def __init__(self, name: Optional[str] = None):
        """``name=None`` is the ``mlx-stream`` id: whichever model is the default."""
        self.name = name
        self.model_id = registry.MODEL_PREFIX if name is None else f"{registry.MODEL_PREFIX}/{name}"

    def __str__(self) -> str:
        return f"MLX streaming: {self.model_id}"

    # -- execution --------------------------------------------------------

    def execute(self, prompt, stream, response, conversation):
        yield from self._execute(prompt, response)

    def _execute(self, prompt, response, on_generation=None):
        """The reply's stream events; `on_generation` is told the engine's handle
        (the async model cancels through it)."""
        from .engine.manager import get_manager

        settings = load_settings()
        options = prompt.options
        drafter(options, settings)  # an unknown drafter is refused before a server sees it
        # -- a running `llm mlxs serve` for this user dir answers instead ---
        server = running_server(options, settings, prompt)
        if server is not None:
            yield from server.answer(self.model_id, prompt, response, on_generation)
            return
        r = resolve(self.name, options, settings)
        grammar = _schema_grammar(prompt.schema) if prompt.schema else None
        tools = template_tools(function_tools(prompt))
        engine = get_manager()
        with _one_line_errors(r):
            ready = engine.tokenizer_for(r.load)
            if on_generation is not None:
                on_generation(ready)
            forced = _forcing(ready.tokenizer, tools, options, grammar)
            tools = shown_tools(tools, options.tool_choice)
            built = build_prompt(ready.tokenizer, prompt, thinking=options.thinking, tools=tools, grammar=grammar,
                                 processors=repetition_processors(r.repetition_penalty), forced=forced,
                                 thinking_budget=options.thinking_budget)
        request = r.request(built.tokens, built.processors, built.budget_aware)
        end_tag = ready.tokenizer.tool_call_end if tools else None
        one_call = bool(end_tag) and options.parallel_tool_calls is False
        if one_call:  # the reply ends with its first call
            request.stop = (*request.stop, end_tag)
        generation = engine.run(r.load, request)
        if on_generation is not None:
            on_generation(generation)
        generated: list[int] = []
        with generation, _one_line_errors(r):
            tokenizer = generation.tokenizer
            start = getattr(tokenizer, "think_start", None)
            end = getattr(tokenizer, "think_end", None)
            if options.thinking is False:  # -o thinking off: no reasoning events, whatever the model writes
                start = end = None
            splitter = ReplySplitter(
                start, end, opens_thinking(built.generation_prompt, start, end),
                *((tokenizer.tool_call_start, tokenizer.tool_call_end) if tools else ()),
            )
            reader = CallReader(tokenizer, tools)
            eos = set(getattr(tokenizer, "eos_token_ids", ()) or ())
            raw: list[str] = []  # the reply's text as generated (tags and markup included)
            logprobs: Optional[list] = [] if options.top_logprobs is not None else None
            finish = None
            for result in generation:
                if result.token not in eos or result.finish_reason != "stop":
                    generated.append(int(result.token))
                    if logprobs is not None:
                        logprobs.append(_logprob_entry(tokenizer, result))
                raw.append(result.text)
                finish = result.finish_reason
                for kind, chunk in splitter.feed(result.text):
                    yield from _events(kind, chunk, tokenizer, reader, response, generated)
        for kind, chunk in splitter.flush():
            if kind == UNFINISHED_TOOL and one_call and finish == "stop":  # stopped at the call's end tag
                kind = TOOL
            yield from _events(kind, chunk, tokenizer, reader, response, generated)
        # The reply's own token ids, logged with it, so a later turn can
        # reuse the KV cache exactly (see prompting.py).
        yield stream_event("text", "", reply_metadata(_spelled(tokenizer, generated, "".join(raw))))

        stats = _jsonable({**r.plan_figures, **generation.stats})
        if logprobs is not None:
            stats["logprobs"] = logprobs
        _check_schema_closed(stats, built.budget_aware if grammar else (), generated)
        response.set_usage(input=len(generation.started.prompt_tokens), output=stats.get("generated_tokens"))
        response.response_json = stats
        response.set_resolved_model(r.resolved_model)


def _forcing(tokenizer, tools: list[dict], options, grammar):
    """What builds the grammar of the tool call `options.tool_choice` forces, once the
    generation prompt is known (it may open a think block), or None."""
    if options.tool_choice in (None, AUTO, NONE):
        return None
    check_tool_choice(options.tool_choice, tools)
    if grammar:
        raise ToolError("a schema and a forced tool call (tool_choice) cannot be combined")
    start, end = getattr(tokenizer, "think_start", None), getattr(tokenizer, "think_end", None)
    return lambda generation_prompt: forced_call_grammar(
        tokenizer, tools, options.tool_choice, options.parallel_tool_calls,
        thinking=opens_thinking(generation_prompt, start, end))


def _check_schema_closed(stats: dict, budget_aware: tuple, reply: list[int]) -> None:
    """Record whether a --schema reply is a complete document; warn in one line when
    max_tokens cut it short."""
    if not budget_aware:
        return
    (schema,) = budget_aware
    stats["schema_closed"] = schema.closed(reply)
    if notice := cut_short_notice(stats):
        click.echo(notice, err=True)


@contextmanager
def _one_line_errors(r: RunConfig):
    """Whatever loading, rendering or generating raises reaches the user as one line
    (KeyboardInterrupt passes through: the generation is closed and the engine stays usable)."""
    from .engine.manager import EngineError, LoadError

    try:
        yield
    except MlxStreamError:
        raise
    except LoadError as exc:
        raise MlxStreamError(f"Could not load '{r.name}' ({r.path}): {exc}") from None
    except (EngineError, PromptError, SchemaError, ToolError) as exc:
        raise MlxStreamError(str(exc)) from None
    except Exception as exc:  # template errors, OSError from a changed file, mlx errors
        raise MlxStreamError(f"{type(exc).__name__}: {one_line(exc)}") from None


def _schema_grammar(schema) -> str:
    """The grammar of `--schema`, compiled before anything is loaded; one line if it cannot be."""
    try:
        return schema_grammar(schema)
    except SchemaError as exc:
        raise MlxStreamError(f"--schema: {exc}") from None


def _spelled(tokenizer, generated: list[int], text: str, scan: int = 32) -> list[int]:
    """Ids that spell the reply's `text`: the generated ids, or, when a stop sequence
    cut the text inside them, the longest run of them that spells a prefix of it (the
    part the KV cache holds) and the rest encoded."""
    def spelled(ids):  # the streaming detokenizer drops a reply's leading space
        out = tokenizer.decode(ids)
        return out[1:] if out.startswith(" ") and not text.startswith(" ") else out

    if spelled(generated) == text:
        return generated
    for k in range(len(generated) - 1, max(-1, len(generated) - 1 - scan), -1):
        prefix = spelled(generated[:k]) if k else ""
        if text.startswith(prefix):
            rest = text[len(prefix):]
            return generated[:k] + (encode_text(tokenizer, rest) if rest else [])
    return generated


def _events(kind: str, chunk: str, tokenizer, reader: CallReader, response, generated: list[int]):
    """Stream events for one piece of the split reply. A tool call is streamed as the
    reader reads it and becomes an llm tool call (`response.add_tool_call`) when its
    block ends; a block that is no call is shown as the text the model wrote."""
    if kind == TOOL_TEXT:
        for event in reader.piece(chunk):
            yield _call_event(*event)
    elif kind in (TOOL, UNFINISHED_TOOL):
        closed = reader.close(chunk, finished=kind == TOOL)
        if closed is None:
            end = tokenizer.tool_call_end if kind == TOOL else ""
            yield stream_event("text", f"{tokenizer.tool_call_start}{chunk}{end}")
            return
        events, calls = closed
        for call in calls:
            response.add_tool_call(llm.ToolCall(name=call["name"], arguments=call["arguments"],
                                                tool_call_id=call["id"]))
        for event in events[:-1]:
            yield _call_event(*event)
        # the ids so far ride on the call: a reply that ends in tool calls has no text
        # part to carry them (prompting.py splices them into the next turn)
        yield _call_event(*events[-1], metadata=reply_metadata(generated))
    elif chunk:
        yield stream_event(kind, chunk)


def _call_event(kind: str, call_id: str, chunk: str, metadata: Optional[dict] = None):
    from llm.parts import StreamEvent

    return StreamEvent(type=f"tool_call_{'name' if kind == 'name' else 'args'}", chunk=chunk, tool_call_id=call_id,
                       provider_metadata=metadata)


def _logprob_entry(tokenizer, result) -> dict:
    """A generated token with its log-probability and the most likely alternatives."""
    logprob, top = result.logprobs
    return {"token": tokenizer.decode([int(result.token)]), "logprob": logprob,
            "top_logprobs": [{"token": tokenizer.decode([i]), "logprob": value} for i, value in top]}


def _jsonable(stats: dict) -> dict:
    """Engine figures as plain JSON types (paths, numpy scalars -> str/float)."""
    return json.loads(json.dumps(stats, default=_coerce))


def _coerce(value):
    for cast in (int, float):
        try:
            if cast(value) == value:
                return cast(value)
        except (TypeError, ValueError):
            pass
    return str(value)
