"""Speculative decoding: drafters, the verify forward, and exactness against k=0."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model

from llm_mlx_streaming.speculation import heads
from llm_mlx_streaming.speculation.drafter import DraftContext, DraftError, make_drafter


@pytest.mark.parametrize("arch,kwargs", [
    ("qwen3_moe", {}),                                  # lm_head
    ("qwen3_moe", {"tie_word_embeddings": True}),       # tied embedding as the head
    ("deepseek_v3", {}),
])
def test_forward_with_hidden_gives_the_models_own_logits(build, arch, kwargs):
    path = build(arch, **kwargs)
    model, config = load_model(path)
    inputs = mx.array([[1, 5, 9, 2]])
    want = model(inputs, cache=make_prompt_cache(model))
    logits, hidden = heads.forward(model, inputs, make_prompt_cache(model), want_hidden=True)
    assert hidden.shape == (1, 4, config["hidden_size"])
    assert np.array_equal(np.array(logits), np.array(want))
    plain, none = heads.forward(model, inputs, make_prompt_cache(model))
    assert none is None and np.array_equal(np.array(plain), np.array(want))


def test_unknown_draft_name_is_one_line(build):
    model, _ = load_model(build("qwen3_moe"))
    with pytest.raises(DraftError, match="unknown draft 'nosuch'") as info:
        make_drafter("nosuch", DraftContext(model=model, tokenizer=None))
    assert "\n" not in str(info.value)
