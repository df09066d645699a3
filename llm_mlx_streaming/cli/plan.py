"""`llm mlxs plan`: how a memory budget is spent, from the checkpoint headers alone."""

from __future__ import annotations

import json

import click

from .. import registry
from ..errors import MlxStreamError, SettingsError, one_line
from .. import values
from ..settings import AUTO_BUDGET_SHARE, BUNDLED_NAME, budget_bytes, load_settings

from .group import mlxs
from .resolve import resolve_checkpoint


@mlxs.command(short_help="How a memory budget is spent; slots per layer (loads nothing).")
@click.argument("name", required=False)
@click.option("--budget", metavar="SIZE", help="Memory budget, e.g. 12GB or auto (default: the memory_budget setting)")
@click.option("--max-context", type=click.IntRange(1), help="Tokens of KV cache to plan for (default: the max_context setting)")
@click.option("--kv-bits", metavar="BITS", help="KV cache quantization to plan for: off, 4 or 8 (default: the kv_bits setting)")
@click.option("--hit-rate", type=click.FloatRange(0, 1), help="Forecast disk reads per token at this hit rate (default: 0.5, 0.8 and 0.9)")
@click.option("json_", "--json", is_flag=True, help="Output as JSON")
def plan(name, budget, max_context, kv_bits, hit_rate, json_):
    """How a memory budget is spent: dense weights, KV cache, reserve, expert slots.

    Reads only config.json and the safetensors headers; loads nothing. NAME is a
    model name or alias, mlx-stream (the default model, also when omitted) or a
    checkpoint directory.

    \b
    llm mlxs plan q30 --budget 12GB
    llm mlxs plan ~/models/Qwen3-30B-A3B-4bit --budget 16GB --max-context 8192 --json
    llm mlxs plan q30 --budget 12GB --max-context 65536 --kv-bits 4
    """
    from ..engine.planner import PlanError, plan_memory
    from ..errors import CheckpointError

    settings = load_settings()
    label, path, entry = resolve_checkpoint(name, settings)
    value = settings.memory_budget if budget is None else budget
    try:
        value = values.budget(value)
    except ValueError as exc:
        raise SettingsError(f"Invalid --budget {budget!r}: {exc}") from None
    nbytes = budget_bytes(value)
    context = max_context or settings.max_context
    kv = _kv_layout(settings, kv_bits)
    try:
        result = plan_memory(path, nbytes, max_context=context, kv=kv)
    except PlanError as exc:
        prefix = f"memory_budget auto ({AUTO_BUDGET_SHARE:.0%} of this machine's memory): " if value == "auto" else ""
        raise MlxStreamError(prefix + str(exc)) from None
    except (CheckpointError, ValueError, OSError) as exc:
        raise MlxStreamError(f"Cannot plan {label}: {one_line(exc)}") from None
    fixed = None
    if entry is not None or label == f"{registry.MODEL_PREFIX}/{BUNDLED_NAME}":
        canonical = label.split("/", 1)[1]
        fixed = registry.effective_slots(canonical, entry, settings)
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
        click.echo(
            f"Note: {label} runs with {fixed} expert slots per layer ({why}), not this plan; "
            f"-o memory_budget {value} uses the plan.",
            err=True,
        )


def _kv_layout(settings, kv_bits):
    """The KV layout to plan for: --kv-bits over the settings (group size and start
    from the settings)."""
    from ..engine.kv import KVError, KVSpec, parse_bits

    bits = settings.kv_bits if kv_bits is None else kv_bits
    try:
        bits = parse_bits(bits)
    except KVError as exc:
        raise SettingsError(f"Invalid --kv-bits {kv_bits!r}: {str(exc).removeprefix('kv_bits ')}") from None
    return KVSpec(bits=bits, group_size=settings.kv_group_size, start=settings.kv_start)


def format_plan_text(result, hit_rate, value) -> str:
    from ..engine.planner import format_plan

    text = format_plan(result, hit_rate=hit_rate)
    if value == "auto":
        text += f"\n  (budget: memory_budget auto = {AUTO_BUDGET_SHARE:.0%} of this machine's memory)"
    return text
