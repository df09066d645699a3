"""MoE vision-language models stream their experts and still answer as stock mlx-vlm.

For every family of the matrix (fixtures/vision.py), greedy tokens for a prompt with one
generated PNG equal mlx-vlm's own `stream_generate` at a full pool, top-k slots and 2
slots; a second turn about the same image reuses the image's KV and equals the turn
uncached; another image behind the same placeholder tokens is never served from the
cache. Every MoE VLM module of the installed mlx-vlm is in the matrix or refused.
"""

from __future__ import annotations

import io
import json
from types import SimpleNamespace

import llm
import numpy as np
import pytest
from llm.parts import AttachmentPart, Message, TextPart

from fixtures.vision import TOP_K, VISION_ARCHITECTURES, build_vision_checkpoint
from llm_mlx_streaming.checkpoints.vision import UNSUPPORTED_VISION, vision_moe_modules
from llm_mlx_streaming.engine.manager import EngineManager
from llm_mlx_streaming.engine.request import LoadSpec, Request
from llm_mlx_streaming.prompt.vision import render_with_images
from llm_mlx_streaming.prompt.messages import PromptError, assistant_message

TOKENS = 8


def _png(seed: int) -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def _user(text: str, *images: bytes) -> Message:
    parts = [AttachmentPart(attachment=llm.Attachment(content=i)) for i in images]
    return Message(role="user", parts=[*parts, TextPart(text=text)])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("vision")
    return {arch: build_vision_checkpoint(root / arch, arch) for arch in VISION_ARCHITECTURES}


@pytest.fixture(scope="module")
def engine():
    return EngineManager()


def _run(engine, path, slots, messages, reset=False, thinking=None):
    load = LoadSpec(path, expert_slots=slots)
    tokenizer = engine.tokenizer_for(load).wait_started().started.tokenizer
    ids, _, vision = render_with_images(tokenizer, messages, thinking=thinking)
    if reset and engine.prompts is not None:
        engine.prompts.reset()
    generation = engine.run(load, Request(prompt=ids, max_tokens=TOKENS, vision=vision))
    list(generation)
    return generation, ids, tokenizer


def _stock(path, *pngs: bytes, prompt: str = "Describe the picture") -> list[int]:
    from PIL import Image
    from mlx_vlm import load
    from mlx_vlm.generate import stream_generate
    from mlx_vlm.prompt_utils import apply_chat_template

    model, processor = load(str(path))
    text = apply_chat_template(processor, model.config, prompt, num_images=len(pngs))
    responses = stream_generate(model, processor, text, image=[Image.open(io.BytesIO(p)) for p in pngs],
                                max_tokens=TOKENS, temperature=0.0)
    return [r.token for r in responses][:TOKENS]


@pytest.mark.parametrize("arch", VISION_ARCHITECTURES)
def test_greedy_tokens_equal_stock_mlx_vlm(checkpoints, engine, arch):
    path, png = checkpoints[arch], _png(0)
    expected = _stock(path, png)
    for slots in (None, TOP_K, 2):
        generation, _, _ = _run(engine, path, slots, [_user("Describe the picture", png)], reset=True)
        assert generation.tokens == expected, f"{arch}, {slots} slots"
        assert generation.stats["reused_tokens"] == 0
    assert sum(p.counters.misses for p in engine.loaded.pools) > 0


@pytest.mark.parametrize("arch", VISION_ARCHITECTURES)
def test_two_images_in_one_prompt_equal_stock_mlx_vlm(checkpoints, engine, arch):
    path, pictures = checkpoints[arch], (_png(3), _png(4))
    expected = _stock(path, *pictures, prompt="Compare the pictures")
    generation, _, _ = _run(engine, path, 2, [_user("Compare the pictures", *pictures)], reset=True)
    assert generation.tokens == expected


@pytest.mark.parametrize("arch", VISION_ARCHITECTURES)
def test_a_second_turn_reuses_the_image_and_another_image_is_not_reused(checkpoints, engine, arch):
    # thinking on: the template writes the earlier turn as its prompt had it (off, the
    # generation prompt's empty think block is not in the history, on every path)
    path, png = checkpoints[arch], _png(1)
    first, ids, tokenizer = _run(engine, path, 2, [_user("Describe the picture", png)], reset=True, thinking=True)
    reply = assistant_message(tokenizer.decode(first.tokens), tokens=first.tokens)
    turn = [_user("Describe the picture", png), reply, _user("And its colours?")]
    cached, ids2, _ = _run(engine, path, 2, turn, thinking=True)
    config = engine.loaded.model.vlm.config
    image_token = getattr(config, "image_token_index", None) or config.image_token_id  # gemma4: only the id
    # the image's KV and the reply's own ids reused: only the new question is prefilled
    assert cached.stats["reused_tokens"] == len(ids) + len(first.tokens)
    assert ids2[:len(ids) + len(first.tokens)] == ids + first.tokens
    uncached, _, _ = _run(engine, path, 2, turn, reset=True, thinking=True)
    assert uncached.stats["reused_tokens"] == 0
    assert cached.tokens == uncached.tokens

    other = [_user("Describe the picture", _png(2)), reply, _user("And its colours?")]
    swapped, ids3, _ = _run(engine, path, 2, other, thinking=True)  # same placeholders, another picture
    first_image = ids3.index(image_token)
    assert swapped.stats["reused_tokens"] <= first_image
    fresh, _, _ = _run(engine, path, 2, other, reset=True, thinking=True)
    assert swapped.tokens == fresh.tokens


def test_a_text_only_model_refuses_an_image_in_one_line(build):
    from mlx_lm import load

    from llm_mlx_streaming.reply.build import Ask, prepare

    _, tokenizer = load(str(build("qwen3_moe")))
    options = SimpleNamespace(tool_choice=None, thinking=None, reasoning_effort=None, thinking_budget=None, parallel_tool_calls=None)
    ask = Ask(model="small", messages=[_user("What is this?", _png(0))], options=options)
    with pytest.raises(PromptError) as e:
        prepare(tokenizer, SimpleNamespace(name="small", repetition_penalty=1.0), ask, None)
    assert str(e.value) == "small takes no images: it is a text-only model"


def test_a_corrupt_image_or_another_type_is_one_line(checkpoints, engine):
    load = LoadSpec(checkpoints["qwen3_vl_moe"])
    tokenizer = engine.tokenizer_for(load).wait_started().started.tokenizer
    with pytest.raises(PromptError) as e:
        render_with_images(tokenizer, [_user("What is this?", b"\x89PNG\r\n\x1a\nbroken")])
    assert "image 1" in str(e.value) and "\n" not in str(e.value)
    text = Message(role="user", parts=[AttachmentPart(attachment=llm.Attachment(content=b"plain words",
                                                                                  type="text/plain"))])
    with pytest.raises(PromptError, match="attachment 1 is text/plain, not an image"):
        render_with_images(tokenizer, [text])


def test_every_moe_vlm_module_is_in_the_matrix_or_refused_with_a_reason():
    found, matrix = set(vision_moe_modules()), set(VISION_ARCHITECTURES)
    assert not matrix & set(UNSUPPORTED_VISION), "a module is both in the matrix and refused"
    unclassified = found - matrix - set(UNSUPPORTED_VISION)
    assert not unclassified, f"classify these MoE VLM modules of mlx-vlm: {sorted(unclassified)}"
    assert set(UNSUPPORTED_VISION) <= found
    assert all(reason for reason in UNSUPPORTED_VISION.values())
    assert len(set(UNSUPPORTED_VISION.values())) == len(UNSUPPORTED_VISION), "each module its own reason"
    assert not {"hunyuan_vl", "qwen3_5"} & found  # dense: experts only named in their configs


def test_the_architecture_doc_lists_the_matrix_and_every_refusal():
    from pathlib import Path

    doc = (Path(__file__).parents[1] / "docs" / "architecture.md").read_text()
    section = doc[doc.index("## Vision-language models"):]
    section = section[:section.index("\n## ", 1)]
    for arch in VISION_ARCHITECTURES:
        assert f"`{arch}`" in section, arch
    for name, reason in UNSUPPORTED_VISION.items():
        assert f"| `{name}` | {reason} |" in section, name


def test_without_mlx_vlm_a_vision_checkpoint_is_one_line(checkpoints, monkeypatch):
    import sys

    from llm_mlx_streaming.checkpoints.config import check_checkpoint
    from llm_mlx_streaming.errors import CheckpointError

    monkeypatch.setitem(sys.modules, "mlx_vlm.utils", None)
    with pytest.raises(CheckpointError, match=r"pip install 'llm-mlx-streaming\[vision\]'"):
        check_checkpoint(checkpoints["qwen3_vl_moe"])


def test_a_packed_vision_checkpoint_answers_as_its_safetensors(checkpoints, engine, tmp_path):
    import shutil

    from llm_mlx_streaming.checkpoints.packing import pack_checkpoint, verify_packed

    path = tmp_path / "packed"
    shutil.copytree(checkpoints["qwen3_vl_moe"], path)
    pack_checkpoint(path)  # `llm mlxs pack`: the language model's experts, found as the engine finds them
    assert verify_packed(path) == []
    messages = [_user("Describe the picture", _png(5))]
    plain, _, _ = _run(engine, checkpoints["qwen3_vl_moe"], 2, messages, reset=True)
    packed, _, _ = _run(engine, path, 2, messages, reset=True)
    assert engine.loaded.store.packed is not None
    assert packed.tokens == plain.tokens


def test_a_text_only_conversion_that_kept_its_vision_config_runs_on_mlx_lm(checkpoints, engine, tmp_path):
    """A checkpoint converted by mlx-lm keeps config.json's vision_config but has no vision
    tower: it runs as a text model (mlx-lm's), equal to stock mlx-lm, and takes no images."""
    import shutil

    from mlx_lm.utils import load_model
    from safetensors.numpy import load_file, save_file

    from exactness import greedy_tokens
    from llm_mlx_streaming.checkpoints.config import read_config
    from llm_mlx_streaming.checkpoints.vision import takes_images

    path = tmp_path / "text-only"
    shutil.copytree(checkpoints["qwen3_vl_moe"], path)
    (path / "model.safetensors.index.json").unlink()
    weights = load_file(path / "model.safetensors")
    save_file({k: v for k, v in weights.items() if k.startswith("language_model.")}, path / "model.safetensors")
    config = json.loads((path / "config.json").read_text())
    config["text_config"].setdefault("norm_topk_prob", True)  # what mlx-lm's qwen3_moe arguments need
    (path / "config.json").write_text(json.dumps(config))
    assert "vision_config" in config
    assert not takes_images(read_config(path)) and takes_images(read_config(checkpoints["qwen3_vl_moe"]))

    prompt = [5, 17, 42, 8, 99, 3, 61, 27]
    expected = greedy_tokens(load_model(path)[0], prompt, TOKENS)
    generation = engine.run(LoadSpec(path, expert_slots=2), Request(prompt=prompt, max_tokens=TOKENS))
    list(generation)
    assert not engine.loaded.takes_images
    assert generation.tokens == expected
