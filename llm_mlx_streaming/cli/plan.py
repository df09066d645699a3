"""`llm mlxs plan`: how a memory budget is spent, from the checkpoint headers alone."""

from __future__ import annotations

import json

import click

from pydantic import ValidationError

from ..options import registry
from ..engine.planner import DEFAULT_HIT_RATES, default_reserve
from ..errors import MlxStreamError, SettingsError, one_line
from ..options.run_config import budget_value, kv_spec, planned_context, snapshot_budget
from ..options.knobs import AUTO_BUDGET_SHARE, BUNDLED_NAME
from ..options.settings import budget_bytes, load_settings
from ..sizes import format_size

from .common import slots_text, table
from .group import mlxs
from .lookup import find_checkpoint
from ..engine.planner import PlanError, plan_memory, with_slots
from ..errors import CheckpointError


@mlxs.command(short_help="How a memory budget is spent (loads nothing).")
@click.argument("names", nargs=-1)
@click.option("--budget", metavar="SIZE", help="Memory budget, e.g. 12GB or auto (default: the memory_budget setting)")
@click.option("--max-context", type=click.IntRange(1), help="Tokens of KV cache to plan for (default: the max_context setting)")
@click.option("--kv-bits", metavar="BITS", help="KV cache quantization to plan for: off, 4 or 8 (default: the kv_bits setting)")
@click.option("--hit-rate", type=click.FloatRange(0, 1), help="Forecast disk reads per token at this hit rate (default: 0.5, 0.8 and 0.9)")
@click.option("--budgets", metavar="SIZE,SIZE,...",
              help="A pipeline of hosts (llm mlxs serve --hosts): each host's budget, rank 0's first")
@click.option("json_", "--json", is_flag=True, help="Output as JSON")
def plan(names, budget, max_context, kv_bits, hit_rate, budgets, json_):
    """How a memory budget is spent: dense weights, KV cache, reserve, expert slots.

    Reads only config.json and the safetensors headers; loads nothing. NAME is a
    model name or alias, mlx-stream (the default model, also when omitted) or a
    checkpoint directory. Several NAMEs: how `llm mlxs serve` splits the budget among
    them loaded at once (each one's slots per layer).

    \b
    llm mlxs plan q30 --budget 12GB
    llm mlxs plan ~/models/Qwen3-30B-A3B-4bit --budget 16GB --max-context 8192 --json
    llm mlxs plan q30 --budget 12GB --max-context 65536 --kv-bits 4
    llm mlxs plan q30 --budgets 24GB,24GB
    llm mlxs plan q30 coder --budget 24GB
    """
    settings = load_settings()
    if len(names) > 1:
        if budgets:
            raise MlxStreamError("--budgets plans one model over a pipeline; give one NAME")
        return _plan_shared(names, _options(memory_budget=budget, kv_bits=kv_bits, max_context=max_context),
                            settings, json_)
    name = names[0] if names else None
    label, path, entry = find_checkpoint(name, settings)
    options = _options(memory_budget=budget, kv_bits=kv_bits)
    kv = kv_spec(options, settings)
    context = max_context or planned_context(label, path, options, settings, kv)
    if budgets:
        _plan_ranks(label, path, budgets, context, kv, hit_rate, json_)
        return
    value = budget_value(options, settings)
    nbytes = budget_bytes(value)
    try:
        result = plan_memory(path, nbytes, max_context=context, kv=kv, snapshot_bytes=snapshot_budget(settings, nbytes))
    except PlanError as exc:
        prefix = f"memory_budget auto ({AUTO_BUDGET_SHARE:.0%} of this machine's memory): " if value == "auto" else ""
        raise MlxStreamError(prefix + str(exc)) from None
    except (CheckpointError, ValueError, OSError) as exc:
        raise MlxStreamError(f"Cannot plan {label}: {one_line(exc)}") from None
    fixed = None
    if entry is not None or label == f"{registry.MODEL_PREFIX}/{BUNDLED_NAME}":
        canonical = label.split("/", 1)[1]
        fixed = registry.effective_slots(canonical, entry, settings)
    if fixed and budget is None:  # no budget asked about: the plan the model runs with
        result = with_slots(result, fixed)
    if json_:
        data = result.as_dict()
        data["budget_setting"] = value
        data["model"] = label
        data["expert_slots_in_use"] = fixed
        click.echo(json.dumps(data, indent=2))
        return
    click.echo(format_plan_text(result, hit_rate, value))
    if fixed:
        source = registry.slots_source(canonical, entry, settings)
        why = {"model": "its --expert-slots", "setting": "the expert_slots setting",
               "bundled": "the bundled demo's default"}.get(source, "a setting")
        if budget is None:
            note = (f"{label} runs with {fixed} expert slots per layer ({why}), as planned above; --budget SIZE "
                    "shows the plan a memory budget makes (-o memory_budget SIZE runs with it)")
        else:
            note = (f"{label} runs with {fixed} expert slots per layer ({why}), not this plan; "
                    f"-o memory_budget {value} uses the plan")
        click.echo(f"Note: {note}.", err=True)


def _plan_shared(names, options, settings, json_) -> None:
    """The split `llm mlxs serve` makes of one budget among `names` loaded at once
    (engine/sharing.py), each model configured as the server configures it."""
    from ..engine.sharing import claim_of, least_bytes, pool_bytes, split
    from ..options.run_config import configure

    runs = [configure(name, options, settings) for name in names]
    unbudgeted = [n for n, r in zip(names, runs) if r.load.footprint is None]
    if unbudgeted:
        raise MlxStreamError(f"Cannot plan {', '.join(unbudgeted)} within a shared budget (no memory plan)")
    claims = [claim_of(r.load) for r in runs]
    budget = runs[0].shared_budget
    shares = split(budget, claims)
    if shares is None:
        raise MlxStreamError(f"{', '.join(names)} do not fit in {format_size(budget)} at once: at top_k slots "
                             f"per layer they need {format_size(least_bytes(claims))}")
    rows = [{"model": name, "fixed_bytes": c.footprint.fixed_bytes, "slots_per_layer": list(slots),
             "wanted_per_layer": list(c.wanted), "pool_bytes": pool_bytes(c.footprint, slots),
             "memory_bytes": c.footprint.fixed_bytes + pool_bytes(c.footprint, slots)}
            for name, c, slots in zip(names, claims, shares)]
    reserve = max(c.footprint.reserve_bytes for c in claims)
    if json_:
        click.echo(json.dumps({"budget": budget, "reserve_bytes": reserve, "models": rows}, indent=2))
        return
    click.echo(f"Memory budget {format_size(budget)} shared by {len(names)} models loaded at once "
               f"(llm mlxs serve; reserve {format_size(reserve)}, counted once):")
    table(["model", "dense + KV", "slots per layer", "of wanted", "expert pool", "holds"],
          [[r["model"], format_size(r["fixed_bytes"]), slots_text(r["slots_per_layer"]), slots_text(r["wanted_per_layer"]),
            format_size(r["pool_bytes"]), format_size(r["memory_bytes"])] for r in rows], indent="  ")


def _plan_ranks(label, path, budgets: str, context: int, kv, hit_rate, json_) -> None:
    """One plan per rank of a pipeline: its layers, slots and the hit rate to expect."""
    from ..distributed.plan import plan_ranks
    from ..sizes import given_size

    try:
        sizes = [given_size(b.strip()) for b in budgets.split(",")]
        ranks = plan_ranks(path, sizes, max_context=context, kv=kv)
    except (PlanError, CheckpointError, ValueError, OSError) as exc:
        raise MlxStreamError(f"Cannot plan {label} over {budgets}: {one_line(exc)}") from None
    if json_:
        click.echo(json.dumps([{"rank": r.rank, "layers": list(r.layers), "expected_hit_rate": r.expected_hit_rate,
                                **r.plan.as_dict()} for r in ranks], indent=2))
        return
    for r in ranks:
        rate = f", expected hit rate {r.expected_hit_rate:.0%} (uniform routing)" if r.expected_hit_rate else ""
        first, last = r.layers[0], r.layers[1] - 1
        layers = f"decoder layer {first}" if first == last else f"decoder layers {first}-{last}"
        click.echo(f"Rank {r.rank}: {layers}{rate}")
        click.echo(format_plan(r.plan, hit_rate=hit_rate))


def _options(**flags):
    """The flags as the prompt options of the same names, checked as those are."""
    from ..options.settings import Options

    try:
        return Options(**{k: v for k, v in flags.items() if v is not None})
    except ValidationError as exc:
        err = exc.errors()[0]
        flag = "--" + str(err["loc"][0]).replace("_", "-").replace("memory-budget", "budget")
        raise SettingsError(f"Invalid {flag} {flags[err['loc'][0]]!r}: "
                            f"{err['msg'].removeprefix('Value error, ').removeprefix('kv_bits ')}") from None


def format_plan_text(result, hit_rate, value) -> str:
    text = format_plan(result, hit_rate=hit_rate)
    if value == "auto":
        text += f"\n  (budget: memory_budget auto = {AUTO_BUDGET_SHARE:.0%} of this machine's memory)"
    return text


def _ranges(items: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2, 5, 7-8"."""
    out, start = [], None
    for i, x in enumerate(items):
        if start is None:
            start = x
        if i + 1 == len(items) or items[i + 1] != x + 1:
            out.append(f"{start}" if start == x else f"{start}-{x}")
            start = None
    return ", ".join(out)


def _slot_runs(slots: list[int], E: int) -> str:
    """Runs of equal counts: "layers 0-11: 512 (whole); layer 12: 300; layers 13-47: 256"."""
    runs, start = [], 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[start]:
            where = f"layer {start}" if i - 1 == start else f"layers {start}-{i - 1}"
            n = slots[start]
            runs.append(f"{where}: {n}" + (" (whole)" if n == E else ""))
            start = i
    return "; ".join(runs)


def _prefill_text(c: dict) -> str:
    """"a 20,000-token prompt in 1 call of up to 40,960 tokens (one pass over the experts)"."""
    passes = "one pass" if c["passes"] == 1 else f"{c['passes']} passes"
    calls = "1 call" if c["passes"] == 1 else f"{c['passes']} calls"
    return (f"a {c['prompt_tokens']:,}-token prompt in {calls} of up to {c['chunk_tokens']:,} tokens "
            f"({passes} over the experts)")


def format_plan(plan, hit_rate: float | None = None) -> str:
    """The plan as terminal text: the budget split, slots per layer, whole layers,
    expected peak, and MB read per token at `hit_rate` (or at 0.5, 0.8 and 0.9)."""
    width = 17
    reserve_note = (
        "max(256 MiB, 5% of budget)"
        if plan.reserve_bytes == default_reserve(plan.budget)
        else "as given"
    )
    lines = [f"Memory plan for {plan.path} ({plan.model_type})"]
    if plan.num_moe_layers:
        b = plan.expert_bytes_per_layer
        per_expert = format_size(b[0]) if len(set(b)) == 1 else f"{format_size(min(b))}-{format_size(max(b))}"
        lines.append(
            f"  {plan.num_moe_layers} MoE layers x {plan.num_experts} experts, top-{plan.top_k}, "
            f"{per_expert} per expert; checkpoint {format_size(plan.checkpoint_bytes)}"
        )
    else:
        lines.append("  no MoE layers: the model runs fully resident")

    def row(label, n, note=""):
        lines.append(f"  {label:<{width}}{format_size(n):>10}" + (f"  {note}" if note else ""))

    row("budget", plan.budget)
    row("dense weights", plan.dense_bytes)
    if plan.vision_bytes:
        row("  vision tower", plan.vision_bytes, "vision tower and projector, resident, within the dense weights")
    row("KV cache", plan.kv_bytes, plan.kv_description)
    if plan.image_tokens:
        lines.append(f"  {'  image tokens':<{width}}{plan.image_tokens:>10}  in the KV cache beyond max_context: "
                     f"{plan.image_note}")
    if plan.snapshot_bytes:
        row("prompt snapshots", plan.snapshot_bytes, "at most (snapshot_memory): this cache cannot be rewound")
    row("reserve", plan.reserve_bytes, reserve_note)
    if plan.num_moe_layers:
        total_slots = sum(plan.slots_per_layer)
        share = total_slots / (plan.num_experts * plan.num_moe_layers)
        row("expert pool", plan.pool_bytes, f"{total_slots} slots, {share:.0%} of all experts")
    row("expected peak", plan.expected_peak_bytes,
        f"unused {format_size(plan.unused_bytes)}" if plan.unused_bytes >= 1000 else "")
    if not plan.num_moe_layers:
        return "\n".join(lines)
    lines.append(f"  {'slots per layer':<{width}}{_slot_runs(plan.slots_per_layer, plan.num_experts)}")
    whole = plan.whole_layers
    if whole:
        lines.append(
            f"  {'whole layers':<{width}}{len(whole)} of {plan.num_moe_layers} "
            f"({_ranges(whole)}): every expert resident, no host read of the router choice"
        )
    else:
        lines.append(f"  {'whole layers':<{width}}none")
    if len(whole) == plan.num_moe_layers:
        lines.append(f"  {'disk reads':<{width}}none: every expert is resident")
    else:
        rates = DEFAULT_HIT_RATES if hit_rate is None else (hit_rate,)
        forecast = ", ".join(
            f"{format_size(plan.forecast_mb_per_token(h) * 1e6)} at hit rate {h:g}" for h in rates
        )
        lines.append(f"  {'read per token':<{width}}{forecast}")
    chunks = plan.chunk_figures()
    if chunks:
        lines.append(f"  {'prefill':<{width}}" + "; ".join(_prefill_text(c) for c in chunks["prompts"]))
    if plan.skipped_bytes:
        lines.append(f"  (not counted: {format_size(plan.skipped_bytes)} of tensors mlx-lm drops on load, e.g. MTP heads)")
    return "\n".join(lines)
