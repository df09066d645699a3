"""The field inventory of tests/data/traffic/README.md: every header, query parameter,
body field and tool-schema keyword each client sent (a test checks it is current)."""

from __future__ import annotations

import json
import re
import urllib.parse
from pathlib import Path

# -- the field inventory (tests/data/traffic/README.md) ------------------------------------------

API_OF = {"/v1/messages": "Anthropic Messages", "/v1/responses": "OpenAI Responses",
          "/v1/chat/completions": "OpenAI chat completions"}
CLIENT_NAMES = {"claude_code": "Claude Code", "codex": "Codex", "openai_agents": "openai-agents",
                "openai_sdk": "openai SDK", "anthropic_sdk": "anthropic SDK"}
LISTED_HEADERS = {"anthropic-beta", "openai-beta", "x-codex-beta-features"}  # shown in full
NOT_WALKED = {"input_schema", "parameters", "properties", "user_id", "input"}  # schemas, tool inputs
ID_LIKE = re.compile(r"^(?:[a-z]+_)?(?:rec_|0{8}-)|^(?:toolu|call|resp|fc|msg|fco)_")

# A suggestion per field, from issue 33's policy (honour what changes the reply; accept
# and name hints and bookkeeping; refuse what cannot be done). The server decides.
SUGGESTED = [
    (r"^(model|messages|system|max_tokens|max_output_tokens|stream|stream_options|instructions|input"
     r"|tools|tool_choice|parallel_tool_calls|previous_response_id)$", "honour"),
    (r"^messages\[\]\.role$", "honour (Claude Code sends `system` turns inside `messages`)"),
    (r"cache_control", "accept, ignore"),
    (r"\{tool_use\}\.id$|\.tool_use_id$|call_id$|\.tool_call_id$|tool_calls\[\]\{function\}\.id$",
     "honour: pairs a call with its result"),
    (r"^metadata|^client_metadata|^include$|\.id$|\.status$|\.annotations$|\.logprobs$",
     "accept, ignore"),
    (r"^thinking", "honour: the template's thinking switch (`display`: accept)"),
    (r"^context_management", "accept: thinking is not kept between turns anyway (name it)"),
    (r"^output_config", "accept, ignore (name it)"),
    (r"^reasoning", "honour: thinking switch; summary: accept"),
    (r"^store$", "honour (false: keep nothing)"),
    (r"^prompt_cache_key$", "honour: picks the KV cache to reuse"),
    (r"defer_loading", "accept: render the tool or leave it out, on purpose"),
    (r"\{web_search\}", "drop the hosted tool and name it"),
    (r"\{namespace\}", "honour: flatten to its functions"),
    (r"\.strict$", "honour (constrained arguments)"),
    (r"is_error$", "honour (render it)"),
    (r"^messages|^system|^input|^tools", "honour"),
]


def _suggest(path: str) -> str:
    return next((policy for rx, policy in SUGGESTED if re.search(rx, path)), "")


def _summary(x) -> str:
    if isinstance(x, list) and all(isinstance(i, str) for i in x) and len(json.dumps(x)) <= 80:
        return json.dumps(x)  # e.g. include: ["reasoning.encrypted_content"]
    if isinstance(x, str):
        if ID_LIKE.search(x):
            return "id"
        return json.dumps(x) if len(x) <= 32 else f"str ({len(x):,d} chars)" if len(x) > 200 else "str"
    if isinstance(x, (bool, int, float)) or x is None:
        return json.dumps(x)
    return "list" if isinstance(x, list) else "object"


def _walk(v, path: str, out: dict, client: str) -> None:
    if isinstance(v, dict):
        disc = v.get("type") if isinstance(v.get("type"), str) else None
        for k, x in v.items():
            p = (f"{path}{{{disc}}}.{k}" if disc and path else f"{path}.{k}" if path else k)
            out.setdefault(p, {}).setdefault(client, set()).add(_summary(x))
            if k not in NOT_WALKED or (k == "input" and path == ""):
                _walk(x, p, out, client)
    elif isinstance(v, list):
        for x in v:
            _walk(x, path + "[]", out, client)


def _schema_keywords(schema, out: set) -> None:
    if isinstance(schema, dict):
        for k, x in schema.items():
            if k == "properties" and isinstance(x, dict):
                for sub in x.values():
                    _schema_keywords(sub, out)
                continue
            out.add(k)
            _schema_keywords(x, out)
    elif isinstance(schema, list):
        for x in schema:
            _schema_keywords(x, out)


def _tool_schemas(body: dict):
    for tool in body.get("tools") or []:
        for inner in [tool, *(tool.get("tools") or [])]:
            schema = inner.get("input_schema") or inner.get("parameters") or \
                (inner.get("function") or {}).get("parameters")
            if schema:
                yield schema


def _cell(values: set | None) -> str:
    if not values:
        return ""
    values = sorted(values)
    shown = ", ".join(v.replace("|", "\\|") for v in values[:3])
    return shown + (f" (+{len(values) - 3})" if len(values) > 3 else "")


def inventory(out_dir: Path) -> str:
    """Markdown tables: every header, query parameter, body field (with block/item types
    in braces) and tool-schema keyword each client sent, per API."""
    paths = [p for p in sorted(out_dir.glob("*.json")) if p.name != "index.json"]
    docs = [json.loads(p.read_text()) for p in paths]
    lines = ["### Files", "", "| file | client | run | request | bytes | the recorder's reply |",
             "|---|---|---|---|---:|---|"]
    for p, d in sorted(zip(paths, docs), key=lambda x: x[1]["seq"]):
        lines.append(f"| `{p.name}` | {CLIENT_NAMES[d['client']]} {d['client_version']} | `{d['run']}` "
                     f"| `{d['method']} {d['path']}` | {p.stat().st_size:,d} | {d['recorder_reply']['kind']} |")
    lines += ["", f"Total: {sum(p.stat().st_size for p in paths):,d} bytes in {len(paths)} files.", ""]
    for route, api in API_OF.items():
        mine = [d for d in docs if d["path"].split("?")[0] == route]
        if not mine:
            continue
        clients = [c for c in CLIENT_NAMES if any(d["client"] == c for d in mine)]
        head = "| {} | " + " | ".join(CLIENT_NAMES[c] for c in clients) + " | suggested |"
        rule = "|---|" + "---|" * (len(clients) + 1)
        lines += [f"### {api}: `POST {route}`", "", f"Files: {len(mine)} "
                  f"({', '.join(sorted({d['client'] for d in mine}))}).", ""]
        # headers and query
        fields: dict = {}
        for d in mine:
            for k, v in d["headers"].items():
                shown = ("<redacted>" if v == "<redacted>" else
                         " ".join(f"`{b}`" for b in v.split(",")) if k in LISTED_HEADERS else _summary(v))
                fields.setdefault(k, {}).setdefault(d["client"], set()).add(shown)
            for k, v in urllib.parse.parse_qsl(urllib.parse.urlsplit(d["path"]).query):
                fields.setdefault(f"?{k}", {}).setdefault(d["client"], set()).add(json.dumps(v))
        lines += ["Headers and query parameters (transport headers dropped; auth values redacted):", "",
                  head.format("header / ?query"), rule]
        for k in sorted(fields):
            note = ("honour (the key check)" if k in ("authorization", "x-api-key") else
                    "accept, ignore" if k.startswith("?") or k not in ("content-type", "accept") else "")
            lines.append(f"| `{k}` | " + " | ".join(_cell(fields[k].get(c)) for c in clients) + f" | {note} |")
        lines.append("")
        fields = {}
        for d in mine:
            _walk(d["body"] or {}, "", fields, d["client"])
        lines += ["Body fields (`a[]{t}.b`: field b of the elements of a whose type is t):", "",
                  head.format("field"), rule]
        for k in sorted(fields, key=lambda p: (p.split(".")[0].split("[")[0].split("{")[0], p)):
            lines.append(f"| `{k}` | " + " | ".join(_cell(fields[k].get(c)) for c in clients)
                         + f" | {_suggest(k)} |")
        lines.append("")
        keywords: dict = {}
        for d in mine:
            kw: set = set()
            for schema in _tool_schemas(d["body"] or {}):
                _schema_keywords(schema, kw)
            if kw:
                keywords.setdefault(d["client"], set()).update(kw)
        if keywords:
            lines += ["JSON Schema keywords in the tools' schemas (what constrained decoding must compile):", ""]
            for c in clients:
                if keywords.get(c):
                    lines.append(f"- {CLIENT_NAMES[c]}: " + ", ".join(f"`{k}`" for k in sorted(keywords[c])))
            lines.append("")
    return "\n".join(lines)


def write_readme_inventory(out_dir: Path) -> None:
    """Replace the generated part of README.md (between the markers) with `inventory`."""
    readme = out_dir / "README.md"
    start, end = "<!-- inventory: generated by tools/recorder -->", "<!-- inventory end -->"
    text = readme.read_text() if readme.exists() else f"# Recorded client traffic\n\n{start}\n{end}\n"
    if start not in text:
        text += f"\n{start}\n{end}\n"
    before, rest = text.split(start, 1)
    after = rest.split(end, 1)[1] if end in rest else ""
    readme.write_text(f"{before}{start}\n\n{inventory(out_dir)}\n{end}{after}")
