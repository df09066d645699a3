"""The conversation cache's files: their names, the metadata read from a header alone,
and eviction under the size bound.

A file is named by the token prefix it completes, `<n>-<prefix_hash>.safetensors`, so a
folder can be matched against a prompt without loading a tensor.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

SUFFIX = ".safetensors"
STALE_PARTIAL_SECONDS = 3600


@dataclass(frozen=True)
class Header:
    """A cache file's metadata, read from its safetensors header alone."""

    space: Optional[str]
    ids: list[int]  # the token ids of this segment's own range
    parent: str  # the file name of the segment it extends; "" for a first segment
    parent_checksum: str
    checksum: str


def prefix_hash(tokens) -> str:
    return hashlib.sha256(",".join(str(int(t)) for t in tokens).encode()).hexdigest()[:32]


def name_entry(path: Path) -> Optional[tuple[int, str]]:
    """(token count, prefix hash) from a cache file's name."""
    name = path.name
    if not name.endswith(SUFFIX) or name.startswith("."):
        return None
    count, _, digest = name[: -len(SUFFIX)].partition("-")
    return (int(count), digest) if count.isdigit() and digest else None


def saved_header(path: Path) -> Optional[Header]:
    """A cache file's metadata, from its safetensors header alone."""
    try:
        with open(path, "rb") as fh:
            size = int.from_bytes(fh.read(8), "little")
            if not 0 < size < 64 * 2**20:
                return None
            header = json.loads(fh.read(size))
        # save_prompt_cache flattens its metadata into the header ("0.token_ids")
        meta = {k.split(".")[-1]: v for k, v in header["__metadata__"].items()}
        ids = json.loads(meta["token_ids"])
        found = Header(meta.get("namespace"), ids, meta.get("parent", ""), meta.get("parent_checksum", ""),
                       meta.get("checksum", ""))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if not (isinstance(ids, list) and all(isinstance(t, int) for t in ids)):
        return None
    return found


def evict(root: Path, max_bytes: int, max_entries: int) -> tuple[int, int]:
    """Remove the least recently used conversations (a first segment with every segment
    that extends it, used as recently as its latest file) until the tree fits
    `max_bytes` and holds at most `max_entries` of them; returns (bytes, conversations) left."""
    for path in root.glob(f"*/.partial-*{SUFFIX}"):  # left by a process killed mid-write
        try:
            if time.time() - path.stat().st_mtime > STALE_PARTIAL_SECONDS:
                remove(path)
        except OSError:
            continue
    groups: dict[tuple[Path, str], list] = {}
    for folder in {p.parent for p in root.glob(f"*/*{SUFFIX}")}:
        files = {}
        for path in folder.glob(f"*{SUFFIX}"):
            try:
                st = path.stat()
            except OSError:
                continue
            if name_entry(path) is not None:
                header = saved_header(path)
                files[path.name] = (st.st_mtime, st.st_size, path, header.parent if header else "")
        for name, (mtime, size, path, _) in files.items():
            first, seen = name, {name}
            while files[first][3] in files and files[first][3] not in seen:
                first = files[first][3]
                seen.add(first)
            group = groups.setdefault((folder, first), [0.0, 0, []])
            group[0], group[1] = max(group[0], mtime), group[1] + size
            group[2].append(path)
    total, count = sum(size for _, size, _ in groups.values()), len(groups)
    for _, size, paths in sorted(groups.values(), key=lambda g: g[0]):
        if total <= max_bytes and count <= max_entries:
            break
        for path in paths:
            remove(path)
        total, count = total - size, count - 1
    return total, count


def remove(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass
