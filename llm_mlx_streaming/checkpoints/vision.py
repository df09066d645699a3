"""Which checkpoints take images, and which of the installed mlx-vlm's MoE
vision-language modules the engine streams.

A vision-language checkpoint's config carries its vision tower's settings beside the
language model's; it is built with mlx-vlm's classes (imported only here and only for
such a checkpoint), its vision tower and projector resident, its language model's
experts streamed like any other. The MoE VLM modules are found in mlx-vlm itself
(`vision_moe_modules`), so one a new mlx-vlm adds is noticed (tests/test_vision.py
fails until it is in the matrix or in UNSUPPORTED_VISION).
"""

from __future__ import annotations

import functools
import re

from ..errors import CheckpointError

INSTALL = "pip install 'llm-mlx-streaming[vision]'"

_UNCHECKED = ("no tiny fixture checks its streamed tokens against stock mlx-vlm yet "
              "(fixtures/vision.py), so it is refused rather than run unchecked")

# mlx-vlm modules with a vision config and experts that the engine does not stream, and why;
# the others are the matrix of tests/test_vision.py (fixtures/vision.py VISION_ARCHITECTURES).
UNSUPPORTED_VISION: dict[str, str] = {
    "deepseek_vl_v2": _UNCHECKED,
    "deepseekocr": _UNCHECKED,
    "deepseekocr_2": _UNCHECKED,
    "ernie4_5_moe_vl": _UNCHECKED,
    "gemma4": _UNCHECKED,
    "gemma4_unified": _UNCHECKED,
    "glm5_next": _UNCHECKED,
    "hunyuan_vl": _UNCHECKED,
    "inkling": _UNCHECKED,
    "kimi_k25": _UNCHECKED,
    "kimi_k3": _UNCHECKED,
    "mimo_v2": _UNCHECKED,
    "minimax_m3_vl": _UNCHECKED,
    "moondream3": _UNCHECKED,
    "muse_spark": _UNCHECKED,
    "qwen3_5": _UNCHECKED,
    "qwen3_omni_moe": _UNCHECKED,
    "qwen4_exp": _UNCHECKED,
    "step3p7": _UNCHECKED,
    "unlimited_ocr": _UNCHECKED,
    "youtu_vl": _UNCHECKED,
    "zaya1_vl": _UNCHECKED,
}

_MOE_SOURCE = re.compile(r"switch_layers|SwitchGLU|experts", re.IGNORECASE)


def takes_images(config: dict) -> bool:
    """Whether `config` (a checkpoint's config.json) is a vision-language model's: it
    describes a vision tower. Such a checkpoint is built with mlx-vlm; a text-only
    checkpoint of a family both libraries know stays mlx-lm's."""
    vision = config.get("vision_config")
    return isinstance(vision, dict) and bool(vision)


def mlx_vlm_module(config: dict):
    """mlx-vlm's model package for `config`; a one-line CheckpointError naming the
    extra to install when mlx-vlm is missing, or naming the type it lacks."""
    try:
        from mlx_vlm.utils import get_model_and_args
    except ImportError:
        raise CheckpointError(f"{config.get('model_type')} takes images: {INSTALL}") from None
    try:
        return get_model_and_args(config)[0]
    except (ValueError, KeyError, ImportError):
        from importlib.metadata import version

        raise CheckpointError(f"model_type {config.get('model_type')!r} is not one that mlx-vlm "
                              f"{version('mlx-vlm')} knows") from None


def build_vision_model(config: dict):
    """mlx-vlm's model of `config`, built as mlx-vlm's `load_model` builds it; nothing is
    computed (MLX is lazy)."""
    module = mlx_vlm_module(config)
    from mlx_vlm.utils import update_module_configs

    full = {"text_config": {}, "vision_config": {}, "audio_config": {}, **config}
    model_config = update_module_configs(module.ModelConfig.from_dict(full), module, full,
                                         ["text", "vision", "perceiver", "projector", "audio"])
    return module.Model(model_config)


def unsupported_vision_reason(config: dict) -> str | None:
    return UNSUPPORTED_VISION.get(config.get("model_type"))


@functools.lru_cache(maxsize=1)
def vision_moe_modules() -> tuple[str, ...]:
    """The installed mlx-vlm's model packages that have a vision config and experts."""
    import importlib.util
    import pkgutil
    from pathlib import Path

    import mlx_vlm.models as models

    found = []
    for info in pkgutil.iter_modules(models.__path__):
        if not info.ispkg:
            continue
        folder = Path(importlib.util.find_spec(f"mlx_vlm.models.{info.name}").submodule_search_locations[0])
        config = folder / "config.py"
        if not config.is_file() or "class VisionConfig" not in config.read_text(encoding="utf-8"):
            continue
        if any(_MOE_SOURCE.search(f.read_text(encoding="utf-8")) for f in folder.glob("*.py")):
            found.append(info.name)
    return tuple(sorted(found))
