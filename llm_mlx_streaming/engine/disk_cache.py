"""The conversation cache on disk: a response's KV cache, kept for a later process.

Each `llm` command is a new process, so `llm -c` would prefill the whole conversation
again. At the end of a response the engine saves its KV cache with mlx-lm's
`save_prompt_cache` (quantized if the KV is), named by the token prefix it holds:
`<n>-<sha256 of the n token ids>.safetensors`, the ids themselves in its metadata. A
later prompt loads the file that shares the longest prefix with it (`load_prompt_cache`),
cut back to that prefix if it holds more, and prefills only the rest.

Files live in one folder per namespace: the checkpoint's fingerprint (each shard's
inode, ctime, size and sampled bytes: experts/packed.py), the package version and
the KV layout, hashed. Each file also carries that namespace in its metadata and is
checked against it, so a cache from another checkpoint, version or layout is never
loaded; one that cannot be read is removed. Either is a notice on stderr, and the
prompt is simply prefilled. Writes go to a temporary name and are renamed into
place; a saved prefix replaces the shorter ones it extends; the whole tree is kept
under a size bound by evicting the least recently used files.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

FORMAT = "mlx-stream-kv-2"  # 2: the token ids in the metadata
SUFFIX = ".safetensors"
STALE_PARTIAL_SECONDS = 3600


@dataclass(frozen=True)
class DiskCacheSpec:
    """Where conversation caches go and how many bytes they may take in all."""

    root: Path
    max_bytes: int


@dataclass
class Found:
    cache: list
    tokens: list[int]


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("llm-mlx-streaming")
    except PackageNotFoundError:
        return "unknown"


def namespace(checkpoint: Path, kv) -> str:
    """What a cache file must have been made under to be loaded here."""
    from ..experts.packed import fingerprint

    key = {
        "format": FORMAT,
        "version": package_version(),
        "checkpoint": str(checkpoint),
        "fingerprint": fingerprint(checkpoint),
        "kv": [kv.bits, kv.group_size, kv.start] if kv.quantized else None,
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]


def prefix_hash(tokens) -> str:
    return hashlib.sha256(",".join(str(int(t)) for t in tokens).encode()).hexdigest()[:32]


def _entry(path: Path) -> Optional[tuple[int, str]]:
    """(token count, prefix hash) from a cache file's name."""
    name = path.name
    if not name.endswith(SUFFIX) or name.startswith("."):
        return None
    count, _, digest = name[: -len(SUFFIX)].partition("-")
    return (int(count), digest) if count.isdigit() and digest else None


def notice(message: str) -> None:
    print(f"mlx-stream: {message}", file=sys.stderr, flush=True)


class DiskCache:
    def __init__(self, spec: DiskCacheSpec, space: str):
        self.spec = spec
        self.space = space
        self.folder = spec.root / space

    def _entries(self):
        try:
            paths = list(self.folder.iterdir())
        except OSError:
            return []
        return [(entry, p) for p in paths if (entry := _entry(p)) is not None]

    def lookup(self, prompt: list[int], longer_than: int, expected) -> Optional[Found]:
        """The saved cache sharing the longest prefix with `prompt` (shorter than the
        prompt, longer than `longer_than`) that loads and checks out, cut back to that
        prefix when it holds more (a template that re-renders an earlier reply, such
        as one that drops old reasoning, shares only the part before it); `expected` is
        a fresh cache of the model, whose layout a loaded one must have."""
        from mlx_lm.utils import common_prefix_len

        candidates = []
        for (n, digest), path in self._entries():
            header = _saved_header(path)
            if header is not None and header[0] != self.space:
                notice(f"conversation cache {path.name} was made for another checkpoint, version or KV layout; ignored")
                continue
            held = header[1] if header is not None else None
            if held is None or len(held) != n or prefix_hash(held) != digest:
                notice(f"conversation cache {path.name} cannot be read or does not match its name; removed")
                _remove(path)
                continue
            shared = min(common_prefix_len(held, prompt), len(prompt) - 1)
            if shared > longer_than:
                candidates.append((shared, -n, path))
        for shared, minus_n, path in sorted(candidates, reverse=True):
            cache = self._load(path, -minus_n, expected)
            if cache is not None and shared < -minus_n:
                cache = _cut(cache, -minus_n - shared)
            if cache is not None:
                try:
                    os.utime(path)  # recently used
                except OSError:
                    pass
                return Found(cache, list(prompt[:shared]))
        return None

    def _load(self, path: Path, n: int, expected) -> Optional[list]:
        from mlx_lm.models.cache import load_prompt_cache

        from .kv import after_loading, same_layout

        try:
            cache, meta = load_prompt_cache(str(path), return_metadata=True)
        except Exception as exc:  # truncated, not safetensors, unknown cache class
            notice(f"conversation cache {path.name} cannot be read ({_short(exc)}); removed")
            _remove(path)
            return None
        if meta.get("namespace") != self.space or meta.get("format") != FORMAT:
            notice(f"conversation cache {path.name} was made for another checkpoint, version or KV layout; ignored")
            return None
        cache = after_loading(cache, expected)  # long context (#13): our window class back
        shapes_match = same_layout(cache, expected)
        offsets = {getattr(c, "offset", n) for c in cache}
        if meta.get("tokens") != str(n) or not shapes_match or offsets - {n}:
            notice(f"conversation cache {path.name} does not match its name or this model; removed")
            _remove(path)
            return None
        return cache

    def save(self, cache, tokens: list[int]) -> int:
        """Write `cache` (which has seen exactly `tokens`) atomically; drop the saved
        prefixes it extends; keep the tree under its size bound. Returns the bytes written."""
        from mlx_lm.models.cache import save_prompt_cache

        from .kv import for_saving

        cache = for_saving(cache)  # long context (#13): only classes load_prompt_cache knows
        n = len(tokens)
        digest = prefix_hash(tokens)
        self.folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=".partial-", suffix=SUFFIX)
        os.close(fd)
        try:
            save_prompt_cache(tmp, cache, {"format": FORMAT, "namespace": self.space, "tokens": str(n),
                                           "token_ids": json.dumps([int(t) for t in tokens])})
            final = self.folder / f"{n}-{digest}{SUFFIX}"
            os.replace(tmp, final)
        except BaseException:
            _remove(Path(tmp))
            raise
        for (m, other), path in self._entries():
            if m < n and other == prefix_hash(tokens[:m]):
                _remove(path)
        size = final.stat().st_size
        evict(self.spec.root, self.spec.max_bytes)
        return size


def _saved_header(path: Path) -> Optional[tuple[Optional[str], list[int]]]:
    """(namespace, token ids) of a cache file, from its safetensors header alone."""
    try:
        with open(path, "rb") as fh:
            size = int.from_bytes(fh.read(8), "little")
            if not 0 < size < 64 * 2**20:
                return None
            header = json.loads(fh.read(size))
        # save_prompt_cache flattens its metadata into the header ("1.token_ids")
        meta = {k.split(".")[-1]: v for k, v in header["__metadata__"].items()}
        ids = json.loads(meta["token_ids"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if not (isinstance(ids, list) and all(isinstance(t, int) for t in ids)):
        return None
    return meta.get("namespace"), ids


def _cut(cache, count: int) -> Optional[list]:
    """`cache` without its last `count` tokens, or None where a layer cannot be cut
    (a linear-attention state is only ever extended)."""
    from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

    if not can_trim_prompt_cache(cache):
        return None
    trim_prompt_cache(cache, count)
    return cache


def evict(root: Path, max_bytes: int) -> None:
    """Remove the least recently used cache files until the tree fits `max_bytes`."""
    files = []
    for path in root.glob(f"*/.partial-*{SUFFIX}"):  # left by a process killed mid-write
        try:
            if time.time() - path.stat().st_mtime > STALE_PARTIAL_SECONDS:
                _remove(path)
        except OSError:
            continue
    for path in root.glob(f"*/*{SUFFIX}"):
        try:
            st = path.stat()
        except OSError:
            continue
        files.append((st.st_mtime, st.st_size, path))
    total = sum(size for _, size, _ in files)
    for _, size, path in sorted(files, key=lambda f: f[0]):
        if total <= max_bytes:
            break
        _remove(path)
        total -= size


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def _short(exc: BaseException) -> str:
    from ..errors import one_line

    text = one_line(exc)
    return text if len(text) <= 120 else text[:117] + "..."
