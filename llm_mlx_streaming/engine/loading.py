"""Loads a checkpoint with mlx-lm and swaps each expert container for a streaming one.

mlx-lm builds the model lazily (`lazy=True`), so no tensor is read until it is
evaluated; the stacked expert tensors are replaced by pool slots before that happens,
and so never enter memory. Everything else (attention, routers, shared experts, norms,
embeddings) is evaluated once and stays resident. A vision-language checkpoint is built
the same way by mlx-vlm (engine/vision.py): its vision tower and projector are resident
with the dense weights, its language model's experts streamed.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..checkpoints.config import check_checkpoint, config_field
from ..checkpoints.mtp import classes_without_head
from ..checkpoints.vision import takes_images
from ..errors import CheckpointError, one_line
from ..experts.index import CheckpointIndex
from ..experts.policies import DEFAULT_POLICY
from ..experts.packed import CHECK_MODES, open_packed
from ..experts.pool import ExpertPool
from ..experts.prefetch import Overlap, find_router
from ..experts.store import DEFAULT_THREADS, ExpertStore
from ..experts.switch import StreamingExperts, attach_pool, expert_containers
from .prefill import tile_mixers


@dataclass
class StreamingModel:
    """A loaded model whose MoE layers stream their experts."""

    path: Path
    model: nn.Module
    tokenizer: object
    config: dict
    store: ExpertStore
    layers: list[StreamingExperts] = field(default_factory=list)
    dtypes: list[dict] = field(default_factory=list)
    # Parts loaded beside the model by a layer above (a drafter's head), by name: each
    # has a `.pool` reading through `store` and a `.build_pool(loaded)` run on rebuilds.
    attachments: dict = field(default_factory=dict)
    expert_slots: int | Sequence[int] | None = None  # as last given to build_pools
    policy: str = DEFAULT_POLICY
    overlap: Overlap = field(default_factory=Overlap)  # reads overlapping compute, read-ahead

    @property
    def takes_images(self) -> bool:
        """A vision-language model's tokenizer carries its processor (engine/vision.Vision)."""
        return getattr(self.tokenizer, "vision", None) is not None

    @property
    def pools(self) -> list[ExpertPool]:
        return [m.pool for m in self.layers]

    @property
    def all_pools(self) -> list[ExpertPool]:
        """The layers' pools and the attachments': every pool that reads through `store`
        and counts I/O."""
        return self.pools + [a.pool for a in self.attachments.values()]

    def build_pools(self, expert_slots: int | Sequence[int] | None, policy: str) -> None:
        """(Re)create every layer's pool; dense weights are untouched.

        `expert_slots` is one count for every layer, one per MoE layer (a memory plan),
        or None for a slot per expert.
        """
        if isinstance(expert_slots, Sequence) and len(expert_slots) != len(self.layers):
            raise ValueError(
                f"{len(expert_slots)} slot counts given for {len(self.layers)} MoE layers"
            )
        for i, (module, dtypes) in enumerate(zip(self.layers, self.dtypes)):
            slots = expert_slots[i] if isinstance(expert_slots, Sequence) else expert_slots
            attach_pool(module, dtypes, slots, self.store, policy)
        self.expert_slots, self.policy = expert_slots, policy
        for attachment in self.attachments.values():
            attachment.build_pool(self)


def load_streaming(
    path: str | Path, *, expert_slots: int | None = None, policy: str = DEFAULT_POLICY,
    threads: int = DEFAULT_THREADS, page_cache: str = "keep", packed: bool = True,
    packed_check: str = "first", overlap: str = "auto", prepare: Callable | None = None,
) -> StreamingModel:
    """Load `path` with mlx-lm, streaming its experts through pools of `expert_slots`.

    Reads use `threads` reader threads; `page_cache` is "keep" (through the OS cache)
    or "bypass". With `packed`, the checkpoint's packed store (experts/packed.py) is
    used when present and valid, its records checked on their first read
    (`packed_check="first"`) or on every read ("always"). `overlap` ("auto", "on",
    "off") is when decode reads overlap compute and read ahead (experts/prefetch.py).
    `prepare(model)` is called on the lazily built model before its expert containers
    are found (a pipeline rank cuts it to its own layers there, so nothing of the
    others' is read).
    """
    from mlx_lm.utils import load_tokenizer

    from ..formats.registry import install as install_format

    if packed_check not in CHECK_MODES:
        raise ValueError(f"packed_check must be one of {', '.join(CHECK_MODES)}, got {packed_check!r}")
    path = Path(path).expanduser()
    config = check_checkpoint(path)  # config.json and every shard's header
    index = CheckpointIndex(path)
    model, config, processor = _lazy_model(path, config)
    if prepare is not None:
        prepare(model)
    tokenizer = load_tokenizer(path, eos_token_ids=config_field(config, ("eos_token_id",)))
    install_format(tokenizer)
    if processor is not None:
        from .vision import Vision

        tokenizer.vision = Vision(processor, dict(vars(model.vlm.config)))
    loaded = StreamingModel(path, model, tokenizer, config, ExpertStore(threads, page_cache),
                            overlap=Overlap(overlap))
    named = getattr(model, "vlm", model)  # module paths are the checkpoint's tensor names
    containers = expert_containers(named)
    if not containers:
        print(f"{path.name}: no MoE layer, running fully resident", file=sys.stderr)
    for ordinal, (name, container) in enumerate(containers):
        params = dict(tree_flatten(container.parameters()))
        num_experts = next(iter(params.values())).shape[0]
        layer = index.layer(name, {k: v.shape[1:] for k, v in params.items()}, num_experts)
        module = StreamingExperts(container, layer, ordinal)
        loaded.layers.append(module)
        loaded.dtypes.append({k: v.dtype for k, v in params.items()})
        _replace(named, name, module)
    _link_read_ahead(named, [name for name, _ in containers], loaded)
    try:
        if packed and loaded.layers:
            loaded.store.packed = open_packed(path, [m.layout for m in loaded.layers], packed_check)
        files = {c.file for m in loaded.layers for c in m.layout.components}
        if loaded.store.packed:
            files |= {layer.file for layer in loaded.store.packed.layers.values()}
        loaded.store.open_files(files)
        loaded.build_pools(expert_slots, policy)
    except BaseException:
        loaded.store.close()
        raise
    if processor is None:
        tile_mixers(model)  # a prompt in one call per expert chunk, every mixer in tiles (engine/prefill.py)
    # Also the arrays modules keep outside their parameters (RoPE frequencies): left lazy,
    # they would be evaluated first on the engine thread, which lacks the loading
    # thread's streams.
    mx.eval(model.parameters(), _attribute_arrays(model))
    return loaded


def _lazy_model(path: Path, config: dict):
    """(the model, built lazily, its config, a vision-language model's processor or None):
    mlx-lm's model, or for a checkpoint that takes images mlx-vlm's behind VisionLanguage."""
    if takes_images(config):
        from .vision import VisionLanguage, load_vision_model

        try:
            vlm, processor = load_vision_model(path, config)
        except (ValueError, FileNotFoundError, KeyError, OSError) as e:
            raise CheckpointError(f"{path}: mlx-vlm cannot load this checkpoint: {one_line(e)}") from None
        return VisionLanguage(vlm), config, processor
    from mlx_lm.utils import load_model

    try:
        model, config = load_model(path, lazy=True, get_model_classes=classes_without_head)
    except (ValueError, FileNotFoundError, KeyError) as e:
        raise CheckpointError(f"{path}: mlx-lm cannot load this checkpoint: {one_line(e)}") from None
    return model, config, None


def _attribute_arrays(model: nn.Module) -> list:
    """Arrays held by a module but not among its parameters (private `_name` entries,
    plain attributes)."""
    return [v for _, m in model.named_modules() for v in (*m.values(), *vars(m).values())
            if isinstance(v, mx.array)]


def _link_read_ahead(model: nn.Module, names: list[str], loaded: StreamingModel) -> None:
    """Give each MoE layer the model's Overlap and the next MoE layer with its router,
    so a decode call can read ahead what the next layer is predicted to need."""
    for i, module in enumerate(loaded.layers):
        module.overlap = loaded.overlap
        if i + 1 < len(names):
            router = _router_of(model, names[i + 1], loaded.layers[i + 1].layout.num_experts)
            module.ahead = (loaded.layers[i + 1], router) if router is not None else None


def _router_of(model: nn.Module, name: str, num_experts: int):
    """The router beside expert container `name`, or beside the wrapper that holds it
    (`layers.N.experts.switch_glu`, whose router sits on the decoder layer)."""
    wrapper = name.rpartition(".")[0]
    for held in (name, wrapper):
        router = find_router(_parent(model, held)[0], num_experts)
        if router is not None:
            return router
    return None


def _parent(model: nn.Module, name: str):
    """The module holding `name`'s last part, and that part."""
    *parents, attr = name.split(".")
    obj = model
    for part in parents:
        obj = obj[int(part)] if isinstance(obj, list) else obj[part]
    return obj, attr


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    obj, attr = _parent(model, name)
    if isinstance(obj, list):
        obj[int(attr)] = module
    else:
        setattr(obj, attr, module)

