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
LANGUAGE_MODEL = "language_model."  # mlx-vlm's prefix of the language model's tensors

_NO_FIXTURE = "no tiny fixture checks its streamed tokens against stock mlx-vlm yet: "

# mlx-vlm modules with a vision config and stacked experts that the engine does not
# stream, and why; the others are the matrix of tests/test_vision.py (fixtures/vision.py
# VISION_ARCHITECTURES).
UNSUPPORTED_VISION: dict[str, str] = {
    "deepseek_vl_v2": _NO_FIXTURE + "it needs DeepSeek-VL2's tiling processor (candidate resolutions, "
                      "global and local views) at a tiny size",
    "deepseekocr": _NO_FIXTURE + "it needs two vision towers (SAM and CLIP) and DeepseekOCR's crop "
                   "processor at a tiny size",
    "deepseekocr_2": _NO_FIXTURE + "it needs a SAM encoder and a Qwen2 decoder used as an image "
                     "encoder, with DeepseekOCR2's crop processor, at a tiny size",
    "ernie4_5_moe_vl": "two expert sets per layer (switch_mlp for text, switch_mlp_1 for image "
                       "tokens) chosen by token type, which the engine's one pool per layer does not follow",
    "gemma4_unified": "its image tokens attend to each other both ways (use_bidirectional_attention "
                      "\"vision\"), a mask mlx-vlm builds only over a prompt fed whole; a tiny fixture "
                      "equals stock mlx-vlm only with it off",
    "glm5_next": _NO_FIXTURE + "its experts carry expanded per-expert scales (expand_expert_scales) "
                 "that the expert index would have to read",
    "inkling": "its experts are InklingSwitchGLU, routed and combined by Metal kernels "
               "(mx.fast.metal_kernel), so they cannot be checked on a CPU",
    "kimi_k3": "its language model runs Metal kernels (mx.fast.metal_kernel), so it cannot be "
               "checked on a CPU",
    "lfm2_vl": _NO_FIXTURE + "lfm2's language model, which has experts only with an LFM2-MoE "
               "text config, and its Lfm2Vl processor need a tiny config",
    "mimo_v2": _NO_FIXTURE + "mimo_v2_flash's language model, its MXFP4 experts converted on load, "
               "with an audio tower",
    "minimax_m3_vl": "its experts may be MiniMaxPackedSwitchGLU (the shared expert packed with the "
                     "routed ones), not a container the engine swaps, and it runs Metal kernels",
    "moondream3": "its experts are two SwitchLinear (fc1, fc2) in its own MoEMLP, not a "
                  "SwitchGLU/SwitchMLP container the engine swaps",
    "muse_spark": _NO_FIXTURE + "its experts run at a compressed width between two projections, "
                  "and its image and video processors need a tiny config",
    "nemotron_h_nano_omni": _NO_FIXTURE + "nemotron_h's hybrid Mamba language model with an audio "
                            "tower and its own image processor",
    "qwen3_omni_moe": _NO_FIXTURE + "its vision config sits in thinker_config, where takes_images "
                      "does not look; a tiny thinker with an audio tower (the talker off: "
                      "enable_audio_output) and its processor's audio feature extractor are needed",
    "qwen4_exp": "it runs Metal kernels (qsa_kernel.py) and reads FP8 weights (fp8.py)",
    "step3p7": _NO_FIXTURE + "its Step3VLProcessor needs a tiny config",
    "unlimited_ocr": "deepseekocr's language model with a ring sliding-window KV cache "
                     "(RingSlidingKVCache) that the engine's cache reuse does not know",
    "youtu_vl": "mlx-vlm ships no processor for it (the checkpoint's remote code does), so its "
                "images cannot be rendered offline",
    "zaya1_vl": "its experts are SwitchLinear in its own ZayaSwitchMLP, not a SwitchGLU/SwitchMLP "
                "container the engine swaps",
}

# Code that builds stacked experts: mlx-vlm's switch layers (SwitchGLU, SwitchLinear, ...).
_MOE_SOURCE = re.compile(r"switch_layers|Switch(GLU|MLP|Linear)\b")
# A relative import of another module of mlx-vlm's models: `from .language import` or
# `from ..deepseek_v3.language import`.
_IMPORT = re.compile(r"^from (\.{1,2})([\w.]*) import", re.MULTILINE)


def is_vision_tensor(key: str) -> bool:
    """Whether `key` of a vision-language checkpoint is its vision tower's or projector's."""
    return not key.startswith(LANGUAGE_MODEL)


def takes_images(config: dict) -> bool:
    """Whether `config` (a checkpoint's, as checkpoints.config.read_config gives it) is a
    vision-language model's: it describes a vision tower. Such a checkpoint is built with
    mlx-vlm; a text-only checkpoint of a family both libraries know (read_config drops
    the vision config a text-only conversion kept) stays mlx-lm's."""
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


def load_lazily(path, config: dict):
    """mlx-vlm's model of the checkpoint at `path` as its `load_model` builds it (weights
    mapped, quantized layers in place), lazily: no tensor is read."""
    mlx_vlm_module(config)  # one line when mlx-vlm is missing or lacks the type
    from mlx_vlm.utils import load_model

    return load_model(path, lazy=True)


def unsupported_vision_reason(config: dict) -> str | None:
    return UNSUPPORTED_VISION.get(config.get("model_type"))


@functools.lru_cache(maxsize=1)
def vision_moe_modules() -> tuple[str, ...]:
    """The installed mlx-vlm's model packages that have a vision config and whose code
    builds stacked experts, its own or a module it imports (kimi_k25's language model is
    deepseek_v3's); a field named like experts in a dense model's config does not count."""
    import importlib.util
    import pkgutil
    from pathlib import Path

    import mlx_vlm.models as models

    root = Path(importlib.util.find_spec("mlx_vlm.models").submodule_search_locations[0])
    found = []
    for info in pkgutil.iter_modules(models.__path__):
        folder = root / info.name
        config = folder / "config.py"
        if not info.ispkg or not config.is_file() or "class VisionConfig" not in config.read_text(encoding="utf-8"):
            continue
        if any(_builds_experts(f, root, set()) for f in folder.glob("*.py") if f.name != "config.py"):
            found.append(info.name)
    return tuple(sorted(found))


def _builds_experts(file, root, seen: set) -> bool:
    """Whether `file`, or a module of another model package it imports, builds stacked experts."""
    if file in seen or not file.is_file():
        return False
    seen.add(file)
    source = file.read_text(encoding="utf-8")
    if _MOE_SOURCE.search(source):
        return True
    for dots, name in _IMPORT.findall(source):
        if dots == ".." and not (root / name.partition(".")[0]).is_dir():
            continue  # a helper beside the packages (switch_layers, fast_ops), not a model
        target = (file.parent if dots == "." else root).joinpath(*name.split("."))
        if _builds_experts(target.with_suffix(".py"), root, seen) or _builds_experts(target / "__init__.py", root, seen):
            return True
    return False
