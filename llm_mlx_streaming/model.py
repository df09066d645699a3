"""The ``llm.Model`` that serves ``mlx-stream`` and ``mlx-stream/<name>``.

It turns llm's message chain into chat-template tokens (``prompting.py``),
resolves options against the settings and streams the engine's text, with
``<think>`` blocks as reasoning events. The engine (``engine.manager``) owns
the loaded model, the expert pools and the KV cache and reuses the cache when
a new prompt extends the last one, so each turn simply passes the *whole*
conversation and ``llm chat`` turns prefill only what is new.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import click
import llm

from . import registry
from .engine.request import LoadSpec, Request
from .experts.policies import DEFAULT_POLICY
from .errors import MlxStreamError, one_line
from .sizes import parse_size
from .knobs import AUTO_BUDGET_SHARE, BUNDLED_NAME, BUNDLED_REPETITION_PENALTY, REPETITION_CONTEXT, build_options
from .settings import Settings, budget_bytes, load_settings, trace_file

__all__ = ["BUNDLED_REPETITION_PENALTY", "REPETITION_CONTEXT", "Options", "MlxStreamModel"]

Options = build_options(llm.Options)


# -- repetition penalty ----------------------------------------
def _repetition_processors(options, name: str) -> list:
    """mlx-lm's repetition penalty as a logits processor, when it is on: the bundled demo
    gets one by default, because so small a model's greedy text soon loops. It is a
    deterministic function of the logits, so decoding stays exact at every pool size."""
    penalty = options.repetition_penalty
    if penalty is None:
        penalty = BUNDLED_REPETITION_PENALTY if name == BUNDLED_NAME else 1.0
    if penalty == 1.0:
        return []
    from mlx_lm.sample_utils import make_logits_processors

    from .processors import Stateless

    return [Stateless(p) for p in make_logits_processors(repetition_penalty=penalty,
                                                          repetition_context_size=REPETITION_CONTEXT)]


@dataclass
class Resolved:
    """What one prompt runs on: the model, its checkpoint and how its pools are sized."""

    name: str
    path: Path
    slots: Union[int, list[int], None]  # None: a slot per expert
    slots_source: Optional[str]  # option | plan | model | setting | bundled
    budget: Optional[int]  # bytes, when the pools come from a memory plan
    policy: Optional[str]
    resolved_model: str  # what the response records as the model that answered
    kv: Any = None  # engine.kv.KVSpec: how the attention cache is kept
    prefill_step: Optional[int] = None  # None: mlx-lm's default chunk

    def load_spec(self, settings: Settings) -> LoadSpec:
        return LoadSpec(
            path=self.path,
            expert_slots=self.slots,
            policy=self.policy or DEFAULT_POLICY,
            threads=settings.threads,
            page_cache=settings.page_cache,
            packed=settings.packed != "off",
        )


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

    # -- resolution -------------------------------------------------------

    def _resolve(self, options: Options, settings: Settings) -> Resolved:
        name = registry.default_name(settings) if self.name is None else self.name
        if name != BUNDLED_NAME and name not in settings.models:
            if self.name is None:
                raise MlxStreamError(
                    f"Default model '{name}' is not registered; "
                    "run `llm mlxs default NAME` or `llm mlxs config --unset default_model`"
                )
            raise MlxStreamError(f"Unknown model '{name}'; see `llm mlxs models`")
        path, entry = registry.checkpoint_for(name, settings)
        kv = kv_spec(options, settings)
        budget = layout = None
        if options.expert_slots:
            slots, source = options.expert_slots, "option"
        elif options.memory_budget is None and (stored := registry.effective_slots(name, entry, settings)):
            slots, source = stored, registry.slots_source(name, entry, settings)
        else:
            value = options.memory_budget or settings.memory_budget
            budget = budget_bytes(value)
            slots, layout = plan_slots(name, path, value, budget, settings.max_context, kv)
            source = "plan"
        return Resolved(
            name=name,
            path=path,
            slots=slots,
            slots_source=source,
            budget=budget,
            policy=options.policy or settings.policy,
            resolved_model=(entry.source if entry and entry.source else None) or str(path),
            kv=kv,
            prefill_step=prefill_step(options, settings, path, budget, kv, layout),
        )

    # -- execution --------------------------------------------------------

    def execute(self, prompt, stream, response, conversation):
        yield from self._execute(prompt, response)

    def _execute(self, prompt, response, on_generation=None):
        """The reply's stream events; `on_generation` is told the engine's handle
        (the async model cancels through it)."""
        from .engine.manager import get_manager
        from .prompting import render_prompt, reply_metadata, stream_event
        from .replies import ReplySplitter, opens_thinking
        from .tools import function_tools, template_tools

        settings = load_settings()
        options = prompt.options
        speculation = _speculation(options, settings)
        # -- a running `llm mlxs serve` for this user dir answers instead ---
        from .server.client import running_server

        server = running_server(options, settings, prompt)
        if server is not None:
            yield from server.answer(self.model_id, prompt, response, on_generation)
            return
        r = self._resolve(options, settings)
        rendered = {}
        processors: list = _repetition_processors(options, r.name)  # render adds the schema's
        grammar = _schema_grammar(prompt.schema) if prompt.schema else None

        tools = template_tools(function_tools(prompt))

        def render(tokenizer):
            tokens, rendered["generation_prompt"] = render_prompt(
                tokenizer, prompt, thinking=options.thinking, tools=tools
            )
            if grammar is not None:
                from .constrained import SchemaProcessor

                processors.append(SchemaProcessor(grammar, tokenizer))
            return tokens

        generation = get_manager().run(r.load_spec(settings), Request(
            prompt=render,
            max_tokens=settings.max_tokens if options.max_tokens is None else options.max_tokens,
            stop=options.stop or (),
            conversation_cache=conversation_cache_spec(settings),
            logits_processors=processors,
            temperature=options.temperature or 0.0,
            top_p=options.top_p or 0.0,
            min_p=options.min_p or 0.0,
            top_k=options.top_k or 0,
            seed=options.seed,
            max_context=settings.max_context,
            trace_path=trace_file(r.name) if settings.trace else None,
            **speculation,
            kv=r.kv,
            prefill_step=r.prefill_step,
        ))
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
                start, end, opens_thinking(rendered["generation_prompt"], start, end),
                *((tokenizer.tool_call_start, tokenizer.tool_call_end) if tools else ()),
            )
            eos = set(getattr(tokenizer, "eos_token_ids", ()) or ())
            raw: list[str] = []  # the reply's text as generated (tags and markup included)
            for result in generation:
                if result.token not in eos or result.finish_reason != "stop":
                    generated.append(int(result.token))
                raw.append(result.text)
                for kind, chunk in splitter.feed(result.text):
                    yield from _events(kind, chunk, tokenizer, tools, response, generated)
        for kind, chunk in splitter.flush():
            yield from _events(kind, chunk, tokenizer, tools, response, generated)
        # The reply's own token ids, logged with it, so a later turn can
        # reuse the KV cache exactly (see prompting.py).
        yield stream_event("text", "", reply_metadata(_spelled(tokenizer, generated, "".join(raw))))

        stats = _jsonable({**generation.stats, **_plan_figures(generation.stats, r)})
        _check_schema_closed(stats, processors, generated)
        response.set_usage(input=len(generation.started.prompt_tokens), output=stats.get("generated_tokens"))
        response.response_json = stats
        response.set_resolved_model(r.resolved_model)


def _check_schema_closed(stats: dict, processors: list, reply: list[int]) -> None:
    """Record whether a --schema reply is a complete document; warn in one line when
    max_tokens cut it short."""
    from .constrained import SchemaProcessor, cut_short_notice

    schema = next((p for p in processors if isinstance(p, SchemaProcessor)), None)
    if schema is None:
        return
    stats["schema_closed"] = schema.closed(reply)
    if notice := cut_short_notice(stats):
        click.echo(notice, err=True)


def _speculation(options: Options, settings: Settings) -> dict:
    """Request fields for speculative decoding; an unknown drafter is refused here,
    before anything runs, is sent to a server or is logged: the one given with -o draft
    whatever k is, the setting's only when it is used."""
    from .speculation.kinds import builtin_kinds

    k = settings.k if options.k is None else options.k
    draft = settings.draft if options.draft is None else options.draft
    fields: dict[str, Any] = {"k": k, "draft": draft}
    if (k == 0 and options.draft is None) or draft in builtin_kinds():
        return fields
    try:
        name = registry.resolve_name(draft, settings)
        fields["draft_path"], _ = registry.checkpoint_for(name, settings)
    except MlxStreamError:
        kinds = ", ".join(sorted(builtin_kinds()))
        raise MlxStreamError(
            f"Unknown draft '{draft}': use {kinds}, or the name of a model added with `llm mlxs add`"
        ) from None
    return fields


@contextmanager
def _one_line_errors(r: Resolved):
    """Whatever loading, rendering or generating raises reaches the user as one line
    (KeyboardInterrupt passes through: the generation is closed and the engine stays usable)."""
    from .constrained import SchemaError
    from .engine.manager import EngineError, LoadError
    from .prompting import PromptError
    from .tools import ToolError

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
    from .constrained import SchemaError, schema_grammar

    try:
        return schema_grammar(schema)
    except SchemaError as exc:
        raise MlxStreamError(f"--schema: {exc}") from None


def plan_slots(name: str, path, value: str, budget: int, max_context: int, kv=None):
    """(Slots per MoE layer that fit `budget` bytes, None for a model without MoE layers;
    the checkpoint layout the plan read, for the prefill step), with the KV cache sized
    for layout `kv`.

    A budget too small for the model is the planner's one-line error.
    """
    from .engine.planner import PlanError, checkpoint_layout, plan_memory
    from .errors import CheckpointError

    try:
        layout = checkpoint_layout(path)
        plan = plan_memory(path, budget, max_context=max_context, kv=kv, layout=layout)
    except PlanError as exc:
        if value == "auto":
            raise MlxStreamError(
                f"memory_budget auto ({AUTO_BUDGET_SHARE:.0%} of this machine's memory): {exc}"
            ) from None
        raise MlxStreamError(str(exc)) from None
    except (CheckpointError, ValueError, OSError) as exc:
        raise MlxStreamError(f"Could not plan '{name}' ({path}): {one_line(exc)}") from None
    return list(plan.slots_per_layer) or None, layout


# -- long context (engine/kv.py) ------------------------------------------------------


def conversation_cache_spec(settings: Settings):
    """Where and how large the conversation cache on disk is (None: it is off)."""
    from .engine.disk_cache import DiskCacheSpec

    if not settings.conversation_cache:
        return None
    return DiskCacheSpec(llm.user_dir() / "mlx-streaming" / "kv-cache", parse_size(settings.conversation_cache_size))


def kv_spec(options: Options, settings: Settings):
    """The KV layout of one prompt: options over settings."""
    from .engine.kv import KVSpec

    bits = options.kv_bits if options.kv_bits is not None else settings.kv_bits
    return KVSpec(
        bits=None if bits == "off" else int(bits),
        group_size=options.kv_group_size or settings.kv_group_size,
        start=settings.kv_start if options.kv_start is None else options.kv_start,
    )


def prefill_step(options: Options, settings: Settings, path, budget: Optional[int], kv,
                 layout=None) -> Optional[int]:
    """Prompt tokens per prefill chunk: a number given, or for auto the planner's choice
    for the memory budget (None, i.e. mlx-lm's default, when it cannot tell). `layout`:
    the checkpoint's, when the memory plan has read it already."""
    from .engine.planner import prefill_step_for
    from .errors import CheckpointError

    step = options.prefill_step or settings.prefill_step
    if step != "auto":
        return int(step)
    try:
        if budget is None:
            budget = budget_bytes(options.memory_budget or settings.memory_budget)
        return prefill_step_for(path, budget, max_context=settings.max_context, kv=kv, layout=layout)
    except (MlxStreamError, CheckpointError, ValueError, OSError):
        return None


def _plan_figures(stats: dict, r: Resolved) -> dict:
    """Where the pool size came from, for response_json."""
    out: dict[str, Any] = {"slots_from": r.slots_source}
    if r.budget is not None:
        out["memory_budget_bytes"] = r.budget
    return {k: v for k, v in out.items() if k not in stats}


def _spelled(tokenizer, generated: list[int], text: str, scan: int = 32) -> list[int]:
    """Ids that spell the reply's `text`: the generated ids, or, when a stop sequence
    cut the text inside them, the longest run of them that spells a prefix of it (the
    part the KV cache holds) and the rest encoded."""
    from .prompting import encode_text

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


def _events(kind: str, chunk: str, tokenizer, tools: list[dict], response, generated: list[int]):
    """Stream events for one piece of the split reply. A tool-call block becomes
    llm tool calls (events and `response.add_tool_call`); markup its parser cannot
    read, or cut off by the end of the reply, is shown as the text the model wrote."""
    from llm.parts import StreamEvent

    from .prompting import reply_metadata, stream_event
    from .replies import TOOL, UNFINISHED_TOOL
    from .tools import parse_tool_calls

    if kind == TOOL:
        calls = parse_tool_calls(tokenizer, chunk, tools)
        if calls is None:
            yield stream_event("text", f"{tokenizer.tool_call_start}{chunk}{tokenizer.tool_call_end}")
            return
        for call in calls:
            response.add_tool_call(llm.ToolCall(
                name=call["name"], arguments=call["arguments"], tool_call_id=call["id"]
            ))
            yield StreamEvent(type="tool_call_name", chunk=call["name"], tool_call_id=call["id"])
            # the ids so far ride on the call: a reply that ends in tool calls has no
            # text part to carry them (prompting.py splices them into the next turn)
            yield StreamEvent(type="tool_call_args", chunk=json.dumps(call["arguments"]), tool_call_id=call["id"],
                              provider_metadata=reply_metadata(generated))
    elif kind == UNFINISHED_TOOL:
        yield stream_event("text", f"{tokenizer.tool_call_start}{chunk}")
    elif chunk:
        yield stream_event(kind, chunk)


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
