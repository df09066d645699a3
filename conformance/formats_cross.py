"""The contract across the model families' own formats: every family's real chat template
and tool-call format through every door, printed as a table (the format column of the
cross; conformance/contract_cross.py is the architecture half).

    python conformance/formats_cross.py [FAMILY ...]

Runs tests/test_family_doors.py (a tiny checkpoint per family with its real template and
special tokens, fixtures/families.py; replies forced to what the family's model writes)
and tabulates its outcomes: per family, the format found from the checkpoint (formats/),
whose parser reads it (mlx-lm's, ours, or one learned from the template: formats/learning.py),
whether it reasons, and for each door ok or
FAIL: OpenAI chat, Responses, Anthropic and Ollama (each: reasoning then parallel calls,
whole and streamed, then the round trip with the results), llm's own tools (a chain),
and the recorded Claude Code and Codex requests rendering with the template.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from fixtures.families import FAMILIES, build_family_checkpoint  # noqa: E402
from llm_mlx_streaming.formats.registry import checkpoint_format  # noqa: E402

DOORS = ("openai", "responses", "anthropic", "ollama", "llm", "claude code", "codex")


class Outcomes:
    """A pytest plugin that keeps each test's outcome by (family, door)."""

    def __init__(self):
        self.cells: dict[tuple[str, str], str] = {}

    def pytest_runtest_logreport(self, report):
        if report.when != "call" and not report.failed:
            return
        params = report.nodeid.split("[", 1)[1].rstrip("]").split("-") if "[" in report.nodeid else []
        family = params[0]
        if "llm_tools" in report.nodeid:
            doors = ["llm"]
        elif "recorded" in report.nodeid:
            doors = ["claude code" if params[1] == "anthropic" else "codex"]
        elif len(params) > 1 and params[1] in DOORS:
            doors = [params[1]]
        else:  # a thinking shape or budget of Claude Code's, sent to /v1/messages
            doors = ["anthropic"]
        for door in doors:
            if self.cells.get((family, door)) != "FAIL":
                self.cells[(family, door)] = "ok" if report.passed else "FAIL"


def main(families) -> int:
    families = families or list(FAMILIES)
    outcomes = Outcomes()
    started = time.time()
    pytest.main(["-q", "-p", "no:cacheprovider", str(ROOT / "tests" / "test_family_doors.py"),
                 "-k", " or ".join(families)], plugins=[outcomes])
    with tempfile.TemporaryDirectory() as scratch:
        print("\n| family (template) | format | parser | reasons | " + " | ".join(DOORS) + " |")
        print("|" + "---|" * (4 + len(DOORS)))
        for family in families:
            spec = FAMILIES[family]
            found = checkpoint_format(build_family_checkpoint(Path(scratch) / family, family))
            parser = "-" if found is None else "learned" if found.origin == "learned" else (
                "mlx-lm" if found.parser.startswith("mlx_lm.") else "ours")
            cells = [outcomes.cells.get((family, door), "-") for door in DOORS]
            print(f"| {family} ({spec.template}) | {found.name if found else 'none'} | {parser} | "
                  f"{'yes' if spec.reasons else 'no'} | " + " | ".join(cells) + " |")
    failed = sum(v == "FAIL" for v in outcomes.cells.values())
    print(f"\n{len(families)} families x {len(DOORS)} doors: {failed} failed, "
          f"{time.time() - started:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
