"""Our streaming engine against BigRig and boyle on the same synthetic checkpoint.

The peers are comparators only: they are installed from PyPI into their own virtual
environment (benchmarks/.cache/peers-venv) and driven from there, in subprocesses; none of
their code enters this repository. Every engine, stock mlx-lm included, decodes the same
prompt tokens greedily through mlx-lm's `stream_generate`, on the checkpoint that
benchmarks/engine_bench.py builds (qwen3_moe shape, 128 experts x 4 layers, 4-bit,
~755 MB of experts), with the same share of each layer's experts resident (25% and 50%),
cold (the checkpoint's pages dropped from the OS page cache, a fresh process, an empty
pool) and warm (checkpoint in the page cache, one warm-up generation first). Each engine
that has a packed copy of the experts gets it first, made the way its own setup makes it
(ours: `llm mlxs pack`'s `pack_checkpoint`; BigRig: the `ensure_packed` its CLI runs when it
installs a model); boyle reads the safetensors. `--no-pack` skips that (remove
`mlxs-packed/` and `benchmarks/.cache/bigrig-home` first to measure without them).

    python benchmarks/peers [--tokens 64] [--runs 2] [--repeat 3] [--fractions 0.25,0.5] [--no-pack] [--json F]
    python benchmarks/peers --iobound 600 [--repeat 2]   # every child in a 600 MB memory cgroup (root)
    python benchmarks/peers --report F      # the table again, from a --json file
    python benchmarks/peers --large [--large-limit-gb 16] [--large-fractions 0.1,0.25]

This machine is shared and small, so tok/s is noisy: `--repeat` interleaves whole cycles
and pools their runs, and the CPU ms/tok column (user+sys per decoded token) is the
steadier comparison. The I/O-efficiency line compares the engine's decode reads
(bytes_read / read_seconds) with raw `preadv` of exactly the same read calls, replayed
without the engine from the same page-cache state (`--reads` records them, `--replay`
replays them).

Columns: decode tok/s (mlx-lm's generation_tps), time to first token (prefill included,
load excluded), MB read per decoded token as each engine counts it (`engine MB/tok`:
our bytes_read, BigRig's fetch_gb, boyle's misses x bytes per expert) and as the kernel
counts it (`disk MB/tok`: /proc/self/io read_bytes, i.e. storage reads, 0 when the page
cache serves them), decode hit rate from each engine's own counters, peak RSS of the
process, and whether the generated tokens equal stock mlx-lm's.

The peers declare macOS only. On Linux each needs a shim for Apple-only calls, applied
from outside in the child process (their files are not changed); the table shows first
what happens as shipped, then the shimmed run. `--no-shims` skips the shimmed runs.

`--large` builds once (benchmarks/.cache/qwen3_moe-large, ~27 GB of 4-bit experts, more
than this machine's memory) with a streaming writer (the factory holds a whole model in
memory, so it cannot build this), then runs stock mlx-lm and our engine, each in a
subprocess under the same address-space limit (RLIMIT_AS), cold.
"""


from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # `python benchmarks/peers`: make the folder a package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    __package__ = "peers"

from .common import PROMPT  # noqa: E402
from .engines import ENGINES, child_main, pack_bigrig_main  # noqa: E402
from .large import large_main  # noqa: E402
from .parent import normal_main  # noqa: E402
from .replay import raw_main, replay_main  # noqa: E402
from .report import report  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=None, help="tokens per run (64; --large: 16)")
    parser.add_argument("--runs", type=int, default=2, help="measured warm runs per child (after 1 warm-up)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="cycles over every row, interleaved; runs of all cycles pooled (median)")
    parser.add_argument("--fractions", default=None, help="shares of experts resident (0.25,0.5)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per child (900; --large: 3600)")
    parser.add_argument("--no-shims", action="store_true", help="run the peers only as shipped")
    parser.add_argument("--no-pack", action="store_true",
                        help="no packed copies: every engine reads the safetensors (remove existing ones first)")
    parser.add_argument("--json", help="also write every measurement here")
    parser.add_argument("--report", metavar="JSON", help="print the table again from a --json file")
    parser.add_argument("--iobound", type=float, metavar="MB",
                        help="run every child in a memory cgroup of MB megabytes (root), so the checkpoint "
                        "cannot stay in the page cache and decode reads wait on the disk (default --fractions 0.25)")
    parser.add_argument("--large", action="store_true", help="the bigger-than-memory checkpoint")
    parser.add_argument("--large-limit-gb", type=float, default=16.0, help="RLIMIT_AS of each --large run (GiB)")
    parser.add_argument("--large-fractions", default="0.1,0.25")
    parser.add_argument("--large-dry-run", action="store_true", help="build and run a small one instead")
    parser.add_argument("--max-build-minutes", type=float, default=20.0)
    parser.add_argument("--force-build", action="store_true")
    # internal: the child processes
    parser.add_argument("--child", choices=sorted(ENGINES), help=argparse.SUPPRESS)
    parser.add_argument("--raw", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--replay", help=argparse.SUPPRESS)
    parser.add_argument("--reads", help=argparse.SUPPRESS)
    parser.add_argument("--paced", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ballast", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--pack-bigrig", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--fraction", type=float, default=0.25, help=argparse.SUPPRESS)
    parser.add_argument("--warmup", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--prompt", default=",".join(map(str, PROMPT)), help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=6, help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=8, help=argparse.SUPPRESS)
    parser.add_argument("--limit-experts", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--source", default="safetensors", choices=("safetensors", "packed"), help=argparse.SUPPRESS)
    parser.add_argument("--overlap", default="auto", help=argparse.SUPPRESS)
    parser.add_argument("--page-cache", default="keep", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tokens is None:
        args.tokens = 16 if args.large else 64
    if args.fractions is None:
        args.fractions = "0.25" if args.iobound else "0.25,0.5"
    if args.timeout is None:
        args.timeout = 3600.0 if args.large else 900.0
    if args.child:
        child_main(args)
    elif args.raw:
        raw_main(args)
    elif args.replay:
        replay_main(args)
    elif args.pack_bigrig:
        pack_bigrig_main(args)
    elif args.report:
        report(json.loads(Path(args.report).read_text()))
    elif args.large:
        large_main(args)
    else:
        normal_main(args)


if __name__ == "__main__":
    main()
