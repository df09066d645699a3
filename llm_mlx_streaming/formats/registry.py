"""Which format a checkpoint's tool calls are in, and the tokenizer told about it.

mlx-lm infers a parser from the chat template (or `tool_parser_type` in the tokenizer
config) when it loads a tokenizer; that choice stands. Where it finds none, the formats
of ours are asked in turn, those in `PRECEDENCE` first and then the rest by name, from
the template's text and the vocabulary (never from the model's name): the first that
recognises the checkpoint is its format. The format found is set on mlx-lm's tokenizer wrapper (its tool markup,
parser and response format), so mlx-lm's own text state machine splits the reply.
"""

from __future__ import annotations

import functools
import importlib
import json
import pkgutil
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

from .tool_format import ToolFormat

NOT_FORMATS = {"tool_format", "reading", "forcing", "registry"}  # the modules of formats/ that are none
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
    return ToolFormat(name, f"mlx_lm.tool_parsers.{name}")


def find_format(tokenizer) -> Optional[ToolFormat]:
    """The format of a tokenizer mlx-lm loaded (`mlx_lm.utils.load_tokenizer`)."""
    inferred = (getattr(tokenizer, "init_kwargs", None) or {}).get("tool_parser_type")
    if inferred:
        return by_name(inferred)
    template = getattr(tokenizer, "chat_template", None)
    template = template if isinstance(template, str) else ""
    vocab = tokenizer.get_vocab()
    return next((f for f in formats() if f.detect is not None and f.detect(template, vocab)), None)


def install(tokenizer) -> Optional[ToolFormat]:
    """Find the tokenizer's format and give mlx-lm's wrapper its markup, parser and
    response format (what mlx-lm's own inference would have set, had it known it)."""
    fmt = find_format(tokenizer)
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
    return fmt


def format_of(tokenizer) -> Optional[ToolFormat]:
    """The format installed on a tokenizer, installed first where it was loaded
    elsewhere (a test's, a draft model's)."""
    try:
        return tokenizer.tool_format
    except AttributeError:
        return install(tokenizer)


def checkpoint_format(path) -> Optional[ToolFormat]:
    """The format of a checkpoint's tokenizer, read from its files (the template, the
    tokenizer config, the added tokens) without loading it: for `llm mlxs add/models`."""
    from mlx_lm.tokenizer_utils import _infer_tool_parser

    path = Path(path)
    config = _json(path / "tokenizer_config.json")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    if template is None and (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text(encoding="utf-8")
    vocab = {t["content"]: t["id"] for t in _json(path / "tokenizer.json").get("added_tokens", [])}
    view = SimpleNamespace(chat_template=template, get_vocab=lambda: vocab)
    view.init_kwargs = {"tool_parser_type": config.get("tool_parser_type") or _infer_tool_parser(view)}
    return find_format(view)


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
