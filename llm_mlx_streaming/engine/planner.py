"""The memory-budget planner: how many expert slots each MoE layer can afford.

Given a checkpoint and a memory budget, the planner splits the budget, in this order:

1. the dense weights (everything that is not a stacked expert tensor: embeddings,
   attention, routers, norms, shared experts, a vision-language model's vision tower
   and projector), which stay resident;
2. the KV cache for `max_context` tokens, and a vision-language model's one typical
   image beyond them;
3. a working reserve for activations, temporary buffers and the allocator;
4. expert slots: every MoE layer first gets `min_slots` (default top_k) slots, then
   all layers grow evenly up to `whole_from` x num_experts slots, then whole layers
   (every expert resident) are made one at a time, the first MoE layers first.

It reads only config.json and the safetensors headers (no model load, no mlx), so a
plan of a 40 GB checkpoint is instant. See docs/planner.md ("Memory budget") for the
reasons behind the defaults.
"""

from __future__ import annotations

import math
import os
import platform
import sys
from dataclasses import asdict, dataclass, field, replace
from typing import Sequence

from ..sizes import format_size, parse_size
from ..values import DEFAULT_MAX_CONTEXT, KV_SHARE
from ..checkpoints.config import decoder_shape
from .footprint import (ATTENTION_TILE, KV_STEP, PREFILL_STEP, Layout, checkpoint_layout, kv_cache_bytes,
                        prefill_bytes_per_token, prefill_tile_bytes)
from .kv import FULL_PRECISION, KVSpec, check_model

__all__ = [
    "ATTENTION_TILE",
    "DEFAULT_HIT_RATES",
    "DEFAULT_MAX_CONTEXT",
    "ExpertChunk",
    "KV_STEP",
    "PREFILL_STEP",
    "Plan",
    "PlanError",
    "checkpoint_layout",
    "default_reserve",
    "expert_chunk",
    "kv_cache_bytes",
    "plan_memory",
    "prefill_step_for",
]

MiB = 1024**2
RESERVE_FLOOR = 256 * MiB  # fixed runtime overhead: MLX/Metal, tokenizer, Python
RESERVE_FRACTION = 0.05  # scales with the working set (activations, allocator slack)
WHOLE_FROM = 0.5  # every layer holds this share of its experts before any layer is whole
AGENT_PROMPT = 20000  # an agent's first turn: system prompt and tools (`llm mlxs plan` shows its prefill)
DEFAULT_HIT_RATES = (0.5, 0.8, 0.9)


class PlanError(ValueError):
    """A budget that cannot run the checkpoint; the message is one line."""


def default_reserve(budget: int) -> int:
    """max(256 MiB, 5% of the budget): see docs/planner.md."""
    return max(RESERVE_FLOOR, int(RESERVE_FRACTION * budget))


# -- the prefill's expert chunk ----------------------------------------------------------


def fused_attention(kv: KVSpec | None) -> bool:
    """Whether attention keeps no scores (Metal's fused kernel over a full-precision
    cache, on an Apple silicon Mac); the CPU backend and a quantized cache keep them."""
    return sys.platform == "darwin" and platform.machine() == "arm64" and not (kv and kv.quantized)


@dataclass(frozen=True)
class ExpertChunk:
    """How many prompt tokens one model call of a prefill may hold (engine/prefill.py):
    each MoE layer reads every expert a call routes to once, so a prompt that fits one
    call is read in one pass over the experts.

    The room is what the plan leaves a prefill (its working reserve and what the budget
    holds beyond the plan) plus the part of the KV cache planned for `context` tokens that
    the prompt leaves unused; each token of the call takes `per_token`, the call's tile and
    route group `fixed`, and a tile's attention scores `scores_per_key` per key it attends to."""

    room: int
    layout: Layout = field(repr=False, compare=False)
    kv: KVSpec
    context: int
    per_token: int
    fixed: int
    scores_per_key: int

    def kv_bytes(self, tokens: int) -> int:
        return kv_cache_bytes(self.layout.config, tokens, None, self.kv, self.layout.kv_blocker,
                              self.layout.image_tokens)[0]

    def tokens(self, prompt: int, held: int = 0) -> int:
        """The chunk a prompt of `prompt` tokens is fed in, with `held` bytes of other
        sequences' caches in the room: a multiple of the tile, at least one tile."""
        prompt = min(max(prompt, 1), self.context)
        room = self.room + self.kv_bytes(self.context) - self.kv_bytes(prompt) - held
        room -= self.fixed + self.scores_per_key * prompt
        fits = max(0, room) // self.per_token // ATTENTION_TILE * ATTENTION_TILE
        ceiling = -(-self.context // ATTENTION_TILE) * ATTENTION_TILE
        return int(max(ATTENTION_TILE, min(fits, ceiling)))

    def passes(self, prompt: int) -> int:
        """Model calls, so passes over the experts, a cold prompt of `prompt` tokens takes."""
        return -(-max(prompt - 1, 1) // self.tokens(prompt))


def expert_chunk(layout: Layout, room: int, *, max_context: int | None = DEFAULT_MAX_CONTEXT,
                 kv: KVSpec | None = None, fused: bool | None = None) -> ExpertChunk:
    """The ExpertChunk of `layout` with `room` bytes beside the plan's KV cache (the
    plan's reserve and what its budget leaves unused)."""
    kv = kv or FULL_PRECISION
    fused = fused_attention(kv) if fused is None else fused
    top_k = max(1, layout.top_k)
    return ExpertChunk(
        room=room, layout=layout, kv=kv, context=max_context or DEFAULT_MAX_CONTEXT,
        per_token=prefill_bytes_per_token(layout.config, top_k, max(1, layout.num_experts)),
        fixed=prefill_tile_bytes(layout.config, top_k, 0, fused),
        scores_per_key=0 if fused else ATTENTION_TILE * decoder_shape(layout.config)[2] * 4,
    )


def prefill_step_for(
    path: str | os.PathLike,
    budget_bytes: int | str,
    *,
    max_context: int | None = DEFAULT_MAX_CONTEXT,
    kv: KVSpec | None = None,
    layout: Layout | None = None,
    snapshot_bytes: int = 0,
) -> ExpertChunk:
    """The expert chunk of the checkpoint at `path` under its memory plan for a budget
    ("auto" prefill_step): `.tokens(prompt)` is the chunk a prompt of that length is fed
    in. `layout`: the checkpoint's, when the caller has read it already. PlanError when
    the budget cannot run the checkpoint."""
    return plan_memory(path, budget_bytes, max_context=max_context, kv=kv, layout=layout,
                       snapshot_bytes=snapshot_bytes).expert_chunk


# -- the plan ------------------------------------------------------------------------


@dataclass
class Plan:
    """How a budget is spent. Byte counts are exact for the weights and the pool (the
    pool arrays the engine allocates for `slots_per_layer` hold exactly `pool_bytes`),
    estimates for the KV cache, and an allowance for the reserve."""

    path: str
    model_type: str
    budget: int
    dense_bytes: int
    kv_bytes: int
    reserve_bytes: int
    expert_bytes_per_layer: list[int]  # bytes of ONE expert, per MoE layer
    slots_per_layer: list[int]
    whole_layers: list[int]  # MoE layer ordinals (0-based) holding every expert
    pool_bytes: int
    expected_peak_bytes: int  # dense + KV at max_context + reserve + pool
    num_experts: int
    top_k: int
    num_moe_layers: int
    max_context: int
    kv_description: str = ""
    kv_bits: int | None = None  # None: a full-precision KV cache
    min_slots: int = 0
    whole_from: float = WHOLE_FROM
    checkpoint_bytes: int = 0
    skipped_bytes: int = 0
    layer_keys: list[str] = field(default_factory=list)
    vision_bytes: int = 0  # a vision-language model's vision tower and projector, within dense_bytes
    image_tokens: int = 0  # tokens of one typical image, planned into the KV cache beyond max_context
    image_note: str = ""
    snapshot_bytes: int = 0  # prompt snapshots of a cache that cannot be rewound (engine/snapshots.py)
    expert_chunk: ExpertChunk | None = field(default=None, repr=False)  # a prefill's model call, by prompt

    @property
    def unused_bytes(self) -> int:
        """What the budget leaves over (less than a slot's worth, or everything is whole)."""
        return self.budget - self.expected_peak_bytes

    @property
    def streamed_layers(self) -> list[int]:
        whole = set(self.whole_layers)
        return [i for i in range(self.num_moe_layers) if i not in whole]

    def forecast_mb_per_token(self, hit_rate: float) -> float:
        """MB read from disk per decoded token at `hit_rate`: every layer that is not
        whole reads top_k x (1 - hit_rate) experts."""
        if not 0.0 <= hit_rate <= 1.0:
            raise ValueError(f"hit_rate must be in [0, 1], got {hit_rate}")
        per_layer = sum(self.expert_bytes_per_layer[i] for i in self.streamed_layers)
        return self.top_k * (1.0 - hit_rate) * per_layer / 1e6

    def as_dict(self) -> dict:
        """JSON-ready form (for `llm mlxs plan --json`)."""
        d = asdict(self)
        d["unused_bytes"] = self.unused_bytes
        d["expert_chunk"] = self.chunk_figures()
        return d

    def chunk_figures(self) -> dict | None:
        """The expert chunk (engine/prefill.py) for an agent's first prompt and for one as
        long as the context: tokens per model call, and the passes over the experts."""
        chunk = self.expert_chunk
        if chunk is None:
            return None
        prompts = sorted({min(AGENT_PROMPT, self.max_context), self.max_context})
        return {"bytes_per_token": chunk.per_token, "fixed_bytes": chunk.fixed,
                "prompts": [{"prompt_tokens": n, "chunk_tokens": chunk.tokens(n), "passes": chunk.passes(n)}
                            for n in prompts]}


def with_slots(plan: Plan, slots: int | Sequence[int]) -> Plan:
    """`plan` for `slots` per MoE layer (a model's own slot count, at most its experts)
    in place of those its budget allows: the same dense weights, KV cache and reserve,
    the pool and the peak those slots make."""
    counts = list(slots) if isinstance(slots, (list, tuple)) else [slots] * plan.num_moe_layers
    counts = [min(int(n), plan.num_experts) for n in counts]
    pool = sum(n * b for n, b in zip(counts, plan.expert_bytes_per_layer))
    return replace(plan, slots_per_layer=counts, whole_layers=[i for i, n in enumerate(counts) if n == plan.num_experts],
                   pool_bytes=pool, expected_peak_bytes=plan.expected_peak_bytes - plan.pool_bytes + pool)


def model_context(config: dict) -> int:
    """The context a model's config declares (DEFAULT_MAX_CONTEXT where it names none)."""
    own = config.get("max_position_embeddings") or (config.get("text_config") or {}).get("max_position_embeddings")
    return int(own or DEFAULT_MAX_CONTEXT)


def auto_context(layout: Layout, budget: int, kv: KVSpec | None = None) -> int:
    """max_context auto: the model's own context (DEFAULT_MAX_CONTEXT where its config
    names none), shortened until its KV cache takes at most KV_SHARE of `budget`; never
    below DEFAULT_MAX_CONTEXT (a budget too small for that is the plan's to refuse)."""
    config = layout.config
    longest = model_context(config)
    floor = min(DEFAULT_MAX_CONTEXT, longest)

    def fits(context: int) -> bool:
        kv_bytes, _ = kv_cache_bytes(config, context, None, kv or FULL_PRECISION, layout.kv_blocker,
                                     layout.image_tokens)
        return kv_bytes <= KV_SHARE * budget

    if fits(longest):
        return longest
    low, high = floor, longest  # fits(low) is taken as given, fits(high) is not
    while high - low > 256:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return max(floor, low // 256 * 256)


def plan_memory(
    path: str | os.PathLike,
    budget_bytes: int | str,
    *,
    max_context: int | None = DEFAULT_MAX_CONTEXT,
    reserve_bytes: int | str | None = None,
    kv_bytes_per_element: int | None = None,
    min_slots: int | None = None,
    whole_from: float = WHOLE_FROM,
    whole_order: Sequence[int] | None = None,
    kv: KVSpec | None = None,
    layout: Layout | None = None,
    snapshot_bytes: int = 0,
) -> Plan:
    """The slot count of every MoE layer that fits `budget_bytes` (an int or "12GB").

    `reserve_bytes` defaults to max(256 MiB, 5% of the budget). `min_slots` is the
    fewest slots any layer may have (default top_k; speculative decoding of k draft
    tokens wants (k + 1) x top_k). `whole_from`: every layer grows evenly up to this
    share of its experts before any layer is made whole (1.0: never trade slots for a
    whole layer; 0.0: make as many layers whole as the minimum of the others allows).
    `whole_order`: the MoE layer ordinals in the order they are made whole (default
    0, 1, 2, ...); e.g. layers sorted by a measured hit rate, worst first. `kv`: the KV
    cache layout (quantized caches take less of the budget; default full precision).
    `layout`: the checkpoint's (checkpoint_layout), when the caller has read it already.
    `snapshot_bytes`: the most the prompt snapshots may take, planned only for a model
    whose cache cannot be rewound (engine/kv.rewinds).

    Raises PlanError (one line, naming the shortfall and the budget that would do)
    when the budget cannot give every MoE layer `min_slots` slots, KVError for a KV
    layout the engine would refuse, and CheckpointError for a checkpoint that cannot
    be read.
    """
    budget = parse_size(budget_bytes)
    if max_context is None:
        max_context = DEFAULT_MAX_CONTEXT
    if not 0.0 <= whole_from <= 1.0:
        raise ValueError(f"whole_from must be in [0, 1], got {whole_from}")
    layout = layout or checkpoint_layout(path)
    E, L = layout.num_experts, len(layout.layer_keys)
    b = layout.expert_bytes
    kv_layout = kv or FULL_PRECISION
    if not layout.kv_blocker:
        check_model(kv_layout, layout.config)  # the engine refuses the same layouts
    kv, kv_text = kv_cache_bytes(layout.config, max_context, kv_bytes_per_element, kv_layout, layout.kv_blocker,
                                 layout.image_tokens)
    reserve = default_reserve(budget) if reserve_bytes is None else parse_size(reserve_bytes)
    m = min(E, max(1, min_slots if min_slots is not None else layout.top_k)) if L else 0
    snapshots = 0 if layout.rewinds else snapshot_bytes
    fixed = layout.dense_bytes + kv + snapshots
    floor_pool = m * sum(b)
    available = budget - fixed - reserve
    if available < floor_pool:
        raise PlanError(_shortfall(budget, layout, kv, reserve, reserve_bytes, m, floor_pool))

    order = list(range(L)) if whole_order is None else [int(i) for i in whole_order]
    if sorted(order) != list(range(L)):
        raise ValueError(f"whole_order must list each of the {L} MoE layers once, got {order}")
    slots = _allocate(available, b, E, m, whole_from, order)
    pool = sum(s * x for s, x in zip(slots, b))
    return Plan(
        path=str(layout.path),
        model_type=layout.model_type,
        budget=budget,
        dense_bytes=layout.dense_bytes,
        kv_bytes=kv,
        snapshot_bytes=snapshots,
        reserve_bytes=reserve,
        expert_bytes_per_layer=list(b),
        slots_per_layer=slots,
        whole_layers=[i for i, s in enumerate(slots) if s == E],
        pool_bytes=pool,
        expected_peak_bytes=fixed + reserve + pool,
        num_experts=E,
        top_k=layout.top_k,
        num_moe_layers=L,
        max_context=max_context,
        kv_description=kv_text,
        kv_bits=kv_layout.bits if kv_layout.quantized and not layout.kv_blocker else None,
        min_slots=m,
        whole_from=whole_from,
        checkpoint_bytes=layout.checkpoint_bytes,
        skipped_bytes=layout.skipped_bytes,
        layer_keys=list(layout.layer_keys),
        vision_bytes=layout.vision_bytes,
        image_tokens=layout.image_tokens,
        image_note=layout.image_note,
        expert_chunk=expert_chunk(layout, reserve + available - pool, max_context=max_context, kv=kv_layout),
    )


def _allocate(
    available: int, b: list[int], E: int, m: int, whole_from: float, order: list[int]
) -> list[int]:
    """Slots per layer for `available` bytes; every layer's count never decreases as
    `available` grows (each phase only adds slots, in a fixed order).

    1. every layer gets `m` slots;
    2. all layers grow together up to K = max(m, ceil(whole_from x E)) slots; bytes
       for less than one more slot everywhere give one more slot to the first layers;
    3. once every layer has K, layers are made whole in `order`, and what does not
       complete the next layer goes to that layer.
    Both "first layers" in 2 and 3 follow `order`.
    """
    L = len(b)
    if not L:
        return []
    per_round = sum(b)
    K = min(E, max(m, math.ceil(whole_from * E)))
    s = min(K, available // per_round)
    slots = [s] * L
    left = available - s * per_round
    if s < K:
        for i in order:  # a prefix, so a larger budget never takes one back
            if left < b[i]:
                break
            slots[i] += 1
            left -= b[i]
        return slots
    for i in order:
        need = (E - slots[i]) * b[i]
        if left >= need:
            slots[i] = E
            left -= need
        else:
            slots[i] += left // b[i]
            break
    return slots


def _shortfall(budget, layout, kv, reserve, reserve_given, m, floor_pool) -> str:
    """The one-line refusal: what the budget must cover, and the least budget that does."""
    need = layout.dense_bytes + kv + reserve + floor_pool
    fixed = layout.dense_bytes + kv + floor_pool
    if reserve_given is None:  # the default reserve grows with the budget
        least = max(fixed + RESERVE_FLOOR, math.ceil(fixed / (1 - RESERVE_FRACTION)))
    else:
        least = fixed + reserve
    parts = [f"dense weights {format_size(layout.dense_bytes)}", f"KV cache {format_size(kv)}",
             f"reserve {format_size(reserve)}"]
    if layout.layer_keys:
        parts.append(f"{m} slots x {len(layout.layer_keys)} layers {format_size(floor_pool)}")
    return (
        f"budget {format_size(budget)} is {format_size(need - budget)} short: "
        + " + ".join(parts)
        + f"; it takes at least {format_size(_round_up(least))} (or a smaller max_context)"
    )


def _round_up(n: int) -> int:
    """Up to the next 0.1 of the unit format_size will print it in, so the suggested
    budget, typed back in, is enough."""
    for scale in (1e3, 1e6, 1e9, 1e12):
        if n < scale * 1000 or scale == 1e12:
            if n < 1000:
                return n
            step = scale / 10
            return int(math.ceil(n / step) * step)
    return n
