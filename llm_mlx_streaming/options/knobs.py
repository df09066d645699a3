"""Every knob, declared once: its type, default, bounds, description and check.

The settings file's model (`settings.Settings`), llm's `-o` options (`model.Options`,
all optional: None means "the setting"), `llm mlxs config`, the server's request fields
and its `/api/engine/config` are all derived from `KNOBS`, so a knob added here is a
setting, an option and a request field at once, with one validation and one text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Optional, Union

from pydantic import ConfigDict, Field, create_model, field_validator

from .. import values
from ..experts.policies import DEFAULT_POLICY, POLICIES
from ..experts.store import DEFAULT_THREADS

BUNDLED_NAME = "tiny-moe"
POLICY_NAMES = tuple(POLICIES)
AUTO_BUDGET_SHARE = 0.6  # memory_budget "auto": this share of physical memory
BUNDLED_REPETITION_PENALTY = 1.3
REPETITION_CONTEXT = 64


@dataclass(frozen=True)
class Knob:
    name: str
    type: Any
    default: Any  # the setting's default (option-only knobs: unused)
    description: str
    check: Optional[Callable[[Any], Any]] = None  # what a typed value becomes; ValueError if refused
    bounds: dict = field(default_factory=dict)  # pydantic Field constraints (ge, le, gt)
    setting: bool = True  # saved by `llm mlxs config`
    option: bool = True  # an `-o` option and a server request field


def _setting_only(**kw) -> Knob:
    return Knob(**kw, option=False)


def _option_only(**kw) -> Knob:
    return Knob(**kw, default=None, setting=False)


KNOBS: tuple[Knob, ...] = (
    _setting_only(
        name="default_model", type=Optional[str], default=None,
        description=f"Model served by `-m mlx-stream`: a name from `llm mlxs models`. "
        f"Unset: the bundled demo checkpoint '{BUNDLED_NAME}'.",
    ),
    Knob(
        name="max_tokens", type=int, default=256, bounds={"ge": -1},
        description="Most tokens generated per response; 0 or -1: until the context (max_context) is full.",
    ),
    _option_only(name="temperature", type=float, bounds={"ge": 0, "le": 10},
                 description="Sampling temperature; 0 (default) is greedy"),
    _option_only(name="top_p", type=float, bounds={"gt": 0, "le": 1},
                 description="Nucleus sampling: keep the smallest set of tokens with this total probability"),
    _option_only(name="min_p", type=float, bounds={"ge": 0, "le": 1},
                 description="Drop tokens below this fraction of the top token's probability"),
    _option_only(name="top_k", type=int, bounds={"ge": 0},
                 description="Sample only from the k most likely tokens (0: no limit)"),
    _option_only(name="seed", type=int, description="Random seed, for repeatable sampling"),
    _option_only(
        name="top_logprobs", type=int, bounds={"ge": 0, "le": 20},
        description="Record each generated token's log-probability and this many most likely "
        "alternatives (0: none) in the response's JSON (logprobs)",
    ),
    _option_only(
        name="repetition_penalty", type=float, bounds={"ge": 1, "le": 5},
        description=f"Make tokens among the last {REPETITION_CONTEXT} this many times less likely "
        f"(mlx-lm's repetition penalty); 1: off (default {BUNDLED_REPETITION_PENALTY} for the bundled "
        "demo, whose greedy text loops without it; 1 for other models)",
    ),
    _option_only(
        name="stop", type=Union[str, list[str]], check=values.stop,
        description='End the reply before this text; several: a JSON list, e.g. \'["\\n\\n", "END"]\'',
    ),
    _option_only(
        name="thinking", type=bool, check=values.parse_switch,
        description="on/off: the chat template's thinking switch (enable_thinking, DeepSeek's thinking; "
        "for gpt-oss, off is its low reasoning effort), where the template has one",
    ),
    _option_only(
        name="reasoning_effort", type=str, check=values.effort,
        description="none, minimal, low, medium or high: gpt-oss's reasoning effort (its template's "
        "reasoning_effort; none and minimal are its low); for a template with an on/off switch, none and "
        "minimal turn thinking off and the others on",
    ),
    _option_only(
        name="thinking_budget", type=int, bounds={"ge": 1},
        description="Most tokens of reasoning: after this many the reasoning is closed with the model's "
        "own closing tokens and the answer follows",
    ),
    _option_only(
        name="tool_choice", type=str, check=values.tool_choice,
        description="With tools (-T): auto (default: the model decides), none (the tools are not shown "
        "to the model), required (it must call one), or a tool's name (it must call that one); required "
        "and a name are enforced by constrained decoding",
    ),
    _option_only(
        name="parallel_tool_calls", type=bool, check=values.parse_switch,
        description="With tools: on (default): a reply may hold several calls; off: at most one",
    ),
    Knob(
        name="expert_slots", type=Optional[int], default=None, bounds={"ge": 1},
        description="Expert slots per MoE layer kept in memory (the rest stream from disk); fewer slots "
        f"use less memory and read more. Unset: 8 for '{BUNDLED_NAME}', a model's own --expert-slots, "
        "else what memory_budget allows.",
    ),
    Knob(
        name="policy", type=Optional[Literal[POLICY_NAMES]], default=None,
        description=f"Expert eviction policy when a pool is full: {', '.join(POLICY_NAMES)}. "
        f"Unset: the engine's default ({DEFAULT_POLICY}).",
    ),
    Knob(
        name="memory_budget", type=str, default="auto", check=values.budget,
        description="Memory for the model when no expert_slots is set: dense weights, KV cache for "
        "max_context tokens, a reserve and as many expert slots as fit (`llm mlxs plan`). A size like "
        f"12GB, 12G, 1.5GiB, or auto: {AUTO_BUDGET_SHARE:.0%} of this machine's physical memory.",
    ),
    Knob(
        name="max_context", type=Union[Literal["auto"], int], default="auto", check=values.max_context,
        description="Longest conversation (prompt + reply, in tokens) the KV cache is planned for; "
        "longer prompts are refused and replies stop there; the conversations a model keeps in memory share "
        "that KV cache. auto: the model's own context, as long as "
        f"its KV cache takes at most {values.KV_SHARE:.0%} of the memory budget (`llm mlxs plan` shows it). "
        "As an option: a lower limit for one prompt (the setting is what the KV cache and the memory plan "
        "are made for).",
    ),
    _setting_only(
        name="buffer_cache", type=str, default="auto", check=values.buffer_size,
        description="Most memory MLX keeps in freed buffers for reuse while requests run (mx.set_cache_limit); "
        "all of it is given back whenever the engine has nothing queued. A size like 512MB, 0 (keep none), "
        "or auto: the memory plan's working reserve, max(256 MiB, 5% of memory_budget).",
    ),
    _setting_only(name="threads", type=int, default=DEFAULT_THREADS, bounds={"ge": 1, "le": 256},
                  description="Threads reading experts from disk."),
    _setting_only(
        name="page_cache", type=Literal[values.PAGE_CACHE_MODES], default="keep",
        description="keep: expert reads go through the OS page cache (a free second tier); "
        "bypass: keep them out of it (macOS F_NOCACHE, Linux O_DIRECT or fadvise DONTNEED).",
    ),
    _setting_only(
        name="overlap", type=Literal[values.OVERLAP_MODES], default="auto",
        description="on: a decode step computes its resident experts while its misses are read, and "
        "reads ahead the experts the next layer is predicted to need; off: read first, then compute; "
        "auto: on where the reads wait on the disk (pages not in the page cache), off where the page "
        "cache serves them (on a GPU: overlap, no read-ahead).",
    ),
    _setting_only(
        name="trace", type=bool, default=False, check=values.parse_switch,
        description="Record each response's expert routing to "
        "<llm user dir>/mlx-streaming/traces/<model>.jsonl, for `llm mlxs simulate`.",
    ),
    _setting_only(
        name="packed", type=Literal["auto", "off"], default="auto",
        description="auto: read experts from the model's packed store (`llm mlxs pack`) when one is "
        "present and valid; off: always read the safetensors.",
    ),
    Knob(
        name="k", type=Union[Literal["auto"], int], default=0, check=values.k,
        description="Speculative decoding: draft tokens verified per pass of the big model; "
        "0: off (plain decoding); auto: adapt to how often drafts are accepted.",
    ),
    Knob(
        name="draft", type=str, default="ngram", check=values.draft,
        description="Who drafts when k > 0: ngram (look the last tokens up in the conversation), mtp "
        "(the checkpoint's own multi-token-prediction head), or the name of a small model added with "
        "`llm mlxs add` that shares the big model's vocabulary.",
    ),
    Knob(
        name="kv_bits", type=Union[Literal["off"], int], default="off", check=values.stored_kv_bits,
        description=f"Quantize the KV cache to {' or '.join(map(str, values.KV_BITS))} bits (off: full "
        "precision), as mlx-lm's kv_bits does; a quantized cache leaves the memory plan more expert slots.",
    ),
    Knob(
        name="kv_group_size", type=int, default=64, check=values.kv_group_size,
        description="Values per quantization group of the KV cache: "
        f"{', '.join(map(str, values.KV_GROUP_SIZES))}.",
    ),
    Knob(name="kv_start", type=int, default=0, bounds={"ge": 0},
         description="Tokens the KV cache holds before it is quantized (mlx-lm's quantized_kv_start)."),
    Knob(
        name="prefill_step", type=Union[Literal["auto"], int], default="auto", check=values.prefill_step,
        description="Prompt tokens per prefill chunk; each expert is read at most once per chunk. "
        "auto: as large as the memory budget allows.",
    ),
    Knob(
        name="server", type=Literal["auto", "off"], default="auto",
        description="auto: when `llm mlxs serve` runs for this llm user dir, prompts go to it (its warm "
        "engine); off: run in this process.",
    ),
    _setting_only(
        name="server_hosts", type=list[str], default=[], check=values.names,
        description="Names besides loopback names, IP addresses and this machine's own name that a "
        "request's Host header may give (`llm mlxs serve` answers others 403, so that a web page "
        "cannot reach it by DNS rebinding); * allows any.",
    ),
    _setting_only(
        name="server_origins", type=list[str], default=[], check=values.names,
        description="Web origins (e.g. http://mytool.lan:3000) whose browser pages may call `llm mlxs "
        "serve`, with CORS; others are answered 403, loopback pages are always allowed; * allows any.",
    ),
    _setting_only(
        name="reply_memory", type=int, default=64, bounds={"ge": 0, "le": 100_000},
        description="Replies `llm mlxs serve` remembers by their text, with the token ids they were "
        "generated as, so a client that sends a reply back as text reuses the KV cache (the least recently "
        "given goes first); 0: none. Read when the server starts.",
    ),
    Knob(
        name="max_batch", type=int, default=4, bounds={"ge": 1, "le": 64},
        description="Most requests decoded together in one pass (continuous batching: they share each MoE "
        "layer's host round-trip and expert reads); 1: one at a time. `llm mlxs serve` runs this many "
        "requests at once; for one request, the largest batch it may join (1: it runs alone).",
    ),
    _setting_only(
        name="max_models", type=int, default=3, bounds={"ge": 1, "le": 64},
        description="Most models `llm mlxs serve` keeps loaded at once, sharing memory_budget: a model that "
        "joins shrinks the others' expert pools (never below top_k slots per layer) before the least recently "
        "used is unloaded; models named with -m at start are never unloaded (`--max-models` for one run).",
    ),
    _setting_only(
        name="keep_alive", type=str, default="-1", check=values.duration,
        description="How long `llm mlxs serve` keeps a model loaded after its last request (seconds, or a "
        "duration like 5m; negative: until it needs the room); a request's keep_alive field wins.",
    ),
    _setting_only(
        name="image_urls", type=Literal[values.IMAGE_URL_MODES], default="off",
        description="on: `llm mlxs serve` fetches an image a request gives as an http(s) URL (bounded by "
        "max_image_bytes and a time limit); off: such a request is refused, and images come inline (data "
        "URLs, base64).",
    ),
    _setting_only(
        name="max_image_bytes", type=int, default=20 * 2**20, check=values.byte_count,
        description="Largest image `llm mlxs serve` takes, inline or fetched (bytes, or a size like 20MiB); "
        "a larger one is refused.",
    ),
    _setting_only(
        name="max_responses", type=int, default=100, bounds={"ge": 1, "le": 100_000},
        description="Responses `llm mlxs serve` keeps for the Responses API's previous_response_id and "
        "GET /v1/responses/ID (with their conversations); past this many the oldest is dropped.",
    ),
    _setting_only(
        name="snapshot_every", type=int, default=4096, bounds={"ge": 0},
        description="A cache that cannot be rewound (linear attention, a sliding window, chunked attention) is "
        "copied while a prompt is prefilled, where its system prompt and earlier turns end and every this many "
        "tokens (0: only there), so a later prompt sharing that prefix resumes inside it instead of reading it "
        "again; such a copy is also a segment of the conversation cache on disk.",
    ),
    _setting_only(
        name="snapshots", type=int, default=16, bounds={"ge": 0, "le": 10_000},
        description="Most prompt snapshots kept in memory (every-N ones go first, those at the end of a system "
        "prompt last); 0: none.",
    ),
    _setting_only(
        name="snapshot_memory", type=str, default="auto", check=values.snapshot_size,
        description="Most memory the prompt snapshots take, part of the memory plan for a model whose cache "
        f"cannot be rewound (`llm mlxs plan`): a size like 1GB, 0 (none), or auto: {values.SNAPSHOT_SHARE:.0%} "
        f"of memory_budget, at most {values.SNAPSHOT_MOST // 2**30} GiB.",
    ),
    _setting_only(
        name="conversation_cache", type=bool, default=True, check=values.parse_switch,
        description="on: save each response's KV cache under <llm user dir>/mlx-streaming/kv-cache, so "
        "`llm -c` in a new process prefills only the new tokens; off: never.",
    ),
    _setting_only(
        name="conversation_cache_size", type=str, default="2GB", check=values.disk_size,
        description="Most disk space the conversation cache takes (least recently used files go first).",
    ),
    _setting_only(
        name="conversation_cache_entries", type=int, default=values.DEFAULT_CONVERSATIONS,
        bounds={"ge": 1, "le": 100_000},
        description="Most conversations the conversation cache keeps, each a chain of files (least recently "
        "used go first): every prompt reads each one's header, so more cost time on every request.",
    ),
)

# The knobs by what they are about (`llm mlxs config` lists them so): each group's title and
# its first knob, in the order of KNOBS.
GROUPS = (("Replies", "default_model"), ("Expert pools", "expert_slots"), ("Speculative decoding", "k"),
          ("Long context", "kv_bits"), ("The server (llm mlxs serve)", "server"),
          ("Prompt snapshots", "snapshot_every"),
          ("The conversation cache on disk", "conversation_cache"))

BY_NAME = {knob.name: knob for knob in KNOBS}


def grouped(names) -> list[tuple[str, list[str]]]:
    """`names` (of knobs) under their groups' titles, in the order of KNOBS."""
    firsts, out = dict((first, title) for title, first in GROUPS), []
    for knob in KNOBS:
        if knob.name in firsts:
            out.append((firsts[knob.name], []))
        if knob.name in names:
            out[-1][1].append(knob.name)
    return [(title, members) for title, members in out if members]
SETTING_NAMES = tuple(k.name for k in KNOBS if k.setting)
OPTION_NAMES = tuple(k.name for k in KNOBS if k.option)


def _validators(knobs) -> dict:
    def make(knob):
        def check(cls, value):
            return value if value is None else knob.check(value)

        return field_validator(knob.name, mode="before")(check)

    return {f"_check_{k.name}": make(k) for k in knobs if k.check}


def settings_fields() -> dict:
    """Pydantic fields of the settings object: every setting with its default."""
    return {k.name: (k.type, Field(k.default, description=k.description, **k.bounds))
            for k in KNOBS if k.setting}


def build_settings(name: str, base, extra_fields: dict):
    knobs = [k for k in KNOBS if k.setting]
    return create_model(
        name, __base__=base, __validators__=_validators(knobs), **settings_fields(), **extra_fields,
    )


def build_options(base, names: Optional[tuple[str, ...]] = None, model_name: str = "Options"):
    """llm's `Options` for the model: every option (or those in `names`), None when not given."""
    knobs = [k for k in KNOBS if k.option and (names is None or k.name in names)]
    fields = {}
    for k in knobs:
        text = k.description + (f" (default: `llm mlxs config {k.name}`)" if k.setting else "")
        fields[k.name] = (Optional[k.type], Field(None, description=text, **k.bounds))
    return create_model(model_name, __base__=base, __validators__=_validators(knobs), **fields)


SETTINGS_CONFIG = ConfigDict(extra="forbid", validate_assignment=True)
