"""Small output helpers shared by the commands."""

from __future__ import annotations

import click


def _table(headers, rows, indent: str = "") -> None:
    all_rows = ([headers] if headers else []) + rows
    if not all_rows:
        return
    widths = [max(len(str(r[i])) for r in all_rows) for i in range(len(all_rows[0]) - 1)]
    for r in all_rows:
        cells = [str(c).ljust(w) for c, w in zip(r, widths)] + [str(r[-1])]
        click.echo((indent + "  ".join(cells)).rstrip())


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def _line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__
