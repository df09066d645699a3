"""For the tool-call format tests (tests/test_format_*.py): a small tokenizer with a
family's tokens, a reply fed through the reply's split and call reader the way the
reply core feeds them, and a forced-call grammar's matcher."""

from __future__ import annotations

import json
from pathlib import Path


def family_tokenizer(directory: Path, special=(), added=(), eos=(), template=None, config=None):
    """mlx-lm's tokenizer of the tiny test BPE whose only added tokens are the family's,
    `special` (a decode that skips special tokens drops them) and `added`, loaded as the
    engine loads one (mlx-lm's loader, then the format found installed); `eos` the
    tokens a turn ends at (the first is the tokenizer's eos_token, all are
    generation_config.json's eos_token_id)."""
    from mlx_lm.tokenizer_utils import load

    from llm_mlx_streaming.formats.registry import install

    from fixtures.tokenizer import tokenizer_json

    data = json.loads(tokenizer_json("tiny"))
    first = len(data["model"]["vocab"])
    tokens = [(t, True) for t in special] + [(t, False) for t in added]
    data["added_tokens"] = [{"id": first + i, "content": token, "single_word": False, "lstrip": False,
                             "rstrip": False, "normalized": False, "special": is_special}
                            for i, (token, is_special) in enumerate(tokens)]
    (directory / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos[0] if eos else None,
                "bos_token": None, "pad_token": None, "unk_token": None, "add_prefix_space": False,
                "clean_up_tokenization_spaces": False, **(config or {})}
    if template is not None:
        settings["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(settings, ensure_ascii=False), encoding="utf-8")
    ids = [first + [t for t, _ in tokens].index(token) for token in eos]
    tokenizer = load(directory, eos_token_ids=ids)
    install(tokenizer)
    return tokenizer


def replay(tokenizer, pieces, tools, generation_prompt: str = "") -> dict:
    """A reply, streamed in `pieces` and ended by the model's end-of-turn token, as the
    reply core reads it (reply/core.py's Replier): its text, its reasoning, and for
    each call its name, its arguments' pieces joined, and the arguments it parsed to."""
    from llm_mlx_streaming.prompt.split import TOOL, TOOL_TEXT, UNFINISHED_TOOL, ReplySplitter, initial_state
    from llm_mlx_streaming.prompt.tools import CallReader

    splitter = ReplySplitter(tokenizer, initial_state(tokenizer, generation_prompt))
    reader = CallReader(tokenizer, tools)
    out = {"text": "", "reasoning": "", "names": [], "streamed": {}, "calls": []}

    def take(kind, chunk):
        if kind == TOOL_TEXT:
            events = reader.piece(chunk)
        elif kind in (TOOL, UNFINISHED_TOOL):  # the end-of-turn token closes an open block
            closed = reader.close(chunk)
            if closed is None:
                out["text"] += tokenizer.tool_call_start + chunk
                return
            events, calls = closed
            out["calls"] += [(c["name"], c["arguments"]) for c in calls]
        else:
            out["text" if kind == "text" else "reasoning"] += chunk
            return
        for event, call_id, value in events:
            if event == "name":
                out["names"].append(value)
                out["streamed"][call_id] = ""
            else:
                out["streamed"][call_id] += value

    for piece in pieces:
        for kind, chunk in splitter.feed(piece):
            take(kind, chunk)
    for kind, chunk in splitter.flush():
        take(kind, chunk)
    out["streamed"] = [json.loads(text) for text in out["streamed"].values()]
    return out


def cuts(text: str):
    """The ways a test streams a reply: in one-character pieces, and in two pieces cut at
    each position."""
    yield list(text)
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]


def matcher(tokenizer, grammar: str):
    """llguidance's matcher of `grammar` over the tokenizer, ending at its end-of-turn
    tokens (as prompt/constrained.py builds it)."""
    import llguidance
    import llguidance.hf

    hf = tokenizer._tokenizer
    ll = llguidance.hf.from_tokenizer(hf, n_vocab=len(hf), eos_token=sorted(tokenizer.eos_token_ids))
    return llguidance.LLMatcher(ll, grammar, log_level=0)


def forced_accepts(tokenizer, grammar: str, text: str) -> bool:
    """Whether the forced-call grammar lets the model write `text` (its tokens as the
    tokenizer encodes it) and then end its turn."""
    m = matcher(tokenizer, grammar)
    return m.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and m.is_accepting()
