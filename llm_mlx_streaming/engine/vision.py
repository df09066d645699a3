"""A vision-language model, run by the engine as it runs a text model.

mlx-vlm builds the model (lazily, like mlx-lm's text models: the loader streams its
language model's experts); `VisionLanguage` gives it the call mlx-lm's generation makes,
`model(tokens, cache=..., input_embeddings=...)`. A prompt is turned into embeddings by
mlx-vlm's own `get_input_embeddings` (the vision tower's features put in the image
tokens' places) together with the arrays its language model reads beside them
(multimodal rotary positions, deepstack features, ...); those arrays span the whole
prompt, and the language model cuts them at its cache's offset, so a prompt whose
prefix is already cached is fed only its new tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ..checkpoints.vision import load_lazily
from .request import VisionInput


@dataclass(frozen=True)
class Vision:
    """What renders a prompt with images (prompt/images.py): the model's processor and
    its config as mlx-vlm completed it. The loaded tokenizer carries it as `vision`."""

    processor: object
    config: dict


class _PromptArrays:
    """The arrays the language model reads beside the current prompt's embeddings
    (kept off the module's parameters)."""

    def __init__(self):
        self.arrays: dict = {}


class VisionLanguage(nn.Module):
    """mlx-vlm's model behind mlx-lm's model call. The prompt's extra arrays go with the
    calls that feed prompt embeddings; decode steps pass none (as mlx-vlm's own loop)."""

    def __init__(self, vlm: nn.Module):
        super().__init__()
        self.vlm = vlm
        self._prompt = _PromptArrays()

    @property
    def layers(self):
        return self.vlm.language_model.layers

    def make_cache(self) -> list:
        from mlx_vlm.models.cache import make_prompt_cache

        return make_prompt_cache(self.vlm.language_model)

    def __call__(self, inputs: mx.array, cache=None, input_embeddings: mx.array | None = None):
        extra = self._prompt.arrays if input_embeddings is not None else {}
        out = self.vlm.language_model(inputs, inputs_embeds=input_embeddings, cache=cache, **extra)
        return out.logits

    def embed(self, prompt: list[int], vision: VisionInput | None) -> mx.array:
        """The embeddings of the whole `prompt` (L, D), its images' features in their
        tokens' places; the arrays the language model reads beside them are kept for
        the prompt's calls."""
        ids = mx.array(prompt)[None]
        pixels, extra = (vision.pixel_values, dict(vision.arrays)) if vision else (None, {})
        features = self.vlm.get_input_embeddings(ids, pixels, mask=mx.ones(ids.shape, mx.int32), **extra)
        arrays = {k: v for k, v in features.to_dict().items() if k != "inputs_embeds" and v is not None}
        self._prompt.arrays = {**extra, **arrays}
        return features.inputs_embeds[0]


def load_vision_model(path: Path, config: dict):
    """(mlx-vlm's model of the checkpoint at `path`, built lazily: no tensor read, its
    config as mlx-vlm completed it, its processor)."""
    model = load_lazily(path, config)
    from mlx_vlm.utils import load_image_processor, load_processor

    processor = load_processor(path, True, eos_token_ids=getattr(model.config, "eos_token_id", None))
    image_processor = load_image_processor(path)
    if image_processor is not None:
        processor.image_processor = image_processor
    return model, processor
