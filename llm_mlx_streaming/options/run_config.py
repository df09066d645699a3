"""Options over settings, resolved once into what a prompt runs with.

`configure` is the one place where "an option given wins over the setting of the same
name" is written; the model, `llm mlxs plan` and the server all call it (or the parts it
is made of), so they cannot disagree about which checkpoint, pools, KV layout, prefill
chunk, sampling or drafter a request gets.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import llm

from . import registry
from ..engine.kv import KVSpec
from ..engine.request import LoadSpec, Request, Sampling
from ..errors import CheckpointError, MlxStreamError, one_line
from ..experts.policies import DEFAULT_POLICY
from .knobs import AUTO_BUDGET_SHARE, BUNDLED_NAME, BUNDLED_REPETITION_PENALTY
from .settings import Settings, budget_bytes, trace_file
from ..sizes import parse_size
from ..values import DEFAULT_MAX_CONTEXT, SNAPSHOT_MOST, SNAPSHOT_SHARE
from ..engine.disk_cache import DiskCacheSpec
from ..engine.snapshots import SnapshotSpec
from ..engine.footprint import model_footprint
from ..engine.planner import (PlanError, auto_context, checkpoint_layout, default_reserve, model_context, plan_memory,
                              prefill_step_for)


@dataclass(frozen=True)
class RunConfig:
    """Everything one prompt runs with, options and settings merged."""

    name: str
    path: Path
    resolved_model: str  # what the response records as the model that answered
    load: LoadSpec
    slots_source: Optional[str]  # option | plan | model | setting | bundled
    budget: Optional[int]  # bytes, when the pools come from a memory plan
    shared_budget: Optional[int]  # bytes the loaded models share under these options (None: not told)
    kv: KVSpec
    prefill_step: Any  # tokens per model call of a prefill; auto: the plan's engine/planner.ExpertChunk; None: 2048
    max_tokens: int
    max_context: int
    sampling: Sampling
    top_logprobs: Optional[int] = None
    repetition_penalty: float = 1.0
    stop: Sequence[str] = ()
    thinking: Optional[bool] = None
    k: Union[int, str] = 0
    draft: str = "ngram"
    draft_path: Optional[Path] = None
    trace_path: Optional[Path] = None
    conversation_cache: Any = None  # engine.disk_cache.DiskCacheSpec, None: off
    snapshots: Any = None  # engine.snapshots.SnapshotSpec, None: off
    max_batch: int = 1
    plan_figures: dict = field(default_factory=dict)

    def request(self, tokens: Sequence[int], logits_processors: list, budget_aware: Sequence = ()) -> Request:
        """The engine request for the prompt's token ids."""
        return Request(
            prompt=tokens, max_tokens=self.max_tokens, stop=self.stop, conversation_cache=self.conversation_cache,
            snapshots=self.snapshots,
            logits_processors=logits_processors, budget_aware=budget_aware, sampling=self.sampling,
            max_context=self.max_context,
            top_logprobs=self.top_logprobs,
            trace_path=self.trace_path, k=self.k, draft=self.draft, draft_path=self.draft_path,
            kv=self.kv, prefill_step=self.prefill_step, max_batch=self.max_batch,
        )


def configure(name: Optional[str], options, settings: Settings) -> RunConfig:
    """The run configuration of model `name` (None: the default model) for `options`;
    one-line MlxStreamErrors for an unknown model, drafter or a budget too small."""
    name = checked_name(name, settings)
    path, entry = registry.checkpoint_for(name, settings)
    kv = kv_spec(options, settings)
    draft, draft_path = drafter(options, settings)
    budget = layout = None
    if options.expert_slots:
        slots, source = options.expert_slots, "option"
    elif options.memory_budget is None and (stored := registry.effective_slots(name, entry, settings)):
        slots, source = stored, registry.slots_source(name, entry, settings)
    else:
        source = "plan"
    context = planned_context(name, path, options, settings, kv, planned=source == "plan")
    if source == "plan":
        value = budget_value(options, settings)
        budget = budget_bytes(value)
        slots, layout = plan_slots(name, path, value, budget, context, kv, snapshot_budget(settings, budget))
    shared, footprint = shared_budget(options, settings, path, budget, context, kv, layout)
    return RunConfig(
        name=name,
        path=path,
        resolved_model=(entry.source if entry and entry.source else None) or str(path),
        load=LoadSpec(
            path=path, expert_slots=slots, policy=options.policy or settings.policy or DEFAULT_POLICY,
            threads=settings.threads, page_cache=settings.page_cache, packed=settings.packed != "off",
            overlap=settings.overlap, buffer_cache=buffer_cache(options, settings, budget),
            footprint=footprint,
        ),
        slots_source=source,
        budget=budget,
        shared_budget=shared,
        kv=kv,
        prefill_step=prefill_step(options, settings, path, budget, kv, layout, context),
        max_tokens=settings.max_tokens if options.max_tokens is None else options.max_tokens,
        max_context=context_limit(options, context),
        sampling=Sampling(temperature=options.temperature or 0.0, top_p=options.top_p or 0.0,
                          min_p=options.min_p or 0.0, top_k=options.top_k or 0, seed=options.seed),
        top_logprobs=options.top_logprobs,
        repetition_penalty=repetition_penalty(options, name),
        stop=tuple(options.stop or ()),
        thinking=options.thinking,
        k=settings.k if options.k is None else options.k,
        draft=draft,
        draft_path=draft_path,
        trace_path=trace_file(name) if settings.trace else None,
        conversation_cache=conversation_cache_spec(settings),
        snapshots=snapshot_spec(settings, budget),
        # one process's own prompts come one at a time; `llm mlxs serve` batches (server/service.py)
        max_batch=options.max_batch or 1,
        plan_figures={"slots_from": source, **({"memory_budget_bytes": budget} if budget is not None else {})},
    )


def planned_context(name: str, path, options, settings: Settings, kv, planned: bool = True) -> int:
    """The context the KV cache and the memory plan are made for: the max_context
    setting, or for auto the model's own, within the memory budget when the pools are
    planned from it (planner.auto_context); with a slot count, config.json's alone (a
    checkpoint that cannot be read is the loader's to report)."""
    if settings.max_context != "auto":
        return settings.max_context
    if not planned:
        try:
            return model_context(json.loads((Path(path) / "config.json").read_text()))
        except (OSError, ValueError, AttributeError):
            return DEFAULT_MAX_CONTEXT
    try:
        return auto_context(checkpoint_layout(path), budget_bytes(budget_value(options, settings)), kv)
    except (CheckpointError, ValueError, OSError) as exc:
        raise MlxStreamError(f"Could not plan '{name}' ({path}): {one_line(exc)}") from None


def context_limit(options, context: int) -> int:
    """The prompt's context: the planned one, or an option below it (the KV cache and the
    memory plan are made for the planned one, so an option above it is refused)."""
    if options.max_context in (None, "auto"):
        return context
    if options.max_context > context:
        raise MlxStreamError(f"max_context {options.max_context} is above the {context} tokens the KV cache is "
                             "planned for (the max_context setting); raise that with `llm mlxs config max_context N`")
    return options.max_context


def checked_name(name: Optional[str], settings: Settings) -> str:
    """`name` (None: the default model), refused in one line unless it is registered."""
    resolved = registry.default_name(settings) if name is None else name
    if resolved != BUNDLED_NAME and resolved not in settings.models:
        if name is None:
            raise MlxStreamError(
                f"Default model '{resolved}' is not registered; "
                "run `llm mlxs default NAME` or `llm mlxs config --unset default_model`"
            )
        raise MlxStreamError(f"Unknown model '{resolved}'; see `llm mlxs models`")
    return resolved


def repetition_penalty(options, name: str) -> float:
    """The bundled demo gets a penalty by default: so small a model's greedy text soon loops."""
    if options.repetition_penalty is not None:
        return options.repetition_penalty
    return BUNDLED_REPETITION_PENALTY if name == BUNDLED_NAME else 1.0


def budget_value(options, settings: Settings) -> str:
    return options.memory_budget or settings.memory_budget


def kv_spec(options, settings: Settings) -> KVSpec:
    """The KV layout of one prompt."""
    bits = options.kv_bits if options.kv_bits is not None else settings.kv_bits
    return KVSpec(
        bits=None if bits == "off" else int(bits),
        group_size=options.kv_group_size or settings.kv_group_size,
        start=settings.kv_start if options.kv_start is None else options.kv_start,
    )


def drafter(options, settings: Settings) -> tuple[str, Optional[Path]]:
    """(the drafter, the checkpoint of an added model that drafts). An unknown drafter is
    refused before anything runs, is sent to a server or is logged: the one given with
    -o draft whatever k is, the setting's only when it is used."""
    from ..speculation.kinds import builtin_kinds

    k = settings.k if options.k is None else options.k
    draft = settings.draft if options.draft is None else options.draft
    if (k == 0 and options.draft is None) or draft in builtin_kinds():
        return draft, None
    try:
        path, _ = registry.checkpoint_for(registry.canonical_name(draft, settings), settings)
    except MlxStreamError:
        kinds = ", ".join(sorted(builtin_kinds()))
        raise MlxStreamError(
            f"Unknown draft '{draft}': use {kinds}, or the name of a model added with `llm mlxs add`"
        ) from None
    return draft, path


def plan_slots(name: str, path, value: str, budget: int, max_context: int, kv=None, snapshot_bytes: int = 0):
    """(Slots per MoE layer that fit `budget` bytes, None for a model without MoE layers;
    the checkpoint layout the plan read, for the prefill step), with the KV cache sized
    for layout `kv`. A budget too small for the model is the planner's one-line error."""
    try:
        layout = checkpoint_layout(path)
        plan = plan_memory(path, budget, max_context=max_context, kv=kv, layout=layout, snapshot_bytes=snapshot_bytes)
    except PlanError as exc:
        if value == "auto":
            raise MlxStreamError(
                f"memory_budget auto ({AUTO_BUDGET_SHARE:.0%} of this machine's memory): {exc}"
            ) from None
        raise MlxStreamError(str(exc)) from None
    except (CheckpointError, ValueError, OSError) as exc:
        raise MlxStreamError(f"Could not plan '{name}' ({path}): {one_line(exc)}") from None
    return list(plan.slots_per_layer) or None, layout


def prefill_step(options, settings: Settings, path, budget: Optional[int], kv, layout=None,
                 context: Optional[int] = None):
    """Prompt tokens per model call of a prefill: a number given, or for auto the
    planner's ExpertChunk for the memory budget, which sizes the call by the prompt
    (None, i.e. mlx-lm's 2048, when it cannot tell)."""
    step = options.prefill_step or settings.prefill_step
    if step != "auto":
        return int(step)
    try:
        if budget is None:
            budget = budget_bytes(budget_value(options, settings))
        return prefill_step_for(path, budget, max_context=context, kv=kv, layout=layout,
                                snapshot_bytes=snapshot_budget(settings, budget))
    except (MlxStreamError, CheckpointError, ValueError, OSError):  # PlanError among them
        return None


def shared_budget(options, settings: Settings, path, budget: Optional[int], context: int, kv, layout=None):
    """(The memory budget every loaded model shares, the model's footprint in it), or
    (None, None) when either cannot be told: the model is then loaded unbudgeted."""
    try:
        budget = budget_bytes(budget_value(options, settings)) if budget is None else budget
        layout = layout or checkpoint_layout(path)
    except (MlxStreamError, CheckpointError, ValueError, OSError):
        return None, None
    return budget, model_footprint(layout, context, kv, default_reserve(budget), snapshot_budget(settings, budget))


def buffer_cache(options, settings: Settings, budget: Optional[int]) -> int:
    """Bytes of freed buffers MLX may keep: the setting, or auto: the memory plan's
    working reserve, where activations and temporary buffers are budgeted (its floor
    when the machine's memory cannot be told)."""
    if settings.buffer_cache != "auto":
        return parse_size(settings.buffer_cache)
    try:
        if budget is None:
            budget = budget_bytes(budget_value(options, settings))
    except (MlxStreamError, ValueError):
        budget = 0
    return default_reserve(budget)


def snapshot_spec(settings: Settings, budget: Optional[int]):
    """How prompt snapshots are taken and kept (None: they are off)."""
    most = snapshot_budget(settings, budget)
    return SnapshotSpec(settings.snapshot_every, settings.snapshots, most) if most else None


def snapshot_budget(settings: Settings, budget: Optional[int]) -> int:
    """The bytes prompt snapshots may take (0: they are off); auto: a share of the memory
    budget (of the auto budget when the pools are not planned)."""
    if not settings.snapshots:
        return 0
    if settings.snapshot_memory != "auto":
        return parse_size(settings.snapshot_memory)
    if budget is None:
        budget = budget_bytes("auto")
    return min(SNAPSHOT_MOST, int(SNAPSHOT_SHARE * budget))


def conversation_cache_spec(settings: Settings):
    """Where and how large the conversation cache on disk is (None: it is off)."""
    if not settings.conversation_cache:
        return None
    return DiskCacheSpec(llm.user_dir() / "mlx-streaming" / "kv-cache", parse_size(settings.conversation_cache_size),
                         settings.conversation_cache_entries)
