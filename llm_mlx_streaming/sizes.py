"""Byte sizes as people write them ("12GB", "1.5 GiB") and as the plugin prints them.

At the bottom of the package (it imports nothing of ours): settings, the planner and
the commands all read and print sizes the same way.
"""

from __future__ import annotations

import re

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2,
    "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2,
    "gi": 1024**3, "gib": 1024**3, "ti": 1024**4, "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Bytes in a size like "12GB", "12G", "1.5 GiB", "512MiB" or "4096".

    Decimal units (KB, MB, GB, TB, or K/M/G/T) are powers of 1000, binary ones (KiB,
    MiB, GiB, TiB) powers of 1024; case does not matter. An int is returned as is.
    """
    if isinstance(text, bool):
        raise ValueError(f"not a size: {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must not be negative: {text}")
        return text
    match = _SIZE.match(str(text))
    unit = match and _UNITS.get(match.group(2).lower())
    if not unit:
        raise ValueError(
            f"not a size: {text!r} (use e.g. 12GB, 12G, 1.5GiB, 512MB; "
            "units B, KB, MB, GB, TB = 1000^n, KiB, MiB, GiB, TiB = 1024^n)"
        )
    return int(round(float(match.group(1)) * unit))


BARE_LEAST = 2**20  # a number without a unit below this many bytes is taken for a slip ("12" meant 12GB)


def given_size(text: str | int, unit: str = "GB") -> int:
    """Bytes in a size a person typed (a setting, an option, a flag): `parse_size`, except
    that text of a number without a unit below BARE_LEAST is refused with the `unit` it
    likely meant ("12: did you mean 12GB?"), not taken as a dozen bytes; 0 stays 0, and
    an int (a JSON number, a stored byte count) is bytes as given."""
    size = parse_size(text)
    number = str(text).strip()
    if isinstance(text, str) and 0 < size < BARE_LEAST and number.replace(".", "", 1).isdigit():
        raise ValueError(f"{number}: did you mean {number}{unit}? Bytes are written {number}B")
    return size


def format_size(n: int | float | None) -> str:
    """A byte count in decimal units with one decimal: "2.0 GB", "48.3 MB", "512 B"
    ("-" for None: a size nobody could tell)."""
    if n is None:
        return "-"
    n = float(n)
    sign = "-" if n < 0 else ""
    n = abs(n)
    if n < 1000:
        return f"{sign}{n:.0f} B"
    for unit, scale in (("KB", 1e3), ("MB", 1e6), ("GB", 1e9)):
        if round(n / scale, 1) < 1000:
            return f"{sign}{n / scale:.1f} {unit}"
    return f"{sign}{n / 1e12:.1f} TB"
