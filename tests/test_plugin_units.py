"""Fast checks of the plugin's pieces that need no engine."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from llm_mlx_streaming.prompt.split import ReplySplitter, opens_thinking
from plugin_support import tagged_tokenizer


def _run(splitter, segments):
    out = []
    for seg in segments:
        out += splitter.feed(seg)
    out += splitter.flush()
    merged = []
    for kind, chunk in out:
        if merged and merged[-1][0] == kind:
            merged[-1] = (kind, merged[-1][1] + chunk)
        else:
            merged.append((kind, chunk))
    return merged


@pytest.mark.parametrize("cut", range(1, 30))
def test_reply_splitter_handles_tags_split_anywhere(cut):
    text = "<think>plan it</think>\n\nThe answer <b>ok"
    got = _run(ReplySplitter(tagged_tokenizer()), [text[:cut], text[cut:]])
    assert got == [("reasoning", "plan it"), ("text", "\n\nThe answer <b>ok")]


def test_reply_splitter_modes():
    assert _run(ReplySplitter(tagged_tokenizer(think=False)), ["<think>x</think>y"]) == [("text", "<think>x</think>y")]
    assert _run(ReplySplitter(tagged_tokenizer(), "reasoning"), ["a</th", "ink>b"]) == [
        ("reasoning", "a"), ("text", "b"),
    ]
    assert _run(ReplySplitter(tagged_tokenizer()), ["x <thi"]) == [("text", "x <thi")]
    assert opens_thinking("<|im_start|>assistant\n<think>\n", "<think>", "</think>")
    assert not opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n", "<think>", "</think>")
    assert not opens_thinking("<|im_start|>assistant\n", "<think>", "</think>")


def test_settings_roundtrip(tmp_path, monkeypatch):
    from llm_mlx_streaming.options import settings as s

    monkeypatch.setenv("LLM_USER_PATH", str(tmp_path))
    assert s.load_settings() == s.Settings()
    s.set_value("expert_slots", "6")
    assert json.loads((tmp_path / s.SETTINGS_FILENAME).read_text()) == {"expert_slots": 6}
    assert s.explicit_keys() == {"expert_slots"}
    s.unset_value("expert_slots")
    assert s.explicit_keys() == set()
    with pytest.raises(s.SettingsError, match="Invalid value for max_tokens"):
        s.set_value("max_tokens", "-3")


def test_llm_help_does_not_import_mlx():
    """Every llm command imports plugins: importing ours must stay light."""
    code = (
        "import sys, llm; llm.get_plugins(); from llm.cli import cli; "
        "print(sorted(m for m in ('mlx', 'mlx_lm', 'mlx.core', 'llm_mlx_streaming.engine.manager') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_reasoning_cap_closes_the_think_block_at_its_budget():
    import mlx.core as mx

    from llm_mlx_streaming.processors import reasoning_cap

    START, END, prompt = 7, 8, [1, 2, 3]
    logits = mx.zeros((1, 10))

    def forced(reply, opened):
        out = reasoning_cap(len(prompt), opened, [START], [END], [], budget=2)(mx.array(prompt + reply), logits)
        return out[0].tolist()[END] == 0 and out[0].tolist()[0] == -float("inf")

    assert [forced(r, True) for r in ([], [4], [4, 5], [4, 5, 6])] == [False, False, True, True]
    assert not forced([4, 5, END, 6, 6], True)  # closed already: nothing to do
    assert [forced(r, False) for r in ([4, 5, 6], [4, START, 5], [4, START, 5, 6])] == [False, False, True]


def test_the_reasoning_cap_writes_a_closing_sequence_after_a_multi_token_opening():
    """Harmony's shape: the block opens at a sequence, and closing it is the end tag and
    then the answer's header, forced one token a step."""
    import mlx.core as mx

    from llm_mlx_streaming.processors import reasoning_cap

    START, END, ANSWER, prompt = [7, 9], [8], [5, 6], [1, 2]
    cap = reasoning_cap(len(prompt), False, START, END, ANSWER, budget=3)

    def forced(reply):
        row = cap(mx.array(prompt + reply), mx.zeros((1, 10)))[0].tolist()
        allowed = [i for i, v in enumerate(row) if v == 0]
        return allowed[0] if len(allowed) == 1 else None

    thought = [*START, 4, 4, 4]
    assert [forced(r) for r in ([7], [*START, 4, 4], thought)] == [None, None, 8]
    assert [forced(thought + [8]), forced(thought + [8, 5]), forced(thought + [8, 5, 6])] == [5, 6, None]
    assert forced([*START, 4, 8, 4, 4, 4]) is None  # it ended within its budget: left alone
    assert forced([7, 4, 4, 4, 4]) is None  # the opening is the whole sequence, not its first token
