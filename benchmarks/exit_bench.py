"""How long `llm mlxs serve` takes to stop, from the signal to its exit, in four states:
idle, decoding one long reply, in a long batched prefill (three recorded agent requests
at once, two abandoned by their clients), and a pipeline of two local ranks (`--hosts`)
in a long prefill. docs/server.md promises a few seconds in every state (issue 50); each
run also checks the exit status and that nothing aborted. Then, for an idle pipeline
whose supervisor (`llm mlxs serve --hosts`) or mlx.launch is killed (SIGKILL, no word to
the others): the seconds until every process of it is gone (issue 57: within 10 s; found
in /proc by the llm user dir in their environment, so Linux only).

The server runs on the agent checkpoint of tests/test_exits.py (a tiny tool-template
qwen3_moe with a 32k BPE tokenizer, built once into a temporary folder), max_batch 3.

    python benchmarks/exit_bench.py [--runs 3] [--signal SIGINT|SIGTERM] [--prefill-step 2048] [--only killed]
"""

from __future__ import annotations

import argparse
import http.client
import json
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from soak import ROOT, ServerProcess  # noqa: E402

from fixtures.factory import build_checkpoint  # noqa: E402
from fixtures.traffic import load  # noqa: E402

ABNORMAL = ("terminate called", "Traceback", "Fatal Python error")
AGENTS = (("claude_code_sonnet_turn1", True), ("codex_turn1", False), ("claude_code_turn2", False))


def post(server: ServerProcess, doc: dict, max_tokens: int) -> http.client.HTTPConnection:
    """Send a recorded request as its client did, with `max_tokens` to generate."""
    body = dict(doc["body"])
    body["max_output_tokens" if "input" in body else "max_tokens"] = max_tokens
    conn = http.client.HTTPConnection(server.host, server.port, timeout=300)
    headers = {k: v for k, v in doc["headers"].items() if k not in ("authorization", "x-api-key", "content-length")}
    conn.request(doc["method"], doc["path"], body=json.dumps(body), headers=headers)
    return conn


def read_out(conn: http.client.HTTPConnection) -> None:
    """A client that waits for its reply to the end, however the server ends it."""
    try:
        conn.getresponse().read()
    except (OSError, http.client.HTTPException):
        pass


def until(predicate, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit("timed out waiting for the server's state")
        time.sleep(0.05)


def phases(server: ServerProcess) -> list[str]:
    return [f["phase"] for f in server.stats().get("in_flight", [])]


def decoding(server: ServerProcess) -> None:
    """One reply of 4,000 tokens, read as it comes; the signal once it decodes."""
    doc = {"method": "POST", "path": "/v1/chat/completions", "headers": {"content-type": "application/json"},
           "body": {"model": "mlx-stream", "stream": True, "messages": [{"role": "user", "content": "Say a lot."}]}}
    threading.Thread(target=read_out, args=(post(server, doc, 4000),), daemon=True).start()
    until(lambda: "decode" in phases(server))


def batched_prefill(server: ServerProcess) -> None:
    """Three recorded agent requests prefilled in one batch, two closed by their clients
    once all three prefill; the signal while the third still does."""
    left = []
    for name, whole in AGENTS:
        conn = post(server, load(name), 8)
        if whole:
            threading.Thread(target=read_out, args=(conn,), daemon=True).start()
        else:
            left.append(conn)
    until(lambda: phases(server).count("prefill") == len(AGENTS))
    for conn in left:
        conn.close()
    until(lambda: len(phases(server)) == 1)


def long_prefill(server: ServerProcess) -> None:
    """One recorded agent request, read whole; the signal while it prefills."""
    threading.Thread(target=read_out, args=(post(server, load(AGENTS[0][0]), 8),), daemon=True).start()
    until(lambda: "prefill" in phases(server))


PIPELINE = ("--hosts", "127.0.0.1,127.0.0.1")
STATES = {"idle": (lambda server: None, ()), "decoding": (decoding, ()), "batched prefill": (batched_prefill, ()),
          "pipeline prefill": (long_prefill, PIPELINE)}


def stop_seconds(checkpoint: Path, state, extra: tuple, stop_signal: int, prefill_step: int) -> tuple[float, int, str]:
    """(seconds from the signal to the exit, exit status, the server's log) for one run."""
    with tempfile.TemporaryDirectory() as tmp:
        user_dir = Path(tmp) / "llm"
        user_dir.mkdir()
        (user_dir / "mlx-streaming.json").write_text(json.dumps({
            "default_model": "tiny", "max_context": 32768, "max_batch": 3, "prefill_step": prefill_step,
            "models": {"tiny": {"path": str(checkpoint), "expert_slots": 8}}}))
        server = ServerProcess(user_dir, ROOT, args=("-m", "mlx-stream", "--any-model", *extra))  # agents name their own
        try:
            state(server)
            server.proc.send_signal(stop_signal)
            sent = time.monotonic()
            status = server.proc.wait(120)
            return time.monotonic() - sent, status, server.log()
        finally:
            server.stop()


def processes(user_dir: Path, but: int) -> dict[int, str]:
    """The live processes whose environment names `user_dir` (pid -> command), `but` aside."""
    import os

    mine, found = f"LLM_USER_PATH={user_dir}".encode(), {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if mine in environ and state != "Z" and int(pid) != but:
            found[int(pid)] = command
    return found


def orphan_seconds(checkpoint: Path, victim: str) -> tuple[float, int]:
    """(seconds from SIGKILL to `victim`, "supervisor" or "mlx.launch", of an idle pipeline
    until none of its processes is left, how many were left at 30 s) for one run."""
    import os

    with tempfile.TemporaryDirectory() as tmp:
        user_dir = Path(tmp) / "llm"
        user_dir.mkdir()
        (user_dir / "mlx-streaming.json").write_text(json.dumps({
            "default_model": "tiny", "models": {"tiny": {"path": str(checkpoint), "expert_slots": 8}}}))
        server = ServerProcess(user_dir, ROOT, args=("-m", "mlx-stream", *PIPELINE))
        try:
            launcher = [pid for pid, command in processes(user_dir, os.getpid()).items()
                        if "run_launcher" in command or "mlx.launch" in command]
            os.kill(server.proc.pid if victim == "supervisor" else launcher[0], signal.SIGKILL)
            sent = time.monotonic()
            while processes(user_dir, os.getpid()) and time.monotonic() - sent < 30:
                time.sleep(0.05)
            return time.monotonic() - sent, len(processes(user_dir, os.getpid()))
        finally:
            for pid in processes(user_dir, os.getpid()):
                os.kill(pid, signal.SIGKILL)
            server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--signal", default="SIGINT", choices=("SIGINT", "SIGTERM"))
    parser.add_argument("--prefill-step", type=int, default=2048)
    parser.add_argument("--only", choices=["killed"], help="only the table of killed pipelines")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = build_checkpoint(Path(tmp) / "agent", "qwen3_moe", tool_template=True, tokenizer_kind="bpe32k",
                                      max_position_embeddings=32768)
        print(f"{'state':<16} {'median s':>9} {'max s':>7}  statuses  aborted")
        for name, (state, extra) in STATES.items() if args.only is None else ():
            runs = [stop_seconds(checkpoint, state, extra, getattr(signal, args.signal), args.prefill_step)
                    for _ in range(args.runs)]
            seconds = [s for s, _, _ in runs]
            aborted = sum(any(sign in log for sign in ABNORMAL) for _, _, log in runs)
            statuses = ",".join(str(status) for _, status, _ in runs)
            print(f"{name:<16} {statistics.median(seconds):>9.2f} {max(seconds):>7.2f}  {statuses:<8}  {aborted}",
                  flush=True)
        print()
        print(f"{'SIGKILL to':<16} {'median s':>9} {'max s':>7}  left at 30 s (every process of the pipeline gone)")
        for victim in ("supervisor", "mlx.launch"):
            runs = [orphan_seconds(checkpoint, victim) for _ in range(args.runs)]
            seconds = [s for s, _ in runs]
            print(f"{victim:<16} {statistics.median(seconds):>9.2f} {max(seconds):>7.2f}  "
                  f"{','.join(str(left) for _, left in runs)}", flush=True)


if __name__ == "__main__":
    main()
