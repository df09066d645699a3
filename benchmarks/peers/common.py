"""What both sides share: paths, the benchmark's shape and prompt, and process readings."""

from __future__ import annotations

import resource
import sys
import traceback
from pathlib import Path

ENTRY = Path(__file__).resolve().parent  # `python benchmarks/peers` runs this package
ROOT = ENTRY.parents[1]
CACHE = ENTRY.parent / ".cache"
PEERS_VENV = CACHE / "peers-venv"
BIGRIG_HOME = CACHE / "bigrig-home"
PEERS = {"bigrig": ("bigrig", "0.9.1", "bigrig_engine"), "boyle": ("boyle", "0.2.1", "boyle")}
SHAPE = dict(hidden_size=1024, moe_intermediate_size=768, num_experts=128, top_k=8, num_layers=4)
PROMPT = list(range(3, 35))  # the prompt engine_bench.py uses: 32 token ids
MARK = "@@RESULT "

# --large: 48 layers x 384 experts x 1.47 MB = 27.2 GB (25.3 GiB) of 4-bit experts
LARGE_SHAPE = dict(hidden_size=1024, moe_intermediate_size=768, num_experts=384, top_k=8, num_layers=48)
LARGE_LAYERS_PER_SHARD = 4
LARGE_VERSION = 1


def proc_io() -> dict:
    try:
        with open("/proc/self/io") as f:
            return {k: int(v) for k, v in (line.split(":") for line in f)}
    except OSError:
        return {}


def meminfo_bytes(key: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def peak_rss() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def where(exc: BaseException, package: str | None) -> str:
    """file:line and source of the innermost frame in `package` (else the innermost frame)."""
    frames = traceback.extract_tb(exc.__traceback__)
    pick = None
    for fr in frames:
        if package and f"/{package}/" in fr.filename:
            pick = fr
    pick = pick or (frames[-1] if frames else None)
    if pick is None:
        return ""
    name = pick.filename
    if package and f"/{package}/" in name:
        name = package + "/" + name.split(f"/{package}/", 1)[1]
    return f"{name}:{pick.lineno}: {(pick.line or '').strip()}"
