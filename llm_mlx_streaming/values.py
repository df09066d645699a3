"""What each knob accepts: the parsing and range checks that settings, options and the
engine share.

At the bottom of the package, so the settings file, `-o` options, the server's request
fields and the engine's own specs refuse exactly the same values with the same words.
Each check takes what a user typed (a string on the command line, a JSON value in a
file or a request body) and returns the value as stored, or raises ValueError with the
reason in one line.
"""

from __future__ import annotations

import json
import re

from .sizes import given_size, parse_size

DEFAULT_MAX_CONTEXT = 4096  # tokens of KV cache planned for when neither a number nor the model says
KV_SHARE = 0.25  # max_context auto: the KV cache takes at most this share of the memory budget
DEFAULT_CONVERSATIONS = 256  # conversations the conversation cache keeps: each prompt reads every one's header
KV_BITS = (4, 8)  # others are refused until measured on real models (docs/benchmarks.md, "Long context")
KV_GROUP_SIZES = (32, 64, 128)  # the group sizes mx.quantize accepts
MAX_K = 32  # a pass of more positions than this is a prefill, not a verification
MIN_PREFILL_STEP = 16
ROUTES_AT_ONCE = 8192  # experts/switch.py computes a long call's expert routes this many at a time; the planner counts them
OVERLAP_MODES = ("auto", "on", "off")  # experts/prefetch.py: when decode reads overlap compute
PAGE_CACHE_MODES = ("keep", "bypass")  # experts/store.py: whether reads go through the OS page cache
IMAGE_URL_MODES = ("off", "on")  # server/images.py: whether the server fetches an image's http(s) URL
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def one_of(name: str, value, choices) -> str:
    """`value` if it is one of `choices`, else a ValueError naming them."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    return value


def at_least_one(name: str, value) -> int:
    """`value` if it is an integer of at least 1, else a ValueError."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an integer of at least 1, got {value!r}")
    return value


def max_context(value):
    """A max_context as stored: "auto" or a number of tokens (at least 1)."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    try:
        tokens = int(value)
    except (TypeError, ValueError):
        raise ValueError("use auto or a number of tokens") from None
    if tokens < 1:
        raise ValueError("a context holds at least 1 token")
    return tokens


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


def budget(value) -> str:
    """A memory_budget as stored: "auto" or a size string."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    return _size(value, "12GB, 12G, 1.5GiB, 512MB, or auto", allow_zero=False)


def buffer_size(value) -> str:
    """A buffer_cache as stored: "auto" or a size (0: MLX keeps no freed buffer)."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    return _size(value, "256MB, 1GB, 0, or auto", allow_zero=True)


def snapshot_size(value) -> str:
    """A snapshot_memory as stored: "auto" or a size (0: no snapshots)."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    return _size(value, "1GB, 500MB, 0, or auto", allow_zero=True)


SNAPSHOT_SHARE, SNAPSHOT_MOST = 0.05, 2 * 2**30  # snapshot_memory auto: this share of the budget, at most this


def disk_size(value) -> str:
    """A size on disk as stored (0 allowed)."""
    return _size(value, "2GB, 500MB, 1.5GiB", allow_zero=True)


def byte_count(value) -> int:
    """A size as bytes (a number of bytes, or a size like 20MiB), more than 0."""
    return parse_size(_size(value, "20MiB, 5MB, 1048576", allow_zero=False, unit="MB"))


def _size(value, examples: str, allow_zero: bool, unit: str = "GB") -> str:
    """A size as stored; a number without a unit too small to be meant is refused with the
    `unit` it likely meant (sizes.given_size)."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ValueError(f"a size like {examples}")
    try:
        parse_size(value)
    except ValueError:
        raise ValueError(f"not a size; use e.g. {examples}") from None
    size = given_size(value, unit)
    if size < 0 or (size == 0 and not allow_zero):
        raise ValueError("must be 0 bytes or more" if allow_zero else "must be more than 0 bytes")
    return str(value).strip()


def kv_bits(value):
    """None (full precision) or a bit count, from "off", "4", 4, None."""
    if value is None:
        return None
    if isinstance(value, str):
        word = value.strip().lower()
        if word in ("off", "none", "16", ""):
            return None
        try:
            value = int(word)
        except ValueError:
            raise ValueError(f"must be off, {' or '.join(map(str, KV_BITS))}, got {value!r}") from None
    if isinstance(value, bool) or value not in KV_BITS:
        raise ValueError(f"must be off, {' or '.join(map(str, KV_BITS))}, got {value!r}")
    return value


def stored_kv_bits(value):
    """kv_bits as a setting or an option holds it: "off" or a bit count."""
    bits = kv_bits(value)
    return "off" if bits is None else bits


def kv_group_size(value) -> int:
    try:
        size = int(value) if isinstance(value, str) else value
    except ValueError:
        size = value
    if isinstance(size, bool) or size not in KV_GROUP_SIZES:
        raise ValueError(f"must be one of {', '.join(map(str, KV_GROUP_SIZES))}, got {value!r}")
    return size


def kv_start(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"must be a token count of at least 0, got {value!r}")
    return value


def k(value) -> "int | str":
    """k as the engine uses it: a whole number 0..MAX_K or "auto"."""
    number = None
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "auto":
            return "auto"
        if text.isdigit():
            number = int(text)
    elif isinstance(value, int) and not isinstance(value, bool):
        number = value
    if number is not None and 0 <= number <= MAX_K:
        return number
    raise ValueError(f"k must be a whole number of draft tokens from 0 (off) to {MAX_K}, or auto; got {value!r}")


def draft(value) -> str:
    """A drafter's name, stripped; "" is refused, not read as the default."""
    if not isinstance(value, str) or not NAME_RE.match(value.strip()):
        raise ValueError("a drafter: ngram, mtp, or the name of an added model")
    return value.strip()


def prefill_step(value):
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


def stop(value):
    """One string, a list of strings, or a JSON list given as a string."""
    if value is None:
        return None
    if isinstance(value, str) and value.lstrip().startswith("["):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise ValueError("a JSON list of strings must parse, e.g. '[\"END\", \"\\n\\n\"]'") from None
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise ValueError("a string, or a JSON list of strings")
    if not items or any(s == "" for s in items):
        raise ValueError("stop sequences must not be empty")
    return items


EFFORTS = ("none", "minimal", "low", "medium", "high")  # OpenAI's levels; none and minimal: no thinking


def effort(value):
    """A reasoning effort level, as OpenAI names them."""
    if not isinstance(value, str) or value.strip().lower() not in EFFORTS:
        raise ValueError(f"use one of {', '.join(EFFORTS)}")
    return value.strip().lower()


def tool_choice(value):
    """auto, none, required, or a tool's name (checked against the tools when they are known)."""
    if isinstance(value, str) and not value.strip():
        raise ValueError("use auto, none, required or a tool's name")
    return value.strip() if isinstance(value, str) else value


def names(value) -> list[str]:
    """A list of names as stored: a JSON list, or one string of comma-separated names."""
    if isinstance(value, str):
        text = value.strip()
        value = json.loads(text) if text.startswith("[") else text.split(",")
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError('use comma-separated names, e.g. "mymac.local,studio.lan"')
    found = [v.strip() for v in value if v.strip()]
    if any(any(c.isspace() for c in v) for v in found):
        raise ValueError("a name has no spaces in it; separate names with commas")
    return found


_DURATION = re.compile(r"^(-?\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)?$")
_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1, "m": 60, "h": 3600, None: 1}


def duration_seconds(value) -> float:
    """Seconds of a duration as Ollama's keep_alive gives one (a number of seconds, or like
    5m; negative: forever); ValueError if not one."""
    if isinstance(value, (int, float)):
        return float(value)
    match = _DURATION.match(str(value).strip())
    if not match:
        raise ValueError(f"{value!r} is not a duration (like 0, 5m, -1)")
    return float(match.group(1)) * _SECONDS[match.group(2)]


def duration(value) -> str:
    """A keep_alive setting, kept as typed."""
    duration_seconds(value)
    return str(value)
