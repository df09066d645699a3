"""The docs show what the commands print: every transcript in README.md and docs/*.md is
run on the bundled demo and its lines compared with the output.

A transcript is a fenced block whose lines start with `$ llm ...`: each command runs
through llm's CLI, in order, in a fresh llm user dir per document (so a `stats` follows
the prompts before it), on a terminal 100 columns wide; the lines after it are what it
prints, stdout and stderr as they come (the demo is copied out of the package first,
unless the document's first transcript shows that). Figures that change from run to run are compared
by shape only: numbers with a decimal point, durations (ms, s), dates, and the user dir
in a path (`~/...`); so are the spaces between columns. A line `...` stands for any lines. A transcript run elsewhere (a real
model this machine does not have) says so in an HTML comment right above its block:
`<!-- not run by tests/test_docs.py: ... -->`.
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest

from plugin_support import LlmEnv

ROOT = Path(__file__).parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOT_RUN = "<!-- not run by tests/test_docs.py"
VOLATILE = [
    (re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d"), "DATE"),
    (re.compile(r"(~|/)[^\s'\"]*?/(?=mlx-streaming)"), "~/.../"),  # the llm user dir
    (re.compile(r"\d[\d,]*\.\d+"), "#"),
    (re.compile(r"\b\d+(?= ?(ms|s)\b)"), "#"),
]


def transcripts(document: Path) -> list[tuple[int, list[tuple[str, list[str]]]]]:
    """(line number, [(command, the lines shown after it)]) of each transcript to run."""
    out, lines = [], document.read_text().splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("```") and i + 1 < len(lines) and lines[i + 1].startswith("$ llm "):
            start, i = i + 1, i + 1
            steps: list[tuple[str, list[str]]] = []
            while not lines[i].startswith("```"):
                if lines[i].startswith("$ "):
                    steps.append((lines[i][2:], []))
                else:
                    steps[-1][1].append(lines[i])
                i += 1
            if not (start >= 2 and lines[start - 2].startswith(NOT_RUN)):
                out.append((start, steps))
        i += 1
    return out


def normal(line: str) -> str:
    for pattern, shape in VOLATILE:
        line = pattern.sub(shape, line)
    return re.sub(r"(?<=\S)  +", "  ", line.rstrip())  # a figure's width moves no column


def shown(doc: list[str], actual: list[str]) -> bool:
    """Whether `actual` is what `doc` shows, `...` standing for any lines."""
    if not doc:
        return not actual
    if doc[0] == "...":
        return any(shown(doc[1:], actual[k:]) for k in range(len(actual) + 1))
    return bool(actual) and normal(doc[0]) == normal(actual[0]) and shown(doc[1:], actual[1:])


@pytest.mark.skipif(sys.platform != "linux", reason="the docs' figures are this project's Linux machine's")
@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.name)
def test_every_transcript_in_the_docs_prints_what_it_shows(document, tmp_path, monkeypatch):
    from llm_mlx_streaming.checkpoints.default import SHIPPED, default_checkpoint

    found = transcripts(document)
    if not found:
        pytest.skip(f"{document.name} has no transcript to run")
    monkeypatch.setenv("LLM_USER_PATH", str(tmp_path / "llm"))
    monkeypatch.setenv("COLUMNS", "100")
    monkeypatch.chdir(ROOT)
    env = LlmEnv(tmp_path / "llm", SHIPPED)
    if not found[0][1][0][1][:1] or not found[0][1][0][1][0].startswith("mlx-stream: unpacking"):
        default_checkpoint()  # a document that does not show the demo's first use finds it copied
    for line, steps in found:
        for command, doc in steps:
            result = env.run(*shlex.split(command, comments=True)[1:])
            actual = result.output.splitlines()
            assert shown(doc, actual), (f"{document.name}:{line}: `{command}` printed\n" + "\n".join(actual))
