"""Helpers for the llm plugin tests: run llm's CLI in-process, read logs.db."""

from __future__ import annotations

import json
import sqlite3
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

from click.testing import CliRunner


class LlmEnv:
    def __init__(self, user_dir: Path, checkpoint: Path):
        self.user_dir = Path(user_dir)
        self.user_dir.mkdir(parents=True, exist_ok=True)
        self.checkpoint = Path(checkpoint)

    @property
    def settings_file(self) -> Path:
        return self.user_dir / "mlx-streaming.json"

    def write_settings(self, **data) -> None:
        self.settings_file.write_text(json.dumps(data))

    def read_settings(self) -> dict:
        return json.loads(self.settings_file.read_text()) if self.settings_file.exists() else {}

    def run(self, *args, input=None):
        from llm.cli import cli

        return CliRunner().invoke(cli, list(args), input=input)

    def turns(self) -> list[dict]:
        db = self.user_dir / "logs.db"
        if not db.exists():
            return []
        conn = sqlite3.connect(db)
        conn.row_factory = sqlite3.Row
        try:
            rows = conn.execute("select * from turns order by id").fetchall()
        except sqlite3.OperationalError:
            return []
        finally:
            conn.close()
        out = []
        for row in rows:
            item = dict(row)
            item["stats"] = json.loads(item["response_json"] or "null")
            out.append(item)
        return out


def assert_ok(result):
    assert result.exit_code == 0, (result.output, result.exception)
    return result


def assert_one_line_error(result, *needles):
    """A failed command: exit 1, one 'Error: ...' line on stderr, no traceback."""
    assert result.exit_code == 1, (result.output, result.exception)
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("Error: "), result.stderr
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])
    return errors[0]


def assert_llm_option_error(result, option):
    """llm's own option validation: 'Error: <option>' plus pydantic's reason."""
    assert result.exit_code == 1, (result.output, result.exception)
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    assert result.stderr.startswith(f"Error: {option}"), result.stderr
    assert len(result.stderr.strip().splitlines()) <= 2, result.stderr


def tagged_tokenizer(think: bool = True, tools: bool = False):
    """What the reply splitter reads of a tokenizer, for one with <think> tags (the
    test checkpoints') and, with `tools`, Qwen's <tool_call> markup."""
    from types import SimpleNamespace

    return SimpleNamespace(
        has_thinking=think, think_start="<think>" if think else None, think_end="</think>" if think else None,
        has_tool_calling=tools, tool_call_start="<tool_call>" if tools else None,
        tool_call_end="</tool_call>" if tools else None, response_transitions={}, structural_markers=(),
        tool_format=None)


def split_reply(text: str, tokenizer=None) -> tuple[str, str]:
    """(answer text, reasoning) of a reply, the way the plugin splits it."""
    from llm_mlx_streaming.prompt.split import ReplySplitter

    s = ReplySplitter(tokenizer or tagged_tokenizer())
    pieces = s.feed(text) + s.flush()
    return "".join(c for k, c in pieces if k == "text"), "".join(c for k, c in pieces if k == "reasoning")


@lru_cache(maxsize=4)
def _stock(path: str):
    from mlx_lm import load

    return load(path)


def mlx_lm_text(path: Path, messages: list[dict], max_tokens: int) -> str:
    """What stock mlx-lm generates (greedy) for the same chat-templated prompt."""
    from mlx_lm import generate

    model, tokenizer = _stock(str(path))
    tokens = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return generate(model, tokenizer, tokens, max_tokens=max_tokens)


@contextmanager
def serving(env: LlmEnv, **kwargs):
    """`env` with a server for its user dir on a free loopback port (`env.server`),
    stopped at the end."""
    from llm_mlx_streaming.server.process.run import Server

    env.server = Server(port=0, **kwargs).start()
    try:
        yield env
    finally:
        env.server.stop()
