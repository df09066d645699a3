"""The memory-budget planner: how many expert slots each MoE layer can afford.

Given a checkpoint and a memory budget, the planner splits the budget, in this order:

1. the dense weights (everything that is not a stacked expert tensor: embeddings,
   attention, routers, norms, shared experts), which stay resident;
2. the KV cache for `max_context` tokens;
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
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

from ..checkpoints.config import config_field, decoder_shape, expert_container_paths, moe_shape, read_config
from ..errors import CheckpointError
from ..experts.index import CheckpointIndex
from ..sizes import format_size, parse_size
from ..values import DEFAULT_MAX_CONTEXT
from .kv import FULL_PRECISION, KVSpec, blocker, check_model
from .kv import bytes_per_element as bytes_per_element_of

__all__ = [
    "DEFAULT_HIT_RATES",
    "DEFAULT_MAX_CONTEXT",
    "KV_STEP",
    "Plan",
    "PlanError",
    "checkpoint_layout",
    "default_reserve",
    "kv_cache_bytes",
    "plan_memory",
    "prefill_step_for",
]

MiB = 1024**2
RESERVE_FLOOR = 256 * MiB  # fixed runtime overhead: MLX/Metal, tokenizer, Python
RESERVE_FRACTION = 0.05  # scales with the working set (activations, allocator slack)
WHOLE_FROM = 0.5  # every layer holds this share of its experts before any layer is whole
KV_STEP = 256  # mlx-lm's KVCache grows in steps of 256 tokens
PREFILL_STEP = 2048  # mlx-lm's stream_generate prefills in chunks of this many tokens
DEFAULT_HIT_RATES = (0.5, 0.8, 0.9)

# Where the stacked expert tensors of a layer live: mlx-lm's SwitchGLU/SwitchMLP are
# named `switch_mlp` by every architecture but gpt_oss, whose container is `mlp.experts`.
# The key is `<container>.<proj>.<weight|scales|biases|bias>`.
# Decoder layers under a language model's `model.layers` (also inside a VLM wrapper).
_LAYER_KEY = re.compile(r"^(?:language_model\.)?model\.layers\.(\d+)\.")



class PlanError(ValueError):
    """A budget that cannot run the checkpoint; the message is one line."""


def default_reserve(budget: int) -> int:
    """max(256 MiB, 5% of the budget): see docs/planner.md."""
    return max(RESERVE_FLOOR, int(RESERVE_FRACTION * budget))


# -- the checkpoint, from headers alone ------------------------------------------------


@dataclass
class Layout:
    """What a plan needs to know about a checkpoint."""

    path: Path
    config: dict
    model_type: str
    num_experts: int  # 0: a dense model
    top_k: int
    dense_bytes: int
    skipped_bytes: int  # tensors mlx-lm drops on load (multi-token-prediction heads)
    layer_keys: list[str] = field(default_factory=list)  # one expert container per MoE layer
    expert_bytes: list[int] = field(default_factory=list)  # bytes of one expert, per MoE layer
    kv_blocker: str | None = None  # why a quantized KV cache cannot apply (engine/kv.py)

    @property
    def checkpoint_bytes(self) -> int:
        return self.dense_bytes + self.num_experts * sum(self.expert_bytes)


def _dropped_on_load(key: str, num_layers: int | None) -> bool:
    """Tensors mlx-lm's sanitize() drops: multi-token-prediction heads (qwen3_next's
    `mtp.*`, deepseek_v3's extra decoder layer `model.layers.<num_hidden_layers>`)."""
    if key.startswith("mtp.") or ".mtp." in key:
        return True
    m = _LAYER_KEY.match(key)
    return bool(m and num_layers is not None and int(m.group(1)) >= num_layers)


def _layer_order(key: str) -> list[int]:
    # The engine orders its expert containers the same way (loading.expert_containers).
    return [int(n) for n in re.findall(r"\d+", key)]


def checkpoint_layout(path: str | os.PathLike) -> Layout:
    """Dense bytes and per-MoE-layer bytes per expert, from config.json and headers.

    A stacked expert tensor is one under an expert container of the model mlx-lm builds
    (`expert_container_paths`) whose first dimension is
    number of experts of mlx-lm's model; it belongs to its container's MoE layer. Every
    other tensor is dense.
    """
    path = Path(path).expanduser()
    config = read_config(path)
    index = CheckpointIndex(path)
    try:
        num_experts, top_k = moe_shape(config) or (0, 0)
        containers = expert_container_paths(config)
    except CheckpointError as e:
        raise CheckpointError(f"{path / 'config.json'}: {e}") from None
    num_layers = decoder_shape(config)[0] or None
    dense = skipped = 0
    groups: dict[str, int] = {}
    for key, entry in index.tensors.items():
        if _dropped_on_load(key, num_layers):
            skipped += entry.nbytes
            continue
        container = next((c for c in containers if key.startswith(c + ".")), None)
        if container and entry.shape and entry.shape[0] == num_experts:
            groups[container] = groups.get(container, 0) + entry.nbytes
        else:
            dense += entry.nbytes
    keys = sorted(groups, key=_layer_order)
    if num_experts:
        if not keys:
            raise CheckpointError(
                f"{path}: config.json says {num_experts} experts, but no stacked expert "
                "tensors (switch_mlp / mlp.experts) are in the checkpoint; convert it with mlx_lm"
            )
    for key in keys:
        if groups[key] % num_experts:
            raise CheckpointError(f"{path}: expert tensors of {key!r} do not split into {num_experts} experts")
    return Layout(
        path=path,
        config=config,
        model_type=str(config_field(config, ("model_type",)) or "?"),
        num_experts=num_experts,
        top_k=top_k,
        dense_bytes=dense,
        skipped_bytes=skipped,
        layer_keys=keys,
        expert_bytes=[groups[k] // num_experts for k in keys],
        kv_blocker=blocker(config, index.tensors),
    )


# -- the KV cache --------------------------------------------------------------------


def _activation_bytes(config: dict) -> int:
    """2 (float16/bfloat16), or 4 when the checkpoint says float32 (mlx-lm then computes
    in float32, and its caches hold float32)."""
    dtype = str(config_field(config, ("torch_dtype", "dtype")) or "bfloat16")
    return 4 if dtype.replace("torch.", "") == "float32" else 2


def _layer_kinds(config: dict, num_layers: int) -> list[str]:
    """"full", "sliding" or "linear" per decoder layer, from the config.

    `layer_types` (gpt_oss, newer Qwen3-Next configs) says it per layer. Otherwise a
    linear-attention hybrid (a `full_attention_interval` next to `linear_*` fields, as
    Qwen3-Next: layer i is full attention when (i + 1) % interval == 0, as mlx-lm builds
    it) has only every interval-th layer holding a KV cache. Failing both, every layer
    is counted as full attention (an over-estimate, never an under-estimate).
    """
    types = config_field(config, ("layer_types",))
    if isinstance(types, list) and len(types) == num_layers:
        kinds = []
        for t in types:
            t = str(t)
            kinds.append("sliding" if "sliding" in t else "linear" if "linear" in t else "full")
        return kinds
    interval = config_field(config, ("full_attention_interval",))
    if interval and config_field(config, ("linear_num_value_heads",)):
        return ["full" if (i + 1) % int(interval) == 0 else "linear" for i in range(num_layers)]
    return ["full"] * num_layers


def kv_cache_bytes(
    config: dict, max_context: int, bytes_per_element: int | None = None,
    kv: KVSpec = FULL_PRECISION, kv_blocker: str | None = None,
) -> tuple[int, str]:
    """(bytes, description) of the caches mlx-lm keeps for `max_context` tokens.

    With a quantized layout `kv` (and no `kv_blocker`, see engine/kv.py), full-attention
    layers hold `kv.bits` per element plus a scale and a bias per group; sliding windows
    and linear-attention state stay as they are, as in the engine.

    An upper bound, checked against mlx-lm's caches in tests/test_planner.py:

    - full attention: 2 x kv_heads x head_dim elements (K and V) per layer and token;
      multi-head latent attention (deepseek_v3: `kv_lora_rank` in the config) caches
      the latent instead, kv_lora_rank + qk_rope_head_dim elements. mlx-lm's KVCache
      grows 256 tokens at a time, and a prompt that ends off a step boundary leaves up
      to 255 positions unused, so a layer holds at most max_context + 255 positions.
    - sliding window (`layer_types` says "sliding_attention"): mlx-lm's RotatingKVCache
      holds `sliding_window` tokens, but right after a prefill chunk it holds
      sliding_window - 1 + the chunk (up to 2048 tokens in stream_generate).
    - linear attention (Qwen3-Next's gated delta net): a fixed state whatever the
      context: a conv state of (kernel - 1) x conv_dim elements and a float32 recurrent
      state of value_heads x value_dim x key_dim.
    """
    if max_context < 0:
        raise ValueError(f"max_context must not be negative, got {max_context}")
    width = bytes_per_element or _activation_bytes(config)
    quantized = kv.quantized and not kv_blocker and kv.start < max_context
    full_width = bytes_per_element_of(kv, width) if quantized else width
    num_layers, hidden, heads = decoder_shape(config)
    kv_lora = config_field(config, ("kv_lora_rank",))
    if kv_lora:
        per_token = int(kv_lora) + int(config_field(config, ("qk_rope_head_dim",)) or 0)
    else:
        kv_heads = int(config_field(config, ("num_key_value_heads",)) or heads)
        head_dim = config_field(config, ("head_dim",)) or hidden // heads
        per_token = 2 * kv_heads * int(head_dim)
    tokens = max_context + KV_STEP - 1 if max_context else 0
    window = config_field(config, ("sliding_window",))
    kinds = _layer_kinds(config, num_layers)
    total = 0
    for kind in kinds:
        if kind == "full":
            total += math.ceil(tokens * per_token * full_width)
        elif kind == "sliding":
            held = int(window) - 1 + PREFILL_STEP if window else tokens
            total += min(tokens, held) * per_token * width
        else:
            hk = int(config_field(config, ("linear_num_key_heads",)) or 0)
            hv = int(config_field(config, ("linear_num_value_heads",)) or 0)
            dk = int(config_field(config, ("linear_key_head_dim",)) or 0)
            dv = int(config_field(config, ("linear_value_head_dim",)) or 0)
            kernel = int(config_field(config, ("linear_conv_kernel_dim",)) or 4)
            conv = (kernel - 1) * (2 * hk * dk + hv * dv) * width
            total += conv + hv * dv * dk * 4
    counts = {k: kinds.count(k) for k in ("full", "sliding", "linear") if k in kinds}
    if set(counts) <= {"full"}:
        layers = f"{num_layers} layers"
    else:
        names = {"full": "full-attention", "sliding": f"sliding-window ({window})",
                 "linear": "linear-attention"}
        layers = ", ".join(f"{n} {names[k]}" for k, n in counts.items()) + " layers"
    text = f"{max_context} tokens, {layers}"
    if quantized:
        text += f", {kv.describe()}" + (" on the full-attention layers" if set(counts) - {"full"} else "")
    elif kv.quantized:
        why = kv_blocker or f"kv_start {kv.start} is past max_context"
        text += f", full precision (kv_bits {kv.bits} not applied: {why})"
    return total, text


# -- the prefill chunk ---------------------------------------------------------------


ATTENTION_TILE = 2048  # engine/prefill.py: attention takes a long chunk in tiles of this many tokens


def prefill_bytes_per_token(config: dict, top_k: int, bytes_per_element: int | None = None) -> int:
    """Activation bytes one prompt token of a prefill chunk holds at once (an estimate):
    hidden states, queries, keys and values, about 8 x hidden + (heads + 2 x kv_heads)
    x head_dim elements; and its expert routes, top_k x (2 x hidden + 3 x expert width)
    elements (the gathered rows, gate, up, their product, the output rows)."""
    width = bytes_per_element or _activation_bytes(config)
    _, hidden, heads = decoder_shape(config)
    kv_heads = int(config_field(config, ("num_key_value_heads",)) or heads)
    head_dim = int(config_field(config, ("head_dim",)) or hidden // heads)
    expert_width = int(config_field(config, ("moe_intermediate_size", "intermediate_size")) or hidden)
    elements = 8 * hidden + (heads + 2 * kv_heads) * head_dim + top_k * (2 * hidden + 3 * expert_width)
    return elements * width


def attention_tile_bytes(config: dict, context: int) -> int:
    """The scores of one attention tile against `context` keys: tile x heads x context
    float32 values, what mlx materializes on the CPU and for a quantized cache (Metal's
    fused kernel for a full-precision cache does not, so there this over-estimates)."""
    heads = decoder_shape(config)[2]
    return ATTENTION_TILE * heads * context * 4


def prefill_step_for(
    path: str | os.PathLike,
    budget_bytes: int | str,
    *,
    max_context: int | None = DEFAULT_MAX_CONTEXT,
    kv: KVSpec | None = None,
    reserve_bytes: int | str | None = None,
    layout: Layout | None = None,
) -> int:
    """Prompt tokens per prefill chunk for a memory budget ("auto" prefill_step).

    Each expert a chunk routes to is read at most once per chunk (experts/switch.py),
    so the bytes read per prompt token fall as the chunk grows. Attention takes a long
    chunk in tiles (engine/prefill.py), so what a chunk adds per token is its hidden
    states and expert routes; those, plus one tile's attention scores, must fit the
    plan's working reserve. The step is the largest multiple of 256 tokens that fits,
    never below mlx-lm's 2048 and never above max_context (rounded up to 256).
    `kv` does not change the step: the chunk's own keys are quantized only once stored.
    `layout`: the checkpoint's, when the caller has read it already.
    """
    budget = parse_size(budget_bytes)
    context = max_context or DEFAULT_MAX_CONTEXT
    layout = layout or checkpoint_layout(path)
    reserve = default_reserve(budget) if reserve_bytes is None else parse_size(reserve_bytes)
    per_token = prefill_bytes_per_token(layout.config, max(1, layout.top_k))
    room = reserve - attention_tile_bytes(layout.config, context)
    fits = max(0, room) // per_token // KV_STEP * KV_STEP
    ceiling = -(-context // KV_STEP) * KV_STEP
    return int(max(PREFILL_STEP, min(fits, ceiling)))


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
        return d


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
    kv, kv_text = kv_cache_bytes(layout.config, max_context, kv_bytes_per_element, kv_layout, layout.kv_blocker)
    reserve = default_reserve(budget) if reserve_bytes is None else parse_size(reserve_bytes)
    m = min(E, max(1, min_slots if min_slots is not None else layout.top_k)) if L else 0
    fixed = layout.dense_bytes + kv
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
