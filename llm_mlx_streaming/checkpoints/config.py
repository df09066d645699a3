"""What a checkpoint says about itself, and whether it can run, without reading weights.

`llm mlxs add` and the loader run the same checks, so a checkpoint that can never run
is refused when it is added, in one line naming the file, and not later with a cryptic
error from deep inside mlx. Only config.json and the safetensors headers are read.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import CheckpointError
from ..experts.index import read_header, weight_files

# Keys that count routed experts and experts per token, across mlx-lm's MoE families.
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
TOP_K_KEYS = ("num_experts_per_tok", "experts_per_token", "moe_topk")
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
    return config


def describe(config: dict) -> dict:
    """Architecture, routed experts, layers, experts per token and quantization."""
    quant = config.get("quantization")
    if not isinstance(quant, dict) or not quant:
        quant_name = None
    elif quant.get("mode", "affine") == "affine":
        quant_name = f"{quant.get('bits')}bit"
    else:
        quant_name = quant["mode"]
    experts = config_field(config, EXPERT_COUNT_KEYS) or None
    return {
        "architecture": config.get("model_type"),
        "experts": experts,
        "layers": config_field(config, ("num_hidden_layers",)),
        "top_k": config_field(config, TOP_K_KEYS) if experts else None,
        "quant": quant_name,
    }


def check_checkpoint(path: Path) -> dict:
    """The checkpoint's config if it can run; else a one-line CheckpointError.

    Checks config.json (valid, a model type mlx-lm knows, a supported quantization,
    experts per token between 1 and the number of experts) and every shard's header
    (readable, and the file holds every byte it promises). No weight is read.
    """
    path = Path(path)
    config = read_config(path)
    config_file = path / "config.json"
    _check_model_type(config, config_file)
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
    experts = config_field(config, EXPERT_COUNT_KEYS)
    if experts:
        top_k = config_field(config, TOP_K_KEYS)
        if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= experts:
            raise CheckpointError(
                f"{config_file}: experts per token (num_experts_per_tok) is {top_k!r}; "
                f"it must be between 1 and the {experts} experts"
            )
    for file in weight_files(path):
        read_header(file)
    return config


def _check_model_type(config: dict, config_file: Path) -> None:
    from mlx_lm.utils import _get_classes

    try:
        _get_classes(config)
    except (ValueError, ImportError):
        from importlib.metadata import version

        raise CheckpointError(
            f"{config_file}: model_type {config['model_type']!r} is not one that mlx-lm "
            f"{version('mlx-lm')} knows"
        ) from None
