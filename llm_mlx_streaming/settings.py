"""Plugin settings: one typed object, one JSON file under ``llm.user_dir()``.

One file and no environment variables, so that ``llm mlxs config`` can show every
knob, validate it with pydantic and write it back, and a setting cannot silently
differ between two shells. The same file holds the registry of user-added models
(``models``), which ``config`` does not list. Only keys the user set are written, so
"is this the default?" is "is the key absent from the file?".
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from typing import Literal, Optional, Union

import llm
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .engine.kv import KV_BITS, KV_GROUP_SIZES, KVError, parse_bits
from .engine.planner import DEFAULT_MAX_CONTEXT
from .errors import SettingsError
from .experts.policies import DEFAULT_POLICY, POLICIES as POLICY_CLASSES
from .experts.store import DEFAULT_THREADS, PAGE_CACHE_MODES
from .sizes import parse_size

SETTINGS_FILENAME = "mlx-streaming.json"
BUNDLED_NAME = "tiny-moe"
POLICIES = tuple(POLICY_CLASSES)
Policy = Literal[POLICIES]
PageCache = Literal[PAGE_CACHE_MODES]
Packed = Literal["auto", "off"]
AUTO_BUDGET_SHARE = 0.6  # memory_budget "auto": this share of physical memory
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class ModelEntry(BaseModel):
    """One user-added model: where its checkpoint lives and what it is called."""

    model_config = ConfigDict(extra="ignore")

    path: str = Field(description="Local mlx-lm checkpoint directory")
    source: Optional[str] = Field(
        None, description="What was passed to `llm mlxs add` (a path or HF repo id)"
    )
    aliases: list[str] = Field(default_factory=list)
    expert_slots: Optional[int] = Field(
        None, ge=1, description="Per-model pool size; overrides the global setting"
    )


def parse_switch(value):
    """on/off, true/false, yes/no, 1/0 (any case) -> bool; other strings: ValueError."""
    if isinstance(value, str):
        word = value.strip().lower()
        if word in ("on", "true", "yes", "1"):
            return True
        if word in ("off", "false", "no", "0"):
            return False
        raise ValueError("use on or off")
    return value


def normalize_budget(value) -> str:
    """A memory_budget value as stored: "auto" or a size string; ValueError if neither."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ValueError("a size like 12GB, or auto")
    try:
        size = parse_size(value)
    except ValueError:
        raise ValueError("not a size; use e.g. 12GB, 12G, 1.5GiB, 512MB, or auto") from None
    if size <= 0:
        raise ValueError("must be more than 0 bytes")
    return str(value).strip()


def normalize_kv_bits(value):
    """"off" or a bit count (4, 8), from "off", "4", 4, None; ValueError otherwise."""
    try:
        bits = parse_bits(value)
    except KVError as exc:
        raise ValueError(str(exc).removeprefix("kv_bits ")) from None
    return "off" if bits is None else bits


def normalize_kv_group_size(value):
    try:
        size = int(value) if isinstance(value, str) else value
    except ValueError:
        size = value
    if isinstance(size, bool) or size not in KV_GROUP_SIZES:
        raise ValueError(f"must be one of {', '.join(map(str, KV_GROUP_SIZES))}")
    return size


def normalize_draft(value) -> str:
    """A drafter's name, stripped; "" is refused, not read as the default."""
    if not isinstance(value, str) or not NAME_RE.match(value.strip()):
        raise ValueError("a drafter: ngram, mtp, or the name of an added model")
    return value.strip()


MIN_PREFILL_STEP = 16


def normalize_prefill_step(value):
    """"auto" or a token count of at least MIN_PREFILL_STEP."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    try:
        step = int(value) if isinstance(value, str) else value
    except ValueError:
        raise ValueError("a token count, or auto") from None
    if isinstance(step, bool) or not isinstance(step, int) or step < MIN_PREFILL_STEP:
        raise ValueError(f"a token count of at least {MIN_PREFILL_STEP}, or auto")
    return step


class Settings(BaseModel):
    """Everything the plugin can be told. Add new knobs here, with a description."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    default_model: Optional[str] = Field(
        None,
        description=(
            "Model served by `-m mlx-stream`: a name from `llm mlxs models`. "
            f"Unset: the bundled demo checkpoint '{BUNDLED_NAME}'."
        ),
    )
    expert_slots: Optional[int] = Field(
        None,
        ge=1,
        description=(
            "Expert slots per MoE layer kept in memory (the rest stream from disk), "
            "for models added without --expert-slots. "
            f"Unset: 8 for '{BUNDLED_NAME}'; other models get what memory_budget allows."
        ),
    )
    policy: Optional[Policy] = Field(
        None,
        description=f"Eviction policy when the pool is full: {', '.join(POLICIES)}. "
        f"Unset: the engine's default ({DEFAULT_POLICY}).",
    )
    max_tokens: int = Field(
        256, ge=-1,
        description="Most tokens generated per response (-o max_tokens); 0 or -1: "
        "until the context (max_context) is full.",
    )
    memory_budget: str = Field(
        "auto",
        description=(
            "Memory for the model when no expert_slots is set: dense weights, KV cache "
            "for max_context tokens, a reserve and as many expert slots as fit "
            "(`llm mlxs plan`). A size like 12GB, 12G, 1.5GiB, or auto: "
            f"{AUTO_BUDGET_SHARE:.0%} of this machine's physical memory."
        ),
    )
    max_context: int = Field(
        DEFAULT_MAX_CONTEXT,
        ge=1,
        description=(
            "Longest conversation (prompt + reply, in tokens) the KV cache is planned for; "
            "longer prompts are refused and replies stop there."
        ),
    )
    threads: int = Field(
        DEFAULT_THREADS, ge=1, le=256, description="Threads reading experts from disk."
    )
    page_cache: PageCache = Field(
        "keep",
        description=(
            "keep: expert reads go through the OS page cache (a free second tier); "
            "bypass: keep them out of it (macOS F_NOCACHE, Linux fadvise DONTNEED)."
        ),
    )
    trace: bool = Field(
        False,
        description=(
            "Record each response's expert routing to "
            "<llm user dir>/mlx-streaming/traces/<model>.jsonl, for `llm mlxs simulate`."
        ),
    )
    packed: Packed = Field(
        "auto",
        description=(
            "auto: read experts from the model's packed store (`llm mlxs pack`) when "
            "one is present and valid; off: always read the safetensors."
        ),
    )
    # -- speculation ----------------------------------------------------
    k: Union[Literal["auto"], int] = Field(
        0,
        description=(
            "Draft tokens verified per pass of the big model (speculative decoding); "
            "0: off (plain decoding); auto: adapt to how often drafts are accepted."
        ),
    )
    draft: str = Field(
        "ngram",
        description=(
            "Who drafts when k > 0: ngram (look the last tokens up in the conversation), "
            "mtp (the checkpoint's own multi-token-prediction head), or the name of a "
            "small model added with `llm mlxs add` that shares the big model's vocabulary."
        ),
    )
    # -- long context (engine/kv.py, docs/llm-plugin.md "Long context") --
    kv_bits: Union[Literal["off"], int] = Field(
        "off",
        description=(
            f"Quantize the KV cache to {' or '.join(map(str, KV_BITS))} bits (off: full precision), "
            "as mlx-lm's kv_bits does; a quantized cache leaves the memory plan more expert slots."
        ),
    )
    kv_group_size: int = Field(
        64, description=f"Values per quantization group of the KV cache: {', '.join(map(str, KV_GROUP_SIZES))}."
    )
    kv_start: int = Field(
        0, ge=0, description="Tokens the KV cache holds before it is quantized (mlx-lm's quantized_kv_start)."
    )
    prefill_step: Union[Literal["auto"], int] = Field(
        "auto",
        description=(
            "Prompt tokens per prefill chunk; each expert is read at most once per chunk. "
            "auto: as large as the memory budget allows."
        ),
    )
    # -- llm mlxs serve ------------------------------------------------
    server: Literal["auto", "off"] = Field(
        "auto",
        description=(
            "auto: when `llm mlxs serve` runs for this llm user dir, prompts go to it "
            "(its warm engine); off: always run in this process (-o no_server 1 for one prompt)."
        ),
    )
    # -- the conversation cache on disk (engine/disk_cache.py) ------
    conversation_cache: bool = Field(
        True,
        description=(
            "on: save each response's KV cache under <llm user dir>/mlx-streaming/kv-cache, "
            "so `llm -c` in a new process prefills only the new tokens; off: never."
        ),
    )
    conversation_cache_size: str = Field(
        "2GB",
        description="Most disk space the conversation cache takes (least recently used files go first).",
    )
    models: dict[str, ModelEntry] = Field(
        default_factory=dict,
        description="User-added models (managed by `llm mlxs add/remove`).",
    )


    @field_validator("k", mode="before")
    @classmethod
    def _check_k(cls, value):
        from .speculation.start import check_k

        return check_k(value)

    @field_validator("draft", mode="before")
    @classmethod
    def _check_draft(cls, value):
        return normalize_draft(value)

    @field_validator("memory_budget", mode="before")
    @classmethod
    def _check_budget(cls, value):
        return normalize_budget(value)

    @field_validator("kv_bits", mode="before")
    @classmethod
    def _check_kv_bits(cls, value):
        return normalize_kv_bits(value)

    @field_validator("kv_group_size", mode="before")
    @classmethod
    def _check_kv_group_size(cls, value):
        return normalize_kv_group_size(value)

    @field_validator("prefill_step", mode="before")
    @classmethod
    def _check_prefill_step(cls, value):
        return normalize_prefill_step(value)

    @field_validator("trace", mode="before")
    @classmethod
    def _check_trace(cls, value):
        return parse_switch(value)

    @field_validator("conversation_cache", mode="before")
    @classmethod
    def _check_conversation_cache(cls, value):
        return parse_switch(value)

    @field_validator("conversation_cache_size", mode="before")
    @classmethod
    def _check_conversation_cache_size(cls, value):
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            raise ValueError("a size like 2GB or 500MB")
        try:
            size = parse_size(value)
        except ValueError:
            raise ValueError("not a size; use e.g. 2GB, 500MB, 1.5GiB") from None
        if size < 0:
            raise ValueError("must be 0 bytes or more")
        return str(value).strip()


# Settings shown and edited by `llm mlxs config` (the registry is managed by
# its own commands).
CONFIG_KEYS = tuple(k for k in Settings.model_fields if k != "models")


def physical_memory() -> int | None:
    """Bytes of physical memory (Linux and macOS), or None where unknown."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        pass
    try:  # pragma: no cover - macOS without SC_PHYS_PAGES
        import subprocess

        out = subprocess.run(["sysctl", "-n", "hw.memsize"], capture_output=True, text=True)
        return int(out.stdout.strip())
    except (OSError, ValueError):
        return None


def budget_bytes(value: str) -> int:
    """A memory_budget value in bytes ("auto": a share of physical memory)."""
    if value == "auto":
        total = physical_memory()
        if not total:
            raise SettingsError(
                "Cannot tell this machine's memory size: set memory_budget, e.g. "
                "`llm mlxs config memory_budget 12GB`"
            )
        return int(total * AUTO_BUDGET_SHARE)
    return parse_size(value)


def conversation_cache_spec(settings: "Settings"):
    """Where and how large the conversation cache on disk is (None: it is off)."""
    from .engine.disk_cache import DiskCacheSpec

    if not settings.conversation_cache:
        return None
    return DiskCacheSpec(llm.user_dir() / "mlx-streaming" / "kv-cache", parse_size(settings.conversation_cache_size))


def traces_dir() -> Path:
    return llm.user_dir() / "mlx-streaming" / "traces"


def trace_file(name: str) -> Path:
    """Where routing traces of model `name` are appended when `trace` is on."""
    return traces_dir() / f"{name}.jsonl"


def settings_path() -> Path:
    return llm.user_dir() / SETTINGS_FILENAME


def _reason(exc: ValidationError) -> str:
    msg = exc.errors()[0].get("msg", "invalid value")
    return msg.removeprefix("Value error, ")


def first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err.get("loc", ())) or "value"
    return f"{where}: {_reason(exc)}"


def load_settings() -> Settings:
    """Read the settings file; a missing file means all defaults."""
    path = settings_path()
    if not path.exists():
        return Settings()
    try:
        data = json.loads(path.read_text() or "{}")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SettingsError(
            f"Settings file {path} is not valid JSON ({exc}); fix or delete it"
        ) from None
    if not isinstance(data, dict):
        raise SettingsError(f"Settings file {path} must hold a JSON object")
    try:
        return Settings.model_validate(data)
    except ValidationError as exc:
        raise SettingsError(
            f"Settings file {path} is invalid: {first_error(exc)}"
        ) from None


def save_settings(settings: Settings) -> Path:
    """Write only the keys that differ from the defaults, atomically.

    A folder or file that cannot be written is one line naming it; the old file
    stays as it was."""
    path = settings_path()
    data = settings.model_dump(mode="json", exclude_defaults=True)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".mlx-streaming-")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
        os.replace(tmp, path)
    except OSError as exc:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        reason = exc.strerror or str(exc)
        raise SettingsError(f"Cannot write the settings file {path}: {reason}") from None
    return path


def explicit_keys() -> set[str]:
    """Keys present in the settings file (i.e. not at their default)."""
    settings = load_settings()
    return set(settings.model_dump(exclude_defaults=True))


def check_key(key: str) -> None:
    """A SettingsError unless `key` is one `llm mlxs config` shows."""
    if key not in CONFIG_KEYS:
        raise SettingsError(f"Unknown setting '{key}'. Settings: {', '.join(CONFIG_KEYS)}")


def set_value(key: str, raw: object, settings: Settings | None = None) -> Settings:
    """Validate `raw` (a command-line string) for `key` and save it."""
    check_key(key)
    settings = settings or load_settings()
    try:
        setattr(settings, key, raw)
    except ValidationError as exc:
        raise SettingsError(f"Invalid value for {key}: {raw!r} ({_reason(exc)})") from None
    save_settings(settings)
    return settings


def unset_value(key: str) -> Settings:
    check_key(key)
    settings = load_settings()
    setattr(settings, key, Settings.model_fields[key].get_default(call_default_factory=True))
    save_settings(settings)
    return settings
