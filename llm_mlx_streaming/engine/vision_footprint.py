"""What a vision-language checkpoint adds to a memory plan, from its files alone.

Its vision tower and projector (every tensor outside the language model) are resident
beside the dense weights; a prompt's image becomes tokens the language model caches
like text. The planner counts the first exactly and reserves KV room for one image of
the processor's default size, estimated from preprocessor_config.json and the vision
config the way mlx-vlm's processors cut an image into patches.
"""

from __future__ import annotations

import json
import math
from pathlib import Path


DEFAULT_IMAGE_SIDE = 1024  # the side of a typical image, for processors that keep an image's own size
PROCESSOR_FILE = "preprocessor_config.json"


def typical_image_tokens(path: Path, config: dict) -> tuple[int, str]:
    """(tokens, how they were counted) of one square image at the processor's default size.

    A processor with a fixed size (`size.height`, the vision config's `image_size`)
    resizes every image to it; one that keeps an image's own size (Qwen2-VL's and its
    kin, bounded by `min_pixels`/`max_pixels`) is given a DEFAULT_IMAGE_SIDE image,
    clamped to its bounds. The side is cut into patches, and `merge` x `merge` patches
    become one token (`merge_size`, `spatial_merge_size`, `merge_kernel_size`, or
    1 / `pixel_shuffle_ratio`).
    """
    processor = _processor_config(path)
    vision = config.get("vision_config") or {}
    patch = int(processor.get("patch_size") or vision.get("patch_size") or 14)
    merge = _merge(processor, vision)
    side, source = _side(processor, vision)
    per_side = max(1, math.ceil(side / (patch * merge)))
    tokens = per_side * per_side
    return tokens, f"one {side}x{side} image ({source}), {patch}-pixel patches merged {merge}x{merge}"


def _processor_config(path: Path) -> dict:
    try:
        config = json.loads((path / PROCESSOR_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def _merge(processor: dict, vision: dict) -> int:
    for value in (processor.get("merge_size"), vision.get("spatial_merge_size"),
                  processor.get("merge_kernel_size"), vision.get("merge_kernel_size")):
        if isinstance(value, list) and value:
            value = value[0]
        if value:
            return int(value)
    ratio = vision.get("pixel_shuffle_ratio")
    return max(1, round(1 / float(ratio))) if ratio else 1


def _side(processor: dict, vision: dict) -> tuple[int, str]:
    """The side of the typical image, and where it comes from."""
    size = processor.get("size") if isinstance(processor.get("size"), dict) else {}
    # Qwen2-VL's kin give pixel counts, as min/max_pixels or as size's shortest/longest_edge.
    if {"min_pixels", "max_pixels"} & set(processor) or ("merge_size" in processor and "longest_edge" in size):
        low = int(processor.get("min_pixels") or size.get("shortest_edge") or 0)
        high = int(processor.get("max_pixels") or size.get("longest_edge") or DEFAULT_IMAGE_SIDE ** 2)
        pixels = min(max(DEFAULT_IMAGE_SIDE ** 2, low), high)
        return math.isqrt(pixels), "the processor keeps an image's size, within its pixel bounds"
    fixed = size.get("height") or processor.get("image_size") or vision.get("image_size")
    if fixed:
        return int(fixed), "the processor's size"
    return DEFAULT_IMAGE_SIDE, "the processor keeps an image's size"
