"""Which format a checkpoint's tool calls are in, and the tokenizer told about it.

A parser the tokenizer config names (`tool_parser_type`) stands. Otherwise the formats of
ours are asked in turn, those in `PRECEDENCE` first and then the rest by name, from the
template's text and the vocabulary (never from the model's name): the first that
recognises the checkpoint is its format. Where none does, mlx-lm's inference from the
template stands (the parser it infers when it loads a tokenizer); where it infers none,
the format is learned from the template (learning.py), or, where learning cannot tell,
there is none and the reason is one line (`Finding.note`). The format found is set on
mlx-lm's tokenizer wrapper (its tool markup, parser and response format, and a learned
format's reasoning where mlx-lm found none), so mlx-lm's own text state machine splits
the reply.
"""

from __future__ import annotations

import functools
import importlib
import json
import pkgutil
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

from .learned import learned_format
from .learning import learn
from .tool_format import ReasoningMarks, ToolFormat

# the modules of formats/ that are no format
NOT_FORMATS = {"tool_format", "reading", "forcing", "registry", "learned", "learning"}
SPECIAL = ("bos_token", "eos_token", "pad_token", "unk_token")  # the tokens a template may read
# Formats asked before the others, in this order, where one checkpoint can look like two:
# DeepSeek-V3.2's vocabulary keeps V3.1's tool-call tags beside its DSML token.
PRECEDENCE = ("deepseek_v32", "deepseek_v31")


@functools.lru_cache(maxsize=None)
def formats() -> tuple[ToolFormat, ...]:
    """Ours, one module each (its FORMAT), found in this package: where mlx-lm has a
    parser, what it lacks (streaming, forcing, a detection); where it has none, the
    parser too. A new format is its module and nothing else. In the order they are
    asked: `PRECEDENCE`, then by name."""
    package = Path(__file__).parent
    found = {m.name for m in pkgutil.iter_modules([str(package)]) if m.name not in NOT_FORMATS}
    names = [*(name for name in PRECEDENCE if name in found), *sorted(found - set(PRECEDENCE))]
    return tuple(importlib.import_module(f"{__package__}.{name}").FORMAT for name in names)


def by_name(name: str) -> ToolFormat:
    """A format by its name: ours, or mlx-lm's parser module of that name as it is."""
    for fmt in formats():
        if fmt.name == name:
            return fmt
    return ToolFormat(name, f"mlx_lm.tool_parsers.{name}", origin="mlx-lm")


@dataclass(frozen=True)
class Finding:
    """A checkpoint's format (None: it has none) and, where learning could not tell,
    why, in one line."""

    format: Optional[ToolFormat]
    note: str = ""


def find(tokenizer, named: Optional[str] = None) -> Finding:
    """The format of a tokenizer (mlx-lm's wrapper, or a view of a checkpoint's files
    with the same fields: `chat_template`, `get_vocab()`, `init_kwargs` and the special
    tokens). `named`: the parser the tokenizer config names, where known apart from
    mlx-lm's inference (which mlx-lm writes into `init_kwargs` when it loads one)."""
    from mlx_lm.tokenizer_utils import _infer_tool_parser

    inferred = (getattr(tokenizer, "init_kwargs", None) or {}).get("tool_parser_type")
    if named is None and inferred and inferred != _infer_tool_parser(tokenizer):
        named = inferred
    if named:
        return Finding(by_name(named))
    template = getattr(tokenizer, "chat_template", None)
    template = template if isinstance(template, str) else ""
    vocab = tokenizer.get_vocab()
    ours = next((f for f in formats() if f.detect is not None and f.detect(template, vocab)), None)
    if ours is not None or inferred:
        return Finding(ours or by_name(inferred))
    learning = _learn(template, tuple((name, _token(getattr(tokenizer, name, None))) for name in SPECIAL))
    return Finding(learned_format(learning.learned) if learning.learned else None, learning.note)


@functools.lru_cache(maxsize=64)
def _learn(template: str, special: tuple):
    return learn(template, {name: token for name, token in special if token})


def _token(value) -> Optional[str]:
    """A special token as a tokenizer config or a tokenizer gives it (text, or a dict
    with its content)."""
    value = value.get("content") if isinstance(value, dict) else value
    return value if isinstance(value, str) else None


def find_format(tokenizer) -> Optional[ToolFormat]:
    """The format of a tokenizer mlx-lm loaded (`mlx_lm.utils.load_tokenizer`)."""
    return find(tokenizer).format


def install(tokenizer) -> Optional[ToolFormat]:
    """Find the tokenizer's format and set it on mlx-lm's wrapper (`set_format`)."""
    return set_format(tokenizer, find_format(tokenizer))


def set_format(tokenizer, fmt: Optional[ToolFormat]) -> Optional[ToolFormat]:
    """Give mlx-lm's wrapper a format's markup, parser and response format (what mlx-lm's
    own inference would have set, had it known it), and a learned format's reasoning
    where mlx-lm found none."""
    tokenizer.tool_format = fmt
    if fmt is None:
        return None
    module = fmt.module
    encode = lambda tag: tuple(tokenizer.encode(tag, add_special_tokens=False)) if tag else None  # noqa: E731
    tokenizer._tool_parser = module.parse_tool_call
    tokenizer._tool_call_start, tokenizer._tool_call_end = module.tool_call_start, module.tool_call_end
    tokenizer._tool_call_start_tokens = encode(module.tool_call_start)
    tokenizer._tool_call_end_tokens = encode(module.tool_call_end)
    if fmt.response_format is not None and not tokenizer.response_transitions:
        tokenizer._response_format = fmt.response_format
    if fmt.origin == "learned" and fmt.reasoning is not None and not tokenizer.has_thinking:
        tokenizer._think_start, tokenizer._think_end = fmt.reasoning.start, fmt.reasoning.end
        tokenizer._think_start_tokens, tokenizer._think_end_tokens = encode(fmt.reasoning.start), encode(fmt.reasoning.end)
    return fmt


def format_of(tokenizer) -> Optional[ToolFormat]:
    """The format installed on a tokenizer, installed first where it was loaded
    elsewhere (a test's, a draft model's)."""
    try:
        return tokenizer.tool_format
    except AttributeError:
        return install(tokenizer)


def checkpoint_format(path) -> Optional[ToolFormat]:
    """The format of a checkpoint's tokenizer, read from its files without loading it."""
    return checkpoint_finding(path).format


def checkpoint_finding(path) -> Finding:
    """What `find` finds of a checkpoint's tokenizer, read from its files (the template,
    the tokenizer config, the added tokens) without loading it: for `llm mlxs add/models`."""
    from mlx_lm.tokenizer_utils import _infer_tool_parser

    view = _view(Path(path))
    view.init_kwargs = {"tool_parser_type": _infer_tool_parser(view)}
    return find(view, named=view.config.get("tool_parser_type"))


def checkpoint_reasoning(path, fmt: Optional[ToolFormat]) -> Optional[ReasoningMarks]:
    """Where a checkpoint's model reasons: mlx-lm's think tags (inferred from its
    vocabulary), else its format's reasoning (harmony's channel, a learned format's)."""
    from mlx_lm.tokenizer_utils import _infer_thinking

    view = _view(Path(path))
    view.encode = lambda text, add_special_tokens=False: ()
    start, end, _, _ = _infer_thinking(view)
    if start and end:
        return ReasoningMarks(start, end)
    return fmt.reasoning if fmt is not None else None


def _view(path: Path) -> SimpleNamespace:
    """A checkpoint's tokenizer as its files give it: the fields `find` reads."""
    config = _json(path / "tokenizer_config.json")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    if template is None and (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text(encoding="utf-8")
    vocab = {t["content"]: t["id"] for t in _json(path / "tokenizer.json").get("added_tokens", [])}
    return SimpleNamespace(chat_template=template, get_vocab=lambda: vocab, config=config,
                           **{name: config.get(name) for name in SPECIAL})


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
