"""Loads a checkpoint's MTP head next to a streamed model, its experts streamed too.

The head is kept among the loaded model's attachments, so the engine rebuilds and
counts its pool with the layers' without knowing what it is.

mlx-lm drops the head's tensors at load (checkpoints/mtp.py), so they are read here
from the same safetensors: the head is built from mlx-lm's layer classes, quantized as
the checkpoint says, and its expert container swapped for a `StreamingExperts` whose
pool reads from the model's own expert store, exactly like the decoder layers' pools.
Dense head weights stay resident (read lazily, evaluated once).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from ..checkpoints.mtp import MTPHead, build_head, declared_layers, head_prefix
from ..errors import CheckpointError
from ..experts.index import CheckpointIndex
from ..experts.pool import ExpertPool
from ..experts.switch import StreamingExperts, attach_pool, expert_containers

ATTACHMENT = "mtp"  # the head's name among the loaded model's attachments


class NoHeadError(CheckpointError):
    """The checkpoint carries no MTP head weights."""


@dataclass
class LoadedHead:
    """The MTP head of a loaded model and its streamed expert container."""

    head: MTPHead
    experts: StreamingExperts
    dtypes: dict

    @property
    def pool(self) -> ExpertPool:
        return self.experts.pool

    def build_pool(self, loaded) -> None:
        """A pool like a typical layer's, under the model's policy: the one slot count
        every layer has, or the lower median of a memory plan's (whose whole layers would
        otherwise make the head whole too, which the plan did not budget)."""
        slots = loaded.expert_slots
        if isinstance(slots, (list, tuple)):
            whole = self.experts.layout.num_experts
            counts = sorted(whole if n is None else n for n in slots)
            slots = counts[(len(counts) - 1) // 2]
        attach_pool(self.experts, self.dtypes, slots, loaded.store, loaded.policy)


def mtp_head(loaded) -> LoadedHead:
    """The head of `loaded` (the engine's `StreamingModel`), loaded on first use and
    kept among its attachments."""
    if ATTACHMENT not in loaded.attachments:
        loaded.attachments[ATTACHMENT] = load_head(loaded)
    return loaded.attachments[ATTACHMENT]


def load_head(loaded) -> LoadedHead:
    """Build, quantize and fill the MTP head of `loaded`'s checkpoint.

    NoHeadError (one line) when config.json declares no head or the safetensors hold
    none of its tensors (mlx-lm conversions drop them).
    """
    config, name = loaded.config, loaded.path.name
    if not declared_layers(config):
        raise NoHeadError(
            f"{name} has no multi-token-prediction (MTP) head: its config.json declares "
            f"none, so `-o draft mtp` cannot be used with it"
        )
    prefix = head_prefix(config)
    index = CheckpointIndex(loaded.path)
    entries = {k[len(prefix):]: e for k, e in index.tensors.items() if k.startswith(prefix)}
    if not entries:
        raise NoHeadError(
            f"{name} has no multi-token-prediction (MTP) head weights (no {prefix}* tensors; "
            f"mlx-lm conversions drop them), so `-o draft mtp` cannot be used with it"
        )
    weights = {}
    for file in sorted({e.file for e in entries.values()}):
        weights.update(
            (k[len(prefix):], v) for k, v in mx.load(str(file)).items() if k.startswith(prefix)
        )
    head = build_head(config)
    _quantize(head, weights, config, prefix)

    (container_name, container), = expert_containers(head)
    params = dict(tree_flatten(container.parameters()))
    num_experts = next(iter(params.values())).shape[0]
    layout = index.layer(
        prefix + container_name, {k: v.shape[1:] for k, v in params.items()}, num_experts
    )
    experts = StreamingExperts(container, layout, ordinal=len(loaded.layers))
    head.update_modules(tree_unflatten([(container_name, experts)]))

    expected = _resident_names(head, container_name)
    dense = [(k, v) for k, v in weights.items() if k in expected]
    missing = expected - {k for k, _ in dense}
    if missing:
        raise CheckpointError(f"{name}: MTP head tensor '{prefix}{sorted(missing)[0]}' is missing")
    shapes = dict(tree_flatten(head.parameters()))
    for k, v in dense:
        if v.shape != shapes[k].shape:
            raise CheckpointError(f"{name}: MTP head tensor '{prefix}{k}' has shape "
                                  f"{list(v.shape)}, expected {list(shapes[k].shape)}")
    head.load_weights(dense, strict=False)

    loaded.store.open_files({c.file for c in layout.components})
    result = LoadedHead(head, experts, {k: v.dtype for k, v in params.items()})
    result.build_pool(loaded)
    mx.eval(head.parameters())
    return result


def _resident_names(head: nn.Module, container_name: str) -> set[str]:
    """The head's resident parameters by checkpoint-relative name (pool slots excluded;
    the checkpoint's copy of the embedding is not among them: the target's is used)."""
    slots = f"{container_name}.experts."
    return {k for k, _ in tree_flatten(head.parameters()) if not k.startswith(slots)}


def _quantize(head: nn.Module, weights: dict, config: dict, prefix: str) -> None:
    """Quantize the head's layers the way mlx-lm's loader does for the model's: per-path
    entries of config["quantization"] first, else the saved tensors' own shapes."""
    from mlx_lm.utils import infer_quant_config

    quantization = config.get("quantization")
    if not quantization:
        return

    def predicate(path, module):
        if prefix + path in quantization:
            return quantization[prefix + path]
        if not hasattr(module, "to_quantized") or f"{path}.scales" not in weights:
            return False
        return infer_quant_config(path, module, weights)

    nn.quantize(
        head,
        group_size=quantization["group_size"],
        bits=quantization["bits"],
        mode=quantization.get("mode", "affine"),
        class_predicate=predicate,
    )
