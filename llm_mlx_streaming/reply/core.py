"""One reply, driven from a thread (llm's sync model) or from an event loop (the
server): resolve the run configuration, render the prompt with the checkpoint's
tokenizer, queue the generation on the engine thread, and turn its tokens into the
core's events (reply/events.py), ending with the `Outcome`.

The server awaits the engine's handle directly (engine/generation.py): no thread of
its own per request and no trip through llm's model registry.
"""

from __future__ import annotations

import asyncio
from contextlib import contextmanager
from typing import AsyncIterator, Iterator, Optional

from ..engine.generation import Cancelled, Generation, Started
from ..engine.manager import get_manager
from ..engine.provider import EngineError, LoadError
from ..errors import MlxStreamError, one_line
from ..options.run_config import RunConfig, configure
from ..options.settings import load_settings
from ..prompt.constrained import SchemaError
from ..prompt.messages import PromptError
from ..prompt.render import encode_text
from ..prompt.split import TOOL, TOOL_TEXT, UNFINISHED_TOOL, ReplySplitter, initial_state
from ..prompt.tools import CallReader, ToolError
from . import caps
from .build import Ask, Prepared, count, grammar_of, prepare
from .events import CallArguments, CallBegins, Chunk, Event, Finished, Outcome, ToolCall, plain


def reply(ask: Ask) -> Iterator[Event]:
    """The events of one reply, read on this thread (closing it cancels the generation)."""
    run = configure(ask.model, ask.options, load_settings())
    grammar = grammar_of(ask)
    engine = get_manager()
    with one_line_errors(run):
        ready = engine.tokenizer_for(run.load)
        prepared = prepare(ready.tokenizer, run, ask, grammar)
    generation = engine.run(run.load, prepared.request)
    replier = Replier(run, ask, prepared)
    with generation, one_line_errors(run):
        replier.start(generation.wait_started().started)
        for result in generation:
            yield from replier.feed(result)
    yield from replier.finish(generation)


class AsyncReply:
    """One reply read on an event loop; `cancel()` (from any task) stops it at the
    engine's next token, and its events then simply end."""

    def __init__(self, ask: Ask) -> None:
        self.ask = ask
        self.cancelled = False
        self.capped: dict = {}  # the values the engine lowered (reply/caps.py), once the generation started
        self._handles: list[Generation] = []

    def cancel(self) -> None:
        self.cancelled = True
        for handle in self._handles:
            handle.cancel()

    def _hold(self, handle: Generation) -> Generation:
        self._handles.append(handle)
        if self.cancelled:
            handle.cancel()
        return handle

    async def events(self) -> AsyncIterator[Event]:
        ask, engine = self.ask, get_manager()
        run, grammar = await asyncio.to_thread(_configured, ask)  # it may read checkpoint headers to plan
        try:
            with one_line_errors(run):
                ready = await self._hold(engine.tokenizer_for(run.load)).astarted()
                prepared = await asyncio.to_thread(prepare, ready.tokenizer, run, ask, grammar)
            generation = self._hold(engine.run(run.load, prepared.request))
            replier = Replier(run, ask, prepared)
            with one_line_errors(run):
                replier.start((await generation.astarted()).started)
                self.capped = replier.capped
                async for result in generation:
                    for event in replier.feed(result):
                        yield event
            for event in replier.finish(generation):
                yield event
        except Cancelled:
            return
        finally:
            for handle in self._handles:
                handle.cancel()  # a no-op once it is done; the engine thread lets go at its next token


async def count_tokens(ask: Ask) -> int:
    """The prompt's token count as /v1/messages would render it (the tokenizer may load)."""
    run, _ = await asyncio.to_thread(_configured, ask)
    with one_line_errors(run):
        ready = await get_manager().tokenizer_for(run.load).astarted()
        return await asyncio.to_thread(count, ready.tokenizer, ask)


def _configured(ask: Ask) -> tuple[RunConfig, Optional[str]]:
    return configure(ask.model, ask.options, load_settings()), grammar_of(ask)


class Replier:
    """A generation's tokens -> the core's events: text and reasoning split at the think
    tags, tool calls read out of their markup, and the outcome at the end."""

    def __init__(self, run: RunConfig, ask: Ask, prepared: Prepared) -> None:
        self.run, self.ask, self.prepared = run, ask, prepared
        self.generated: list[int] = []
        self.raw: list[str] = []  # the reply's text as generated (tags and markup included)
        self.logprobs: Optional[list] = [] if ask.options.top_logprobs is not None else None
        self.finish_reason = None
        self.calls: list[ToolCall] = []
        self.capped: dict = {}

    def start(self, started: Started) -> None:
        """Once the engine has started the generation: the splitter, the tool-call reader
        and the values it lowered."""
        self.tokenizer = tokenizer = started.tokenizer
        self.capped = caps.capped(self.run, started.max_tokens)
        self.splitter = ReplySplitter(tokenizer, initial_state(tokenizer, self.prepared.generation_prompt),
                                      thinking=self.ask.options.thinking is not False)
        self.reader = CallReader(tokenizer, self.prepared.tools)
        self.eos = set(getattr(tokenizer, "eos_token_ids", ()) or ())

    def feed(self, result) -> list[Event]:
        """The events one mlx-lm GenerationResponse makes certain."""
        if result.token not in self.eos or result.finish_reason != "stop":
            self.generated.append(int(result.token))
            if self.logprobs is not None:
                self.logprobs.append(_logprob_entry(self.tokenizer, result))
        text = result.text
        if not self.raw and self.ask.suffix is not None and _dropped_space(self.tokenizer, result.token, text):
            text = " " + text  # filling in code, a leading space is part of the answer
        self.raw.append(text)
        self.finish_reason = result.finish_reason
        return [e for kind, chunk in self.splitter.feed(text) for e in self._events(kind, chunk)]

    def finish(self, generation: Generation) -> list[Event]:
        """The held-back events and the outcome."""
        out = []
        for kind, chunk in self.splitter.flush():
            if kind == UNFINISHED_TOOL and self.finish_reason == "stop":
                kind = TOOL  # the turn's end (or the call's end tag as a stop) closed the block
            out.extend(self._events(kind, chunk))
        figures = plain({**self.run.plan_figures, **generation.stats})
        if self.logprobs is not None:
            figures["logprobs"] = self.logprobs
        if self.capped:
            figures["capped"] = self.capped
        for schema in self.prepared.schema_check:
            figures["schema_closed"] = schema.closed(self.generated)
        tokens = _spelled(self.tokenizer, self.generated, "".join(self.raw))
        out.append(Finished(Outcome(figures, tokens, self.calls, self.run.resolved_model)))
        return out

    def _events(self, kind: str, chunk: str) -> list[Event]:
        """Events for one piece of the split reply. A tool call streams as the reader
        reads it; a block that is no call (or comes with no tools given) is the text
        the model wrote."""
        tools = bool(self.prepared.tools)
        if kind == TOOL_TEXT:
            return [_call_event(*e) for e in self.reader.piece(chunk)] if tools else []
        if kind in (TOOL, UNFINISHED_TOOL):
            closed = self.reader.close(chunk, finished=kind == TOOL) if tools else None
            if closed is None:
                end = self.tokenizer.tool_call_end if kind == TOOL else ""
                return [Chunk("text", f"{self.tokenizer.tool_call_start}{chunk}{end}")]
            events, calls = closed
            self.calls.extend(ToolCall(c["id"], c["name"], c["arguments"], complete=kind == TOOL) for c in calls)
            return [_call_event(*e) for e in events]
        return [Chunk(kind, chunk)] if chunk else []


def _dropped_space(tokenizer, token: int, text: str) -> bool:
    """Whether mlx-lm's streaming detokenizer dropped the leading space of a reply's first token."""
    return not text.startswith(" ") and tokenizer.decode([int(token)]).startswith(" ")


def _call_event(kind: str, call_id: str, chunk: str) -> Event:
    return CallBegins(call_id, chunk) if kind == "name" else CallArguments(call_id, chunk)


@contextmanager
def one_line_errors(run: RunConfig):
    """Whatever loading, rendering or generating raises reaches the user as one line
    (KeyboardInterrupt passes through: the generation is closed and the engine stays usable)."""
    try:
        yield
    except (MlxStreamError, Cancelled):
        raise
    except LoadError as exc:
        raise MlxStreamError(f"Could not load '{run.name}' ({run.path}): {exc}") from None
    except (EngineError, PromptError, SchemaError, ToolError) as exc:
        raise MlxStreamError(str(exc)) from None
    except Exception as exc:  # template errors, OSError from a changed file, mlx errors
        raise MlxStreamError(f"{type(exc).__name__}: {one_line(exc)}") from None


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


def _logprob_entry(tokenizer, result) -> dict:
    """A generated token with its log-probability and the most likely alternatives."""
    logprob, top = result.logprobs
    return {"token": tokenizer.decode([int(result.token)]), "logprob": logprob,
            "top_logprobs": [{"token": tokenizer.decode([i]), "logprob": value} for i, value in top]}
