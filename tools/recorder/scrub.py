"""Scrubbing the raw requests into tests/data/traffic/: auth values, scratch paths, the
host, ids, dates and times replaced the same way in every file, each request named; a
recording of only some runs (--runs) added to the files already there."""

from __future__ import annotations

import json
import platform
import re
import socket
import tempfile
import urllib.parse
from pathlib import Path

from conformance.agent_clis import ROOT

from .inventory import write_readme_inventory
from .replies import content_blocks, trailing_messages

# -- scrubbing ---------------------------------------------------------------------------------

# Headers dropped: transport-level (host, lengths, connection, encodings of the wire).
DROP_HEADERS = {"host", "content-length", "connection", "accept-encoding", "transfer-encoding",
                "keep-alive"}
AUTH_HEADERS = {"authorization", "x-api-key", "proxy-authorization", "cookie"}
# Ids are often prefixed (msg_<uuid>, fco_<uuid>): hex boundaries, not word boundaries.
UUID = re.compile(r"(?<![0-9a-fA-F])[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-"
                  r"[0-9a-fA-F]{12}(?![0-9a-fA-F])")
LONG_HEX = re.compile(r"(?<![0-9a-fA-F])[0-9a-f]{32,}(?![0-9a-fA-F])")
# Codex's exec_command output header: a random chunk id and the wall time
RUN_NOISE = [(re.compile(r"(Chunk ID: )[0-9a-f]+"), r"\g<1>000000"),
             (re.compile(r"(Wall time: )[0-9.]+( seconds)"), r"\g<1>0.0000\g<2>")]
EPOCH_MS = re.compile(r"(?<!\d)1[6-9]\d{11}(?!\d)")  # unix time in ms (turn_started_at_unix_ms)
TIME = re.compile(r"\b20\d\d-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?(?:Z|[+-]\d\d:?\d\d)?")


class Scrubber:
    """Replaces machine- and run-specific strings, the same way in every file."""

    def __init__(self, scratch: dict | list[dict], port: int | None, meta_dates: list[str] | None = None,
                 first_uuid: int = 1):
        self.uuids: dict[str, str] = {}
        self.first_uuid = first_uuid
        pairs = []
        for one in scratch if isinstance(scratch, list) else [scratch] if scratch else []:
            work = Path(one["work"])
            for real, fake in ((work / "home" / "project", "/home/user/project"),
                               (work / "home", "/home/user"), (work, "/home/user/work")):
                for path in {str(real.resolve()), str(real)}:
                    # and as Claude Code names a project's directory (-tmp-x-home-project)
                    pairs += [(path, fake), (_slug(path), _slug(fake))]
        pairs += [(str(ROOT), "/home/user/src")]
        tmp = tempfile.gettempdir()
        self.pairs = [(a, b) for a, b in dict(pairs).items() if a not in ("/", "")]
        self.pairs.sort(key=lambda p: -len(p[0]))
        self.regexes = [(re.compile(re.escape(tmp) + r"/[A-Za-z0-9._-]+"), "/tmp/scratch")]
        days = meta_dates or []
        self.dates = re.compile("|".join(re.escape(d) for d in days)) if days else None
        # This machine's own home, only as a path prefix (Codex's agent_name "/root" is
        # not a path, and "</root>" is XML).
        home = str(Path.home())
        if home not in ("/", ""):
            self.regexes.append((re.compile(rf"(?<![<\w/]){re.escape(home)}(?=/)"), "/home/user"))
        host = socket.gethostname()
        if len(host) >= 4:
            self.regexes.append((re.compile(re.escape(host)), "host"))
        release = platform.release()
        if release:
            self.regexes.append((re.compile(re.escape(release)), "6.1.0-generic"))
        if port:
            self.regexes.append((re.compile(rf"127\.0\.0\.1:{port}\b"), "127.0.0.1:8080"))
            self.regexes.append((re.compile(rf"localhost:{port}\b"), "localhost:8080"))

    def text(self, s: str) -> str:
        for a, b in self.pairs:
            s = s.replace(a, b)
        for rx, b in self.regexes:
            s = rx.sub(b, s)
        s = UUID.sub(self._uuid, s)
        s = LONG_HEX.sub(lambda m: "0" * len(m.group(0)), s)
        s = TIME.sub("2025-01-01T00:00:00Z", s)
        s = EPOCH_MS.sub("1700000000000", s)
        for rx, b in RUN_NOISE:
            s = rx.sub(b, s)
        # Only the recording's own dates: beta names and API versions carry dates too.
        return self.dates.sub(lambda m: "2025-01-01" if "-" in m.group(0) else "2025/01/01", s) \
            if self.dates else s

    def _uuid(self, m) -> str:
        key = m.group(0).lower()
        if key not in self.uuids:
            self.uuids[key] = f"00000000-0000-4000-8000-{len(self.uuids) + self.first_uuid:012d}"
        return self.uuids[key]

    def value(self, v):
        if isinstance(v, str):
            return self.text(v)
        if isinstance(v, list):
            return [self.value(x) for x in v]
        if isinstance(v, dict):
            return {self.text(k): self.value(x) for k, x in v.items()}
        if isinstance(v, int) and not isinstance(v, bool):  # unix times, s or ms
            if 1_600_000_000_000 <= v < 2_100_000_000_000:
                return 1_700_000_000_000
            if 1_600_000_000 <= v < 2_100_000_000:
                return 1_700_000_000
        return v

    def headers(self, pairs: list) -> dict:
        out = {}
        for k, v in pairs:
            if k in DROP_HEADERS:
                continue
            out[k] = "<redacted>" if k in AUTH_HEADERS else self.text(v)
        return dict(sorted(out.items()))


def _slug(path: str) -> str:
    return re.sub(r"[^A-Za-z0-9]", "-", path)


def _is_main_claude(body: dict) -> bool:
    names = {t.get("name") for t in (body or {}).get("tools") or []}
    return "Bash" in names


def _last_has_tool_result(body: dict) -> bool:
    """Whether this turn's new input (after the last assistant message) has a tool_result."""
    return any(b.get("type") == "tool_result"
               for m in trailing_messages((body or {}).get("messages") or [], "assistant")
               for b in content_blocks(m.get("content")))


def _last_is_tool_output(body: dict) -> bool:
    items = (body or {}).get("input")
    return isinstance(items, list) and bool(items) and items[-1].get("type") == "function_call_output"


def name_requests(records: list[dict]) -> list[tuple[str, dict]]:
    """(file stem, record) for every recorded request: the key turns get the names the
    tests use, everything else `<client>_<run>_<nn>_<method>_<path>`."""
    named, others = [], {}

    def other(client, r, what):
        run = r["label"].split(".", 1)[1]
        others[run] = others.get(run, 0) + 1
        named.append((f"{client}_{run}_{others[run]:02d}_{what}", r))

    def what(r):
        path = urllib.parse.urlsplit(r["path"]).path
        slug = re.sub(r"[^a-z0-9]+", "_", path.lower()).strip("_").removeprefix("v1_") or "root"
        return f"{r['method'].lower()}_{slug}"

    for client, prefix in (("claude_code", "claude_code"), ("codex", "codex"),
                           ("openai_agents", "openai_agents"), ("openai_sdk", "openai_sdk"),
                           ("anthropic_sdk", "anthropic_sdk")):
        mine = [r for r in records if r["label"].split(".")[0] == client]
        seen = set()
        for r in mine:
            run_name = r["label"].split(".", 1)[1]
            body = r["body"] if isinstance(r["body"], dict) else {}
            stem = None
            if client == "claude_code" and r["method"] == "POST" and r["path"].split("?")[0].endswith("/v1/messages") \
                    and _is_main_claude(body):
                result = _last_has_tool_result(body)
                if run_name == "turn1":
                    stem = "claude_code_tool_result" if result else "claude_code_turn1"
                elif run_name == "turn2":
                    stem = "claude_code_turn2_tool_result" if result else "claude_code_turn2"
                else:
                    stem = f"claude_code_{run_name}_{'tool_result' if result else 'turn1'}"
            elif client == "codex" and r["method"] == "POST" and r["path"].endswith("/responses"):
                if run_name == "turn1":
                    stem = "codex_tool_output" if _last_is_tool_output(body) else "codex_turn1"
                else:
                    stem = "codex_turn2_tool_output" if _last_is_tool_output(body) else "codex_turn2"
            elif client == "openai_agents" and r["method"] == "POST" and r["path"].endswith("/responses"):
                kind = "tool_output" if _last_is_tool_output(body) else "turn1"
                stem = f"openai_agents_{kind}" if run_name == "run" else f"openai_agents_{run_name}_{kind}"
            elif client in ("openai_sdk", "anthropic_sdk") and r["method"] == "POST":
                turn = "tool_result" if (_last_has_tool_result(body) or _last_is_tool_output(body) or
                                         any(m.get("role") == "tool" for m in body.get("messages") or [])) \
                    else "turn1"
                stem = f"{prefix}_{run_name}_{turn}"
            if stem and stem not in seen:
                seen.add(stem)
                named.append((stem, r))
            else:
                other(client, r, what(r))
    return named


def scrub(raw: Path, out: Path, meta: dict) -> dict:
    """The raw recording into `out`; a recording of only some runs (`added_runs`, from
    --runs) replaces those runs' files and leaves every other file as it is, its ids
    and `seq` numbered on from theirs."""
    records = [json.loads(p.read_text()) for p in sorted(raw.glob("*.json"))]
    records = [r for r in records if "seq" in r]
    added = meta.get("added_runs")
    kept, first_uuid, first_seq = None, 1, 0
    out.mkdir(parents=True, exist_ok=True)
    if added:
        kept = json.loads((out / "index.json").read_text())
        gone = [f["file"] for f in kept["files"] if f["run"] in added]
        kept["files"] = [f for f in kept["files"] if f["run"] not in added]
        kept["runs"] = [r for r in kept["runs"] if r["label"] not in added]
        for name in gone:
            (out / name).unlink(missing_ok=True)
        texts = [(out / f["file"]).read_text() for f in kept["files"]]
        first_uuid = 1 + max((int(n) for t in texts for n in re.findall(r"00000000-0000-4000-8000-(\d{12})", t)),
                             default=0)
        first_seq = max(json.loads(t)["seq"] for t in texts)
    else:
        for stale in out.glob("*.json"):
            stale.unlink()
    scrubber = Scrubber(meta.get("scratch") or {}, meta.get("port"), meta.get("dates"), first_uuid)
    client_versions = meta.get("versions", {})
    index = {"recorded_with": meta.get("recorded_with"), "clients": client_versions,
             "runs": scrubber.value(meta.get("runs")), "files": []}
    if kept:
        index = kept | {"runs": kept["runs"] + index["runs"]}
    for stem, r in name_requests(records):
        client = r["label"].split(".")[0]
        doc = {
            "client": client, "client_version": client_versions.get(client),
            "run": r["label"], "seq": r["seq"] + first_seq,
            "method": r["method"], "path": scrubber.text(r["path"]),
            "headers": scrubber.headers(r["headers"]),
            "body": scrubber.value(r["body"]),
            "recorder_reply": r["reply"],
        }
        body = doc["body"]
        if isinstance(body, dict) and isinstance(body.get("client_metadata"), dict):
            # Codex fills it from a hash map: its order changes from run to run
            body["client_metadata"] = dict(sorted(body["client_metadata"].items()))
        if r.get("body_note"):
            doc["body_note"] = r["body_note"]
        text = json.dumps(doc, indent=1, ensure_ascii=False) + "\n"
        (out / f"{stem}.json").write_text(text)
        index["files"].append({"file": f"{stem}.json", "client": client, "run": r["label"],
                               "method": r["method"], "path": doc["path"], "bytes": len(text.encode()),
                               "body_bytes": r["body_decoded_bytes"], "reply": r["reply"]["kind"]})
    index["total_bytes"] = sum(f["bytes"] for f in index["files"])
    (out / "index.json").write_text(json.dumps(index, indent=1) + "\n")
    write_readme_inventory(out)
    return index
