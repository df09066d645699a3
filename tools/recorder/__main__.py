"""`python -m tools.recorder`: install, record, scrub, report (see the package's docstring)."""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

from conformance.agent_clis import CACHE, ROOT, make_scratch, npm_install, versions

from . import __doc__ as ABOUT
from .clients import (EXTRA_RUNS, agents_venv, pip_version, record_agents, record_claude, record_codex,
                      record_sdks)
from .scrub import scrub
from .server import Recorder

RAW = CACHE / "traffic-raw"
OUT = ROOT / "tests" / "data" / "traffic"


# -- main ------------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=ABOUT.split("\n\n")[0])
    ap.add_argument("--clients", default="claude,codex,agents,sdk")
    ap.add_argument("--claude-version", default="latest")
    ap.add_argument("--codex-version", default="latest")
    ap.add_argument("--codex-sandbox", default="workspace-write",
                    help="read-only | workspace-write | danger-full-access | bypass")
    ap.add_argument("--no-install", action="store_true", help="use what conformance/.cache holds")
    ap.add_argument("--scrub-only", action="store_true", help="re-scrub the last raw recording")
    ap.add_argument("--keep-scratch", action="store_true")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--runs", help="record only these runs and add their files to --out, leaving the "
                    f"others as they are (comma-separated: {', '.join(EXTRA_RUNS)})")
    args = ap.parse_args()
    clients = set(args.clients.split(","))
    added = args.runs.split(",") if args.runs else None
    if added:
        unknown = set(added) - set(EXTRA_RUNS)
        if unknown:
            ap.error(f"--runs: no run {', '.join(sorted(unknown))} (there are {', '.join(EXTRA_RUNS)})")
        clients = {"claude"}
    meta_path = RAW / "meta.json"

    if args.scrub_only:
        meta = json.loads(meta_path.read_text())
        index = scrub(RAW, args.out, meta)
        _report(index, meta)
        return 0

    start = time.monotonic()
    if ({"claude", "codex"} & clients) and not args.no_install:
        npm_install(args.claude_version, args.codex_version)
    vers = versions()
    python = agents_venv() if "agents" in clients else None
    vers["openai_agents"] = pip_version(python, "openai-agents") if python else None
    vers["openai_sdk"] = pip_version(sys.executable, "openai")
    vers["anthropic_sdk"] = pip_version(sys.executable, "anthropic")
    setup_s = time.monotonic() - start

    if RAW.exists():
        shutil.rmtree(RAW)
    scratch = make_scratch("record-agents-")
    scratches = [scratch]
    runs = []
    record_start = time.monotonic()
    with Recorder(RAW) as rec:
        print(f"recorder on 127.0.0.1:{rec.port}, raw requests in {RAW}", flush=True)
        if "claude" in clients and not added:
            runs += record_claude(rec, scratch)
        if "codex" in clients and not added:
            runs += record_codex(rec, scratch, args.codex_sandbox)
        if "agents" in clients and not added:
            runs += record_agents(rec, scratch, python)
        if "sdk" in clients and not added:
            runs += record_sdks(rec)
        for name in added or (EXTRA_RUNS if "claude" in clients else ()):
            scratches.append(make_scratch("record-agents-"))  # each a session of its own
            runs += EXTRA_RUNS[name](rec, scratches[-1])
        rec.label = "after"
        time.sleep(0.5)  # a straggling request still lands in the log
        port = rec.port
        summary = rec.summary
    record_s = time.monotonic() - record_start
    for r in runs:
        tail = (r.get("stderr") or r.get("error") or "").strip().splitlines()[-3:]
        print(f"{r['label']:32s} rc={r['rc']} {r.get('seconds', '')}s"
              f"{' TIMED OUT' if r.get('timed_out') else ''}  {' | '.join(tail)[:300]}")
    print("\nrequests:")
    for s in summary:
        print(f"  {s['seq']:3d} {s['label']:28s} {s['method']:5s} {s['path'][:60]:60s} "
              f"{s['body_bytes']:8d} B -> {s['status']} {s['reply']}")
    meta = {"versions": vers, "port": port, "dates": _recording_dates(),
            "scratch": [{k: str(v) for k, v in one.items()} for one in scratches],
            "recorded_with": {"node": _cmd_out(["node", "--version"]), "npm": _cmd_out(["npm", "--version"]),
                              "python": platform.python_version(), "setup_seconds": round(setup_s, 1),
                              "record_seconds": round(record_s, 1)},
            "runs": [{k: r.get(k) for k in ("label", "cmd", "rc", "timed_out", "seconds", "error")}
                     for r in runs]}
    if added:
        meta["added_runs"] = added
    for r in meta["runs"]:
        if r.get("cmd"):
            r["cmd"] = [c if not c.startswith(("/", "import")) else _short(c) for c in r["cmd"]]
    (RAW / "runs.log").write_text(json.dumps(runs, indent=1))
    meta_path.write_text(json.dumps(meta, indent=1))
    index = scrub(RAW, args.out, meta)
    _report(index, meta)
    if not args.keep_scratch:
        for one in scratches:
            shutil.rmtree(one["work"], ignore_errors=True)
    return 0


def _recording_dates() -> list[str]:
    """Today, yesterday and tomorrow (UTC and local), as YYYY-MM-DD and YYYY/MM/DD."""
    import datetime as dt

    days = set()
    for now in (dt.datetime.now(dt.timezone.utc), dt.datetime.now()):
        for delta in (-1, 0, 1):
            day = (now + dt.timedelta(days=delta)).date()
            days |= {day.isoformat(), day.strftime("%Y/%m/%d")}
    return sorted(days)


def _short(arg: str) -> str:
    if arg.startswith("import"):
        return "<openai-agents script, see tools/recorder/clients.py AGENTS_SCRIPT>"
    return Path(arg).name


def _cmd_out(cmd) -> str | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
    except OSError:
        return None


def _report(index: dict, meta: dict) -> None:
    print(f"\nclients: {meta['versions']}")
    print(f"timing: {meta['recorded_with']}")
    for f in index["files"]:
        print(f"  {f['file']:52s} {f['bytes']:9,d} B  {f['method']} {f['path']}  -> {f['reply']}")
    print(f"total {index['total_bytes']:,d} bytes in {len(index['files'])} files")


if __name__ == "__main__":
    sys.exit(main())
