"""A prompt with images rendered for a vision-language model: llm's image attachments -> the
model's chat template with the images in their messages, and its processor's token
ids and pixel inputs (mlx-vlm's `apply_chat_template` and `prepare_inputs`, as mlx-vlm's
own generation renders a prompt)."""

from __future__ import annotations

import hashlib
from typing import Optional

from ..engine.request import VisionInput
from ..errors import one_line
from .messages import TOKENS, PromptError, shown, template_messages
from .render import encode_text, template_switches, with_stored_replies


def has_images(messages) -> bool:
    from llm.parts import AttachmentPart

    return any(isinstance(part, AttachmentPart) for m in messages for part in m.parts)


def render_with_images(tokenizer, messages, *, thinking: Optional[bool] = None, effort: Optional[str] = None
                       ) -> tuple[list[int], str, VisionInput]:
    """(token ids, the generation prompt's text, the images' pixel inputs) for a
    conversation with images, rendered with the processor and model config that
    `tokenizer.vision` carries (engine/vision.py); an image that cannot be read is one
    PromptError line."""
    import mlx.core as mx
    from mlx_vlm.prompt_utils import apply_chat_template, get_message_json
    from mlx_vlm.utils import prepare_inputs, should_add_special_tokens

    processor, config = tokenizer.vision.processor, tokenizer.vision.config
    attached: list = []
    dicts = template_messages(messages, getattr(tokenizer, "think_start", None),
                              getattr(tokenizer, "think_end", None), images=attached)
    pictures, digests = zip(*(_picture(i + 1, a) for i, a in enumerate(attached)))
    switches = template_switches(tokenizer, thinking, effort)
    model_type = config["model_type"]
    # each message with images in the model's own format: where its images go, how many
    dicts = [get_message_json(model_type, d["content"], d["role"], num_images=d.pop("images"))
             if "images" in d else d for d in dicts]

    def render(generation: bool, msgs: Optional[list] = None) -> str:
        return apply_chat_template(processor, config, shown(dicts if msgs is None else msgs),
                                   add_generation_prompt=generation, num_images=len(pictures), **switches)

    text, head = render(True), render(False)
    try:
        inputs = prepare_inputs(processor, images=list(pictures), prompts=text,
                                image_token_index=config.get("image_token_index"),
                                add_special_tokens=should_add_special_tokens(model_type, processor))
    except Exception as e:  # the processor's own error, whatever its type
        raise PromptError(f"the {model_type} processor cannot take these images: {one_line(e)}") from None
    arrays = {k: v for k, v in inputs.items() if k not in ("input_ids", "pixel_values", "attention_mask")}
    # A processor may hand back its arrays unevaluated (kimi_k25's patches): evaluated here,
    # on the thread whose streams built them, as the engine thread lacks those streams.
    mx.eval([v for v in (inputs.get("pixel_values"), *arrays.values()) if isinstance(v, mx.array)])
    tokens = [int(t) for t in inputs["input_ids"][0].tolist()]
    if any(TOKENS in d for d in dicts) and not any(len(tokens) in getattr(v, "shape", ()) for v in arrays.values()):
        replies = with_stored_replies(tokenizer, lambda msgs: render(True, msgs), dicts, text)
        if replies is not None:
            tokens = _both_edits(encode_text(tokenizer, text), tokens, replies) or tokens
    generation_prompt = text[len(head):] if text.startswith(head) else ""
    return tokens, generation_prompt, VisionInput(inputs.get("pixel_values"), arrays, tuple(digests))


def _both_edits(plain: list[int], expanded: list[int], spliced: list[int]) -> Optional[list[int]]:
    """`plain` (the text's ids) with both the processor's edits (`expanded`: each image's
    placeholder grown into its image tokens) and the stored replies' (`spliced`: each
    earlier reply's own ids): the next turn then reuses the whole conversation's KV, as
    text prompts do. None when the two edit the same place."""
    from difflib import SequenceMatcher

    def edits(other: list[int]) -> dict[int, tuple[int, list[int]]]:
        found = SequenceMatcher(None, plain, other, autojunk=False).get_opcodes()
        return {i1: (i2, other[j1:j2]) for op, i1, i2, j1, j2 in found if op != "equal"}

    images, replies = edits(expanded), edits(spliced)
    spans = sorted([(i, end) for i, (end, _) in images.items()] + [(i, end) for i, (end, _) in replies.items()])
    if any(a_end > b or (a == b) for (a, a_end), (b, _) in zip(spans, spans[1:])):
        return None
    out, i = [], 0
    while i <= len(plain):
        edit = images.get(i) or replies.get(i)
        if edit is not None:
            end, ids = edit
            out.extend(ids)
            if end > i:
                i = end
                continue
        if i < len(plain):
            out.append(plain[i])
        i += 1
    return out


def _picture(number: int, attachment):
    """(PIL image, sha256 of its bytes) of an attachment; one PromptError line when it is
    not an image or cannot be decoded."""
    from PIL import Image, UnidentifiedImageError
    import io

    try:
        kind = attachment.resolve_type() or ""
        data = attachment.content_bytes()
    except Exception as e:  # a missing file, a URL that cannot be fetched
        raise PromptError(f"image {number} cannot be read: {one_line(e)}") from None
    if not kind.startswith("image/"):
        raise PromptError(f"attachment {number} is {kind or 'of unknown type'}, not an image")
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise PromptError(f"image {number} ({kind}) cannot be decoded: {one_line(e)}") from None
    return image.convert("RGB"), hashlib.sha256(data).hexdigest()
