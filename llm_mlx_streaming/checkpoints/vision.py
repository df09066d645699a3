"""Which checkpoints take images: a vision-language model's config carries its vision
tower's settings beside the language model's."""

from __future__ import annotations


def takes_images(config: dict) -> bool:
    """Whether `config` (a checkpoint's config.json) is a vision-language model's."""
    return isinstance(config.get("vision_config"), dict)
