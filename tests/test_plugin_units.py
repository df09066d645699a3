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


def _scanned_cap(prompt_length, opened, start, end, answer, budget):
    """What the reasoning cap decides, by scanning the whole reply at every step: the
    definition the incremental cap must agree with (the next forced token, or None)."""

    def find(tokens, part):
        return next((i for i in range(len(tokens) - len(part) + 1) if tokens[i:i + len(part)] == part), None)

    close = [*end, *answer]

    def forced(history):
        reply = history[prompt_length:]
        at = 0 if opened else find(reply, start)
        if at is None:
            return None
        at += 0 if opened else len(start)
        ended, written = find(reply[at:], end), reply[at + budget:]
        if len(reply) - at < budget or (ended is not None and ended < budget) or find(written, close) is not None:
            return None
        return close[max(k for k in range(len(close)) if k == 0 or written[-k:] == close[:k])]

    return forced


@pytest.mark.parametrize("opened", [True, False])
def test_the_reasoning_cap_decides_as_a_scan_of_the_whole_reply_under_appends_and_speculative_passes(opened):
    """Histories as mlx-lm shows them (one token more each step) and as a speculative
    verify pass does (rows over the drafts, then the next pass from the accepted tokens
    with the corrected one): the incremental cap forces exactly what a scan of the whole
    reply forces, on random replies that open, end early, run over or close."""
    import random

    import mlx.core as mx

    from llm_mlx_streaming.processors import reasoning_cap

    START, END, ANSWER, budget = [7, 9], [8], [5, 6], 4
    prompt = [1, 2, 7]
    scan = _scanned_cap(len(prompt), opened, START, END, ANSWER, budget)
    rng, checked = random.Random(5), 0

    def pick(forced):  # the model's next token: the forced one, else a random one that may open or end
        return forced if forced is not None else rng.choice([4, 4, 4, 7, 9, 8, 5, 6, 3])

    def decided(cap, history):
        row = cap(mx.array(history), mx.zeros((1, 10)))[0].tolist()
        allowed = [i for i, v in enumerate(row) if v == 0]
        return allowed[0] if len(allowed) == 1 else None

    for trial in range(60):
        cap = reasoning_cap(len(prompt), opened, START, END, ANSWER, budget)
        history = list(prompt)
        while len(history) < len(prompt) + 24:
            if trial % 2:  # a verify pass over up to 3 drafts, some of them wrong
                drafts = [pick(None) for _ in range(rng.randrange(4))]
                rows = [history + drafts[:i] for i in range(len(drafts) + 1)]
                answers = [decided(cap, row) for row in rows]
                assert answers == [scan(row) for row in rows], repr((trial, [r[3:] for r in rows], answers))
                accepted = 0
                while accepted < len(drafts) and answers[accepted] in (None, drafts[accepted]) and rng.random() < 0.7:
                    accepted += 1
                history += drafts[:accepted] + [pick(answers[accepted])]
            else:
                forced = decided(cap, history)
                assert forced == scan(history), (trial, history)
                history.append(pick(forced))
            checked += 1
    assert checked > 500


def test_the_reasoning_cap_reads_nothing_back_before_its_budget_and_counts_what_it_reads():
    """A long reasoning under its budget costs the cap no read at all (it kept the reply
    as a list and scanned it every step); from the budget on it reads once a step,
    counted as a host synchronisation, and once the block is closed, never again."""
    import mlx.core as mx

    from llm_mlx_streaming import syncs
    from llm_mlx_streaming.processors import reasoning_cap

    END, ANSWER, budget, prompt = [8], [5, 6], 2000, [1, 2, 3]
    cap = reasoning_cap(len(prompt), True, [7], END, ANSWER, budget)
    history, logits, reads = mx.array(prompt), mx.zeros((1, 10)), []
    for step in range(budget + 6):
        before = syncs.count()
        row = cap(history, logits)
        reads.append(syncs.count() - before)
        allowed = [i for i, v in enumerate(row[0].tolist()) if v == 0]
        history = mx.concatenate([history, mx.array([allowed[0] if len(allowed) == 1 else 4])])
    assert sum(reads[:budget]) == 0
    assert reads[budget:budget + 4] == [1, 1, 1, 1] and sum(reads[budget + 4:]) == 0  # the last sees the close
    assert history[len(prompt) + budget:].tolist()[:3] == [*END, *ANSWER]
