"""What a checkpoint holds and needs in memory, read from its headers alone.

Its layout (dense bytes, bytes per expert per MoE layer), the KV cache mlx-lm keeps
for a context, and what one prompt token of a prefill chunk holds: the figures the
memory planner (engine/planner.py) splits a budget with, and `llm mlxs pack` reads.
No model load and no mlx, so a 40 GB checkpoint is measured at once.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..checkpoints.config import (config_field, decoder_shape, empty_prompt_cache, expert_container_paths, moe_shape,
                                  read_config)
from ..checkpoints.vision import is_vision_tensor, takes_images
from ..errors import CheckpointError
from ..experts.index import CheckpointIndex
from ..values import ROUTES_AT_ONCE
from .kv import FULL_PRECISION, KVSpec, blocker, rewinds
from .kv import bytes_per_element as bytes_per_element_of
from .vision_footprint import typical_image_tokens

KV_STEP = 256  # mlx-lm's KVCache grows in steps of 256 tokens
PREFILL_STEP = 2048  # mlx-lm's stream_generate prefills in chunks of this many tokens

# Where the stacked expert tensors of a layer live: mlx-lm's SwitchGLU/SwitchMLP are
# named `switch_mlp` by every architecture but gpt_oss, whose container is `mlp.experts`.
# The key is `<container>.<proj>.<weight|scales|biases|bias>`.
# Decoder layers under a language model's `model.layers` (also inside a VLM wrapper).
_LAYER_KEY = re.compile(r"^(?:language_model\.)?model\.layers\.(\d+)\.")

# -- the checkpoint, from headers alone ------------------------------------------------


@dataclass
class Layout:
    """What a plan needs to know about a checkpoint."""

    path: Path
    config: dict
    model_type: str
    num_experts: int  # 0: a dense model
    top_k: int
    dense_bytes: int  # with the vision tower's
    skipped_bytes: int  # tensors mlx-lm drops on load (multi-token-prediction heads)
    vision_bytes: int = 0  # a vision-language model's vision tower and projector, resident
    image_tokens: int = 0  # KV room kept for a prompt's image (engine/vision_footprint.py)
    image_note: str = ""  # how image_tokens was counted
    layer_keys: list[str] = field(default_factory=list)  # one expert container per MoE layer
    expert_bytes: list[int] = field(default_factory=list)  # bytes of one expert, per MoE layer
    kv_blocker: str | None = None  # why a quantized KV cache cannot apply (engine/kv.py)
    rewinds: bool = True  # its cache can be cut back to any prefix (engine/kv.rewinds): it keeps no snapshots

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
    other tensor is dense; a vision-language model's vision tower and projector are dense
    and also counted apart (`vision_bytes`).
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
    vision = takes_images(config)
    dense = skipped = vision_bytes = 0
    groups: dict[str, int] = {}
    for key, entry in index.tensors.items():
        if vision and is_vision_tensor(key):  # its layers are not the language model's
            vision_bytes += entry.nbytes
            dense += entry.nbytes
            continue
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
    image_tokens, image_note = typical_image_tokens(path, config) if vision else (0, "")
    return Layout(
        path=path,
        config=config,
        model_type=str(config_field(config, ("model_type",)) or "?"),
        num_experts=num_experts,
        top_k=top_k,
        dense_bytes=dense,
        skipped_bytes=skipped,
        vision_bytes=vision_bytes,
        image_tokens=image_tokens,
        image_note=image_note,
        layer_keys=keys,
        expert_bytes=[groups[k] // num_experts for k in keys],
        kv_blocker=blocker(config, index.tensors),
        rewinds=rewinds(empty_prompt_cache(config)),
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
    kv: KVSpec = FULL_PRECISION, kv_blocker: str | None = None, image_tokens: int = 0,
) -> tuple[int, str]:
    """(bytes, description) of the caches mlx-lm keeps for `max_context` tokens, plus
    `image_tokens` kept for a prompt's image (a vision-language model's).

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
    text_tokens, max_context = max_context, max_context + image_tokens
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
    images = f" + {image_tokens} image tokens" if image_tokens else ""
    text = f"{text_tokens} tokens{images}, {layers}"
    if quantized:
        text += f", {kv.describe()}" + (" on the full-attention layers" if set(counts) - {"full"} else "")
    elif kv.quantized:
        why = kv_blocker or f"kv_start {kv.start} is past max_context"
        text += f", full precision (kv_bits {kv.bits} not applied: {why})"
    return total, text


# -- the prefill's expert chunk ----------------------------------------------------------


ATTENTION_TILE = 2048  # engine/prefill.py: every mixer takes a long call in tiles of this many tokens


def prefill_bytes_per_token(config: dict, top_k: int, num_experts: int, bytes_per_element: int | None = None) -> int:
    """What one prompt token of an expert chunk holds at once while a decoder layer runs
    (engine/prefill.py): its hidden states (the residual stream, the normed input, the
    mixer's output, the MoE block's input and output: 6 x hidden), the outputs of its
    expert routes twice (the container's, and the block's product with the scores:
    2 x top_k x hidden), the router's scores (2 x experts, float32) and a shared expert's
    or a dense layer's gate, up and product (3 x its width) over the whole chunk. The
    mixers' work is one tile's and the experts' one group of routes' (`prefill_tile_bytes`)."""
    width = bytes_per_element or _activation_bytes(config)
    _, hidden, _ = decoder_shape(config)
    elements = 6 * hidden + 2 * top_k * hidden + 3 * _whole_chunk_width(config)
    return elements * width + 2 * num_experts * 4


def _whole_chunk_width(config: dict) -> int:
    """The widest feed-forward the whole chunk goes through besides the routed experts:
    a shared expert, or the dense layers of a model that has some."""
    shared = config_field(config, ("shared_expert_intermediate_size",)) or 0
    if not shared and config_field(config, ("n_shared_experts",)):
        shared = int(config_field(config, ("n_shared_experts",))) * int(
            config_field(config, ("moe_intermediate_size",)) or 0)
    dense = 0
    if config_field(config, ("first_k_dense_replace", "mlp_only_layers")) or \
            (config_field(config, ("decoder_sparse_step",)) or 1) > 1:
        dense = config_field(config, ("intermediate_size",)) or 0
    return int(max(shared, dense))


def prefill_tile_bytes(config: dict, top_k: int, keys: int, fused_attention: bool,
                       bytes_per_element: int | None = None) -> int:
    """What a prefill holds besides its tokens' own bytes: one tile's attention scores
    against `keys` keys (tile x heads x keys float32, which mlx materializes on the CPU
    and for a quantized cache; none in Metal's fused attention, `fused_attention`), the
    tile's queries, keys, values and linear-attention projections, and one part of an
    expert group's routes (ROUTES_AT_ONCE x (2 x hidden + 3 x expert width): the gathered
    rows, gate, up, their product, the outputs)."""
    width = bytes_per_element or _activation_bytes(config)
    _, hidden, heads = decoder_shape(config)
    kv_heads = int(config_field(config, ("num_key_value_heads",)) or heads)
    head_dim = int(config_field(config, ("head_dim",)) or hidden // heads)
    expert_width = int(config_field(config, ("moe_intermediate_size", "intermediate_size")) or hidden)
    hv = int(config_field(config, ("linear_num_value_heads",)) or 0)
    dv = int(config_field(config, ("linear_value_head_dim",)) or 0)
    hk = int(config_field(config, ("linear_num_key_heads",)) or 0)
    dk = int(config_field(config, ("linear_key_head_dim",)) or 0)
    scores = 0 if fused_attention else ATTENTION_TILE * heads * keys * 4
    projections = ATTENTION_TILE * (2 * (heads + 2 * kv_heads) * head_dim + 3 * (2 * hk * dk + 2 * hv * dv)) * width
    routes = ROUTES_AT_ONCE * (2 * hidden + 3 * expert_width) * width
    return scores + projections + routes


# -- one model's share of a budget -----------------------------------------------------


@dataclass(frozen=True)
class Footprint:
    """What one loaded model holds besides its expert pools, and what a slot costs in each
    MoE layer: the figures a budget shared by several models is split with (engine/sharing.py)."""

    fixed_bytes: int  # dense weights + the KV cache at max_context
    reserve_bytes: int  # the working reserve; the models run in turn, so the largest counts once
    expert_bytes: tuple[int, ...]  # one expert, per MoE layer
    num_experts: int
    floor: int  # the fewest slots per layer a shrunk pool keeps: top_k


def model_footprint(layout: Layout, max_context: int, kv: KVSpec, reserve: int, snapshot_bytes: int = 0) -> Footprint:
    """A checkpoint's Footprint for a context, a KV layout and the plan's working reserve;
    `snapshot_bytes` of prompt snapshots count for a cache that cannot be rewound."""
    kv_bytes, _ = kv_cache_bytes(layout.config, max_context, None, kv, layout.kv_blocker, layout.image_tokens)
    snapshots = 0 if layout.rewinds else snapshot_bytes
    floor = min(layout.num_experts, max(1, layout.top_k)) if layout.layer_keys else 0
    return Footprint(layout.dense_bytes + kv_bytes + snapshots, reserve, tuple(layout.expert_bytes),
                     layout.num_experts, floor)
