"""Small output helpers shared by the commands."""

from __future__ import annotations

import sys

import click
from ..errors import MlxStreamError


def table(headers, rows, indent: str = "") -> None:
    """Rows as aligned columns (the last column is not padded)."""
    all_rows = ([headers] if headers else []) + rows
    if not all_rows:
        return
    widths = [max(len(str(r[i])) for r in all_rows) for i in range(len(all_rows[0]) - 1)]
    for r in all_rows:
        cells = [str(c).ljust(w) for c, w in zip(r, widths)] + [str(r[-1])]
        click.echo((indent + "  ".join(cells)).rstrip())


class ByteProgress:
    """A progress bar over a byte count on stderr, shown only on a terminal."""

    def __init__(self, label: str):
        self.label = label
        self.bar = None
        self.done = 0

    def __call__(self, done: int, total: int) -> None:
        if not sys.stderr.isatty():
            return
        if self.bar is None:
            self.bar = click.progressbar(length=total, label=self.label, file=sys.stderr)
            self.bar.__enter__()
        self.bar.update(done - self.done)
        self.done = done

    def close(self) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)
            self.bar = None


def report_problems(problems: list[str], failure: str) -> None:
    """Print each problem found on its own line; then, if any, fail with `failure`."""
    for problem in problems:
        click.echo(problem)
    if problems:
        raise MlxStreamError(failure)


def slots_text(slots) -> str:
    """Slots per layer in a few characters: one count, or the range of a list."""
    if isinstance(slots, list) and slots:
        return str(slots[0]) if len(set(slots)) == 1 else f"{min(slots)}-{max(slots)}"
    return "-" if slots is None else str(slots)
