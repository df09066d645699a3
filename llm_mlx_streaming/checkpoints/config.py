"""What a checkpoint says about itself, and whether it can run, without reading weights.

`llm mlxs add` and the loader run the same checks, so a checkpoint that can never run
is refused when it is added, in one line naming the file, and not later with a cryptic
error from deep inside mlx. Only config.json and the safetensors headers are read.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from ..errors import CheckpointError
from ..experts.index import read_header, weight_files
from .support import unsupported_reason
from .vision import build_vision_model, is_vision_tensor, mlx_vlm_module, takes_images, unsupported_vision_reason
from ..errors import one_line

QUANT_MODES = ("affine", "mxfp4", "mxfp8", "nvfp4")


def config_field(config: dict, names) -> object:
    """The first of `names` set in config or its `text_config` (VLM wrappers)."""
    text = config.get("text_config")
    for cfg in (config, text if isinstance(text, dict) else {}):
        for name in names:
            value = cfg.get(name)
            if value is not None:
                return value
    return None


def read_config(path: Path) -> dict:
    """A checkpoint directory's config.json, or a one-line error naming what is wrong."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: checkpoint directory not found")
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory (expected an mlx-lm checkpoint)")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{path} is not an mlx-lm checkpoint: no config.json")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{config_file}: not valid JSON ({e.msg})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{config_file}: cannot read ({e})") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise CheckpointError(f"{config_file} has no model_type: not an mlx-lm checkpoint")
    if takes_images(config) and not _has_vision_tower(path):
        # a text-only conversion (mlx-lm's) that kept the vision config: mlx-lm runs it
        config = {k: v for k, v in config.items() if k != "vision_config"}
    return config


def _has_vision_tower(path: Path) -> bool:
    """Whether the checkpoint holds any tensor of a vision tower or projector."""
    index = path / "model.safetensors.index.json"
    try:
        names = json.loads(index.read_text())["weight_map"] if index.exists() else \
            [n for f in weight_files(path) for n in read_header(f)]
    except (OSError, ValueError, KeyError, CheckpointError):
        return True  # unreadable: the checks that follow say why, in mlx-vlm's terms
    return any(is_vision_tensor(name) for name in names if name != "__metadata__")


def describe(config: dict) -> dict:
    """Architecture, routed experts, layers, experts per token and quantization.

    Experts and experts per token are what mlx-lm's model of this config has (`moe_shape`);
    None where mlx-lm cannot build it.
    """
    quant = config.get("quantization")
    if not isinstance(quant, dict) or not quant:
        quant_name = None
    elif quant.get("mode", "affine") == "affine":
        quant_name = f"{quant.get('bits')}bit"
    else:
        quant_name = quant["mode"]
    try:
        experts, top_k = moe_shape(config) or (None, None)
    except CheckpointError:
        experts = top_k = None
    return {
        "architecture": config.get("model_type"),
        "experts": experts,
        "layers": config_field(config, ("num_hidden_layers", "n_layers", "num_layers")),
        "top_k": top_k,
        "quant": quant_name,
    }


class _Routed(Exception):
    """Carries the number of experts a router picked per token out of the probe."""


class _RouteProbe:
    """Stands in for an expert container: reads the router's choice, computes nothing."""

    def __call__(self, x, indices, *args, **kwargs):
        raise _Routed(indices.shape[-1])


def moe_shape(config: dict) -> tuple[int, int] | None:
    """(routed experts, experts per token) of the model mlx-lm builds from `config`;
    None for a model without expert containers. One-line CheckpointError if mlx-lm
    cannot build the model or route a token with it.

    Every family spells these fields its own way (and some defaults live in its
    ModelArgs), so they are read from mlx-lm's own model: the experts from the stacked
    container's first dimension, the experts per token from the shape of the ids the
    router hands that container for one token. Nothing is computed: MLX is lazy, and a
    shape is known without evaluating it.
    """
    return _moe_model(json.dumps(config, sort_keys=True))[0]


def expert_container_paths(config: dict) -> tuple[str, ...]:
    """Module paths of the expert containers of mlx-lm's model of `config`, which are
    also the key prefixes of their stacked tensors in the checkpoint."""
    return _moe_model(json.dumps(config, sort_keys=True))[1]


def decoder_shape(config: dict) -> tuple[int, int, int]:
    """(decoder layers, hidden size, attention heads) of the model mlx-lm builds from
    `config`: the layers as mlx-lm counts them for its caches (`len(model.layers)`), the
    width of the widest token embedding, the heads from the config under any of the names
    families use (1 when none is given). Shapes only: nothing is computed."""
    return _decoder_shape(json.dumps(config, sort_keys=True))


@functools.lru_cache(maxsize=16)
def _decoder_shape(config_json: str) -> tuple[int, int, int]:
    import mlx.nn as nn

    config = json.loads(config_json)
    heads = int(config_field(config, ("num_attention_heads", "num_heads", "n_heads", "n_head")) or 1)
    try:
        model = _build(config)
        widths = [m.weight.shape[1] for _, m in model.named_modules() if isinstance(m, nn.Embedding)]
        decoder = model.language_model if takes_images(config) else model
        return len(decoder.layers), max(widths), heads
    except Exception:  # a config mlx-lm cannot build is refused by moe_shape, with mlx-lm's words
        layers = config_field(config, ("num_hidden_layers", "num_layers", "n_layers"))
        return int(layers or 0), int(config_field(config, ("hidden_size", "model_dim", "d_model")) or 0), heads


def _hidden_size(model, block, attr: str, experts: int) -> int:
    """The width of the hidden state a MoE block takes: the input width of its router
    (one score per expert), else the widest token embedding (the others are extra
    per-layer or n-gram inputs)."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    for key, value in tree_flatten(block.parameters()):
        if not key.startswith(attr + ".") and value.ndim == 2 and value.shape[0] == experts:
            return value.shape[1]
    return max(m.weight.shape[1] for _, m in model.named_modules() if isinstance(m, nn.Embedding))


@functools.lru_cache(maxsize=16)
def _moe_model(config_json: str) -> tuple[tuple[int, int] | None, tuple[str, ...]]:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from ..experts.switch import expert_containers

    config = json.loads(config_json)
    library = "mlx-vlm" if takes_images(config) else "mlx-lm"
    try:
        model = _build(config)
    except CheckpointError:
        raise
    except Exception as e:  # the library's own error, whatever its type
        raise CheckpointError(
            f"{library} cannot build a {config.get('model_type')} model from it: "
            f"{one_line(e)}"
        ) from None
    containers = expert_containers(model)
    if not containers:
        return None, ()
    name, container = containers[0]
    experts = next(iter(tree_flatten(container.parameters())))[1].shape[0]
    parent_name, _, attr = name.rpartition(".")
    modules = dict(model.named_modules())
    setattr(modules[parent_name], attr, _RouteProbe())
    x = mx.zeros((1, 1, _hidden_size(model, modules[parent_name], attr, experts)))
    # The container's own caller, or (where that is a wrapper taking the router's ids) the
    # first module above it that routes a hidden state by itself.
    parts = parent_name.split(".")
    first_error = None
    for end in range(len(parts), 0, -1):
        try:
            modules[".".join(parts[:end])](x)
        except _Routed as routed:
            top_k = routed.args[0]
            break
        except Exception as e:
            first_error = first_error or e
    else:
        raise CheckpointError(
            f"{library} cannot route a token with this config ({one_line(first_error)}); "
            f"experts per token must be between 1 and the {experts} experts"
        )
    if not 1 <= top_k <= experts:
        raise CheckpointError(
            f"experts per token is {top_k}; it must be between 1 and the "
            f"{experts} experts"
        )
    return (experts, top_k), tuple(n for n, _ in containers)


def empty_prompt_cache(config: dict) -> list:
    """The prompt cache mlx-lm makes for its model of `config` (the language model's, for
    a checkpoint that takes images), empty and shared between calls: for reading which
    cache classes the model keeps, never to be fed."""
    return list(_empty_prompt_cache(json.dumps(config, sort_keys=True)))


@functools.lru_cache(maxsize=16)
def _empty_prompt_cache(config_json: str) -> tuple:
    from mlx_lm.models.cache import make_prompt_cache

    config = json.loads(config_json)
    model = _build(config)
    return tuple(make_prompt_cache(model.language_model if takes_images(config) else model))


def _build(config: dict):
    """mlx-lm's model of `config`, or mlx-vlm's for a checkpoint that takes images;
    nothing is computed."""
    if takes_images(config):
        return build_vision_model(config)
    from .classes import model_classes

    model_class, args_class = model_classes(config)
    return model_class(args_class.from_dict(config))


def check_checkpoint(path: Path) -> dict:
    """The checkpoint's config if it can run; else a one-line CheckpointError.

    Checks config.json (valid, a model type mlx-lm knows and the engine supports, a
    supported quantization, a model mlx-lm builds and routes with) and every shard's header
    (readable, and the file holds every byte it promises). No weight is read.
    """
    path = Path(path)
    config = read_config(path)
    config_file = path / "config.json"
    _check_model_type(config, config_file)
    files = weight_files(path)  # no weights at all says more than any config field
    quant = config.get("quantization") or {}
    if isinstance(quant, dict):
        modes = [quant.get("mode", "affine")] + [
            v.get("mode", quant.get("mode", "affine")) for v in quant.values() if isinstance(v, dict)
        ]
        for mode in modes:
            if mode not in QUANT_MODES:
                raise CheckpointError(
                    f"{config_file}: unsupported quantization mode {mode!r} "
                    f"(supported: {', '.join(QUANT_MODES)})"
                )
    reason = unsupported_vision_reason(config) if takes_images(config) else unsupported_reason(config)
    if reason:
        raise CheckpointError(
            f"{config_file}: {config['model_type']} is not supported by llm-mlx-streaming: {reason}"
        )
    try:
        moe_shape(config)
    except CheckpointError as e:
        raise CheckpointError(f"{config_file}: {e}") from None
    for file in files:
        read_header(file)
    return config


def _check_model_type(config: dict, config_file: Path) -> None:
    from .classes import model_classes

    if takes_images(config):
        try:
            mlx_vlm_module(config)
        except CheckpointError as e:
            raise CheckpointError(f"{config_file}: {e}") from None
        return
    try:
        model_classes(config)
    except (ValueError, ImportError):
        from importlib.metadata import version

        raise CheckpointError(
            f"{config_file}: model_type {config['model_type']!r} is not one that mlx-lm "
            f"{version('mlx-lm')} knows"
        ) from None
