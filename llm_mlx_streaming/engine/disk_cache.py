"""The conversation cache on disk: a response's KV cache, kept for a later process.

Each `llm` command is a new process, so `llm -c` would prefill the whole conversation
again. At the end of a response the engine saves its KV cache with mlx-lm's
`save_prompt_cache` (quantized if the KV is), as a chain of segment files, each named
by the token prefix it completes: `<n>-<sha256 of the n token ids>.safetensors`. A
first segment holds the whole cache; a later one only what its turn added: the
attention layers' K/V of its own token range (`layers` in its metadata gives each
layer's first position), the token ids of that range, and the name and checksum of
the segment it extends. Layers that are not a growing sequence (a sliding window, a
linear-attention state) are bounded and written in full in every segment; so is a
layer whose class changed since (a KVCache quantized at kv_start). A response writes
a segment only on a chain this process wrote or loaded the same cache from (each
conversation the model's prompt cache holds has its own), up to the tokens the turn
did not feed again; otherwise it writes a first segment.

Every segment carries a sha256 of its tensors (each state entry's name, dtype, shape
and bytes), checked on load. A later prompt loads the chain that shares the longest
prefix with it, concatenating the segments along the sequence axis, cut back to that
prefix if it holds more, and prefills only the rest. A segment that cannot be read,
fails its checksum or does not fit the one before is removed with a one-line notice,
and so are the segments after it; the prompt then falls back on a shorter chain or
is simply prefilled.

Files live in one folder per namespace: the checkpoint's fingerprint (each shard's
inode, ctime, size and sampled bytes: experts/packed.py), the package version and
the KV layout, hashed. Each file also carries that namespace in its metadata and is
checked against it, so a cache from another checkpoint, version or layout is never
loaded (a notice). Writes go to a temporary name and are renamed into place; a saved
chain replaces the shorter ones its tokens extend (all but its own segments and those
another segment still extends); the whole tree is kept under a size and a count of
conversations by evicting the least recently used ones, each with all its segments
(a prompt reads every file's header, so the count bounds what each request costs). A
cache with a layer that cannot be cut back keeps the shorter chains: each is where a
later prompt can resume.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import weakref
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .cache_files import SUFFIX, Header, evict, name_entry, prefix_hash, remove, saved_header
from .kv_segments import assembled, checksum, cut, layer_kind, segment_from
from ..errors import one_line
from ..values import DEFAULT_CONVERSATIONS
from .kv import after_loading, for_saving, same_layout

FORMAT = "mlx-stream-kv-3"  # 3: segments, each with a checksum of its tensors


@dataclass(frozen=True)
class DiskCacheSpec:
    """Where conversation caches go, and how many bytes and conversations they may take in all."""

    root: Path
    max_bytes: int
    max_entries: int = DEFAULT_CONVERSATIONS


@dataclass
class Found:
    cache: list
    tokens: list[int]


@dataclass(frozen=True)
class _Link:
    """A segment of the chain the in-process cache was written to or loaded from."""

    end: int  # the tokens the chain holds up to and with this segment
    name: str
    checksum: str
    kinds: tuple  # each layer's `layer_kind` there: what a next segment may append to


@dataclass
class _Mirror:
    """Which chain on disk a conversation's cache layers (held weakly: a dropped cache is
    freed) hold `tokens` of."""

    layers: tuple  # weakref.ref to each layer object
    tokens: list[int]
    links: list[_Link]

    @classmethod
    def of(cls, cache, tokens, links) -> "_Mirror":
        return cls(tuple(weakref.ref(c) for c in cache), list(tokens), links)

    def same(self, cache) -> list[bool]:
        """Per layer, whether `cache` still has the layer object this chain was made from
        (one the quantization step replaced, or a new cache, does not)."""
        if len(cache) != len(self.layers):
            return [False] * len(cache)
        return [ref() is c for ref, c in zip(self.layers, cache)]

    def alive(self) -> bool:
        return any(ref() is not None for ref in self.layers)


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


def notice(message: str) -> None:
    print(f"mlx-stream: {message}", file=sys.stderr, flush=True)


class DiskCache:
    def __init__(self, spec: DiskCacheSpec, space: str):
        self.spec = spec
        self.space = space
        self.folder = spec.root / space
        self._mirrors: list[_Mirror] = []  # one per conversation cache still held, the model's prompt cache's
        self.bytes: Optional[int] = None  # the whole tree's, after the last save's eviction
        self.entries: Optional[int] = None  # conversations in the tree, likewise

    def _entries(self):
        try:
            paths = list(self.folder.iterdir())
        except OSError:
            return []
        return [(entry, p) for p in paths if (entry := name_entry(p)) is not None]

    def _chains(self) -> dict[str, tuple[list[str], list[Header]]]:
        """{file name: (its chain's file names, their headers), first segment first}
        for every file here whose chain checks out by name, token ids and checksum
        links. A foreign file is a notice; one whose header cannot be read or whose
        tokens do not match its name is removed with one; one extending a segment that
        is gone, foreign or replaced is removed quietly (that segment had its notice,
        or was evicted)."""
        files = []
        for (n, digest), path in self._entries():
            header = saved_header(path)
            if header is not None and header.space != self.space:
                notice(f"conversation cache {path.name} was made for another checkpoint, version or KV layout; ignored")
            elif header is None:
                notice(f"conversation cache {path.name} cannot be read or does not match its name; removed")
                remove(path)
            else:
                files.append((n, digest, path, header))
        chains: dict[str, tuple[list[str], list[Header]]] = {}
        hashes: dict[str, tuple[object, int]] = {}  # prefix_hash's state, and its token count
        for n, digest, path, header in sorted(files, key=lambda f: f[0]):  # a parent before its children
            if header.parent:
                before = chains.get(header.parent)
                if before is None or before[1][-1].checksum != header.parent_checksum:
                    remove(path)
                    continue
                names, headers = before
                running, count = hashes[header.parent]
            else:
                names, headers, running, count = [], [], hashlib.sha256(), 0
            running = running.copy()
            running.update(("," if count and header.ids else "").encode() + ",".join(map(str, header.ids)).encode())
            count += len(header.ids)
            if count != n or running.hexdigest()[:32] != digest:
                notice(f"conversation cache {path.name} cannot be read or does not match its name; removed")
                remove(path)
                continue
            chains[path.name] = (names + [path.name], headers + [header])
            hashes[path.name] = (running, count)
        return chains

    def lookup(self, prompt: list[int], longer_than: int, expected) -> Optional[Found]:
        """The saved cache sharing the longest prefix with `prompt` (shorter than the
        prompt, longer than `longer_than`) that loads and checks out, cut back to that
        prefix when it holds more (a template that re-renders an earlier reply, such
        as one that drops old reasoning, shares only the part before it); `expected` is
        a fresh cache of the model, whose layout a loaded one must have."""
        chains = self._chains()
        candidates = []
        for name, (names, headers) in chains.items():
            shared = min(_shared(headers, prompt), len(prompt) - 1)
            if shared > longer_than:
                candidates.append((shared, -sum(len(h.ids) for h in headers), name))
        dead: set[str] = set()  # removed while loading: so is whatever extends them
        for shared, minus_n, name in sorted(candidates, reverse=True):
            names, _ = chains[name]
            if dead.intersection(names):
                dead.add(name)
                remove(self.folder / name)
                continue
            loaded = self._load(names, -minus_n, expected, dead)
            if loaded is None:
                continue
            cache, links = loaded
            if shared < -minus_n:
                cache = cut(cache, -minus_n, shared)
            if cache is None:
                continue
            for segment in names:
                try:
                    os.utime(self.folder / segment)  # recently used
                except OSError:
                    pass
            self._keep(cache, prompt[:shared], links)
            return Found(cache, list(prompt[:shared]))
        return None

    def _load(self, names: list[str], n: int, expected, dead: set[str]) -> Optional[tuple[list, list[_Link]]]:
        """The cache the chain `names` holds (n tokens) and its links, or None; a segment
        that fails is removed with those after it, and they go into `dead`."""
        from mlx_lm.models.cache import load_prompt_cache

        parts, links, end = [], [], 0
        for i, name in enumerate(names):
            path = self.folder / name
            try:
                cache, meta = load_prompt_cache(str(path), return_metadata=True)
            except Exception as exc:  # truncated, not safetensors, unknown cache class
                notice(f"conversation cache {name} cannot be read ({_short(exc)}); removed")
                return self._dead(names[i:], dead)
            if meta.get("namespace") != self.space or meta.get("format") != FORMAT:
                notice(f"conversation cache {name} was made for another checkpoint, version or KV layout; ignored")
                return None
            if checksum(cache) != meta.get("checksum"):
                notice(f"conversation cache {name} does not match its checksum (damaged); removed")
                return self._dead(names[i:], dead)
            try:
                starts = json.loads(meta["layers"])
                end = int(meta["tokens"])
            except (KeyError, ValueError):
                starts = None
            if not isinstance(starts, list):
                notice(f"conversation cache {name} does not match its name or this model; removed")
                return self._dead(names[i:], dead)
            parts.append((cache, starts))
            links.append(_Link(end, name, meta["checksum"], tuple(layer_kind(c) for c in cache)))
        cache = assembled(parts)
        if cache is not None:
            cache = after_loading(cache, expected)  # our sliding-window class back (engine/kv_window.py)
        offsets = {getattr(c, "offset", n) for c in cache or ()}
        if cache is None or end != n or not same_layout(cache, expected) or offsets - {n}:
            notice(f"conversation cache {names[-1]} does not match its name or this model; removed")
            return self._dead(names[-1:], dead)
        return cache, links

    def _dead(self, names: list[str], dead: set[str]) -> None:
        for name in names:
            dead.add(name)
            remove(self.folder / name)
        return None

    def save(self, cache, tokens: list[int], kept: int, snapshots=()) -> int:
        """Write `cache`, which has seen exactly `tokens`, the first `kept` of them
        before this response: as a segment on the chain this process wrote or loaded it
        from where there is one, else whole; before it, a segment ending at each of
        `snapshots` ((position, the cache as it was there), engine/snapshots.py) past
        that chain, so a prompt that shares only that much resumes there; drop the saved
        chains it extends; keep the tree under its size bound. Returns the bytes written."""
        mirror = next((m for m in self._mirrors if any(m.same(cache))), None)
        links = self._base(mirror, tokens, kept)
        same = mirror.same(cache) if links else [False] * len(cache)
        end = links[-1].end if links else 0
        size, own = 0, set()
        for position, part in [*((p, c) for p, c in snapshots if end < p < len(tokens)), (len(tokens), cache)]:
            links, written = self._write(part, tokens[:position], links, same)
            same, size = [True] * len(cache), size + written  # the next segment extends this one
            own.update(link.name for link in links)  # a chain that starts over keeps the snapshots before it
        self._keep(cache, tokens, links)
        if all(kind is not None for kind in links[-1].kinds):  # every layer grows: a longer chain serves a shorter one
            self._prune(tokens, own)
        self.bytes, self.entries = evict(self.spec.root, self.spec.max_bytes, self.spec.max_entries)
        return size

    def _write(self, cache, tokens: list[int], links: list[_Link], same: list[bool]) -> tuple[list[_Link], int]:
        """One segment: `cache` (which has seen `tokens`) past the chain `links`, its
        growing layers appended where `same` says the chain holds their earlier positions;
        a file of that name and checksum already there is kept. Returns the chain's links
        and the bytes written."""
        import mlx.core as mx
        from mlx.utils import tree_flatten
        from mlx_lm.models.cache import save_prompt_cache

        layers = for_saving(cache)  # only classes load_prompt_cache knows
        n = len(tokens)
        kinds = tuple(layer_kind(c) for c in layers)
        before = links[-1].kinds if links else kinds
        appends = [kind is not None and kind == was and held for kind, was, held in zip(kinds, before, same)]
        if not any(appends):
            links = []
        end = links[-1].end if links else 0
        parts, starts = [], []
        for layer, kind, append in zip(layers, kinds, appends):
            start = None if kind is None else end if append else 0
            parts.append(layer if start is None else segment_from(layer, start))
            starts.append(start)
        mx.eval([leaf for _, leaf in tree_flatten([c.state for c in parts]) if isinstance(leaf, mx.array)])
        digest = checksum(parts)
        name = f"{n}-{prefix_hash(tokens)}{SUFFIX}"
        final = self.folder / name
        parent = links[-1].name if links else ""
        header = saved_header(final)
        if header is not None and header.checksum == digest and header.parent == parent:
            return links + [_Link(n, name, digest, kinds)], 0
        self.folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=".partial-", suffix=SUFFIX)
        os.close(fd)
        try:
            save_prompt_cache(tmp, parts, {
                "format": FORMAT, "namespace": self.space, "tokens": str(n),
                "token_ids": json.dumps([int(t) for t in tokens[end:]]),
                "parent": parent, "parent_checksum": links[-1].checksum if links else "",
                "checksum": digest, "layers": json.dumps(starts)})
            os.replace(tmp, final)
        except BaseException:
            remove(Path(tmp))
            raise
        return links + [_Link(n, name, digest, kinds)], final.stat().st_size

    def _keep(self, cache, tokens: list[int], links: list[_Link]) -> None:
        """Remember that `cache` holds `tokens` of the chain `links`, in place of what was
        remembered of it, forgetting caches that were dropped."""
        self._mirrors = [m for m in self._mirrors if m.alive() and not any(m.same(cache))]
        self._mirrors.append(_Mirror.of(cache, tokens, links))

    def _base(self, mirror: Optional[_Mirror], tokens: list[int], kept: int) -> list[_Link]:
        """The links of the chain the cache's `mirror` says it was last written to or
        loaded from, up to the last segment within the tokens the cache still holds as
        they were: the first `kept` (a turn feeds, so rewrites, all positions from there);
        [] where there is none, or a segment of it is gone or was replaced (another
        process). Which layers may append to it is `_Mirror.same`."""
        from mlx_lm.utils import common_prefix_len

        if mirror is None:
            return []
        clean = min(kept, common_prefix_len(mirror.tokens, tokens))
        links = [link for link in mirror.links if link.end <= clean]
        for link in links:
            header = saved_header(self.folder / link.name)
            if header is None or header.checksum != link.checksum:
                return []
        return links

    def _prune(self, tokens: list[int], own: set[str]) -> None:
        """Remove saved chains that `tokens` extends, longest first: none of `own`
        (the new chain) and none that another segment still extends."""
        entries = self._entries()
        parents = Counter(header.parent for _, path in entries if (header := saved_header(path)) is not None)
        for (m, digest), path in sorted(entries, key=lambda e: -e[0][0]):
            if m < len(tokens) and path.name not in own and not parents[path.name] \
                    and digest == prefix_hash(tokens[:m]):
                header = saved_header(path)
                remove(path)
                if header is not None:
                    parents[header.parent] -= 1


def _shared(headers: list[Header], prompt: list[int]) -> int:
    """Tokens a chain's segments (their token ids in order) share with `prompt`'s start."""
    from mlx_lm.utils import common_prefix_len

    shared = 0
    for header in headers:
        same = common_prefix_len(header.ids, prompt[shared:shared + len(header.ids)])
        shared += same
        if same < len(header.ids):
            break
    return shared


def _short(exc: BaseException) -> str:
    text = one_line(exc)
    return text if len(text) <= 120 else text[:117] + "..."
