"""The packed expert store: each expert as one contiguous record, read with one preadv.

In a safetensors checkpoint an expert's bytes are spread over one range per component
(9 for a quantized SwiGLU: weight, scales, biases of three projections), far apart in
the file. `llm mlxs pack` (checkpoints/packing.py) rewrites them, beside the checkpoint in `mlxs-packed/`, as
one file per MoE layer holding expert e at `e * record_size`: all of its components in
the order of the layer's `LayerExperts.components`, padded to a 4096-byte page. A miss
then costs one read instead of nine.

The safetensors stay the truth. The store is used only while it provably matches them:
at load, the index must parse, be this format version, carry the checkpoint's current
fingerprint (`fingerprint`: what a user cannot fake by accident) and describe the same
layers and components, and every layer file must have its exact size; otherwise the
engine prints one line on stderr and reads the safetensors. Every record carries a crc32
that is checked in the reader thread before a slot using it is published: on the
record's first read in this process (`check="first"`, the default) or on every read
(`check="always"`). A mismatch disables the store and the slots are re-read from the
safetensors. `llm mlxs pack --verify` checks everything: every record against its
checksum and against the checkpoint's own bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from .index import LayerExperts, weight_files

PACKED_DIR = "mlxs-packed"
INDEX_NAME = "index.json"
FORMAT = "mlxs-packed"
FORMAT_VERSION = 2  # 2: the fingerprint holds inode, ctime and a content sample
ALIGN = 4096
CHECK_MODES = ("first", "always")
_SAMPLES = 16  # 4 KiB blocks of each shard hashed into its fingerprint


class PackedStoreError(ValueError):
    """Why a packed store cannot be used; the message is one line."""


def packed_dir(checkpoint: str | os.PathLike) -> Path:
    return Path(checkpoint) / PACKED_DIR


def fingerprint(checkpoint: str | os.PathLike) -> dict:
    """What identifies each shard's bytes, for the staleness check.

    The modification time alone is not enough: `touch -r` or a copy tool sets it back
    after an edit. So each shard also gives its inode (a replaced file is a new one),
    its inode change time (which every write and every `touch` moves, and no ordinary
    tool sets back), its size, its header length and a sha256 of its header and of
    evenly spaced 4 KiB blocks. A copied checkpoint is therefore a different one: pack
    it again.
    """
    out = {}
    for file in weight_files(Path(checkpoint)):
        with open(file, "rb") as fh:
            st = os.fstat(fh.fileno())
            raw = fh.read(8)
            header = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
            sample = hashlib.sha256(raw)
            if 0 <= header <= st.st_size:
                sample.update(fh.read(header))
            step = max(1, (st.st_size - 4096) // (_SAMPLES - 1))
            for i in range(_SAMPLES):
                sample.update(os.pread(fh.fileno(), 4096, min(i * step, max(0, st.st_size - 4096))))
        out[file.name] = {
            "size": st.st_size, "inode": st.st_ino, "mtime_ns": st.st_mtime_ns,
            "ctime_ns": st.st_ctime_ns, "header_len": header, "sample": sample.hexdigest(),
        }
    return out


def record_size(expert_bytes: int) -> int:
    return -(-expert_bytes // ALIGN) * ALIGN


def store_files(folder: Path) -> list[Path]:
    """The files that make up a store (not the temporary files of a pack under way)."""
    return [p for p in folder.iterdir() if p.is_file() and ".tmp-" not in p.name]


@dataclass
class PackedLayer:
    """One layer's record file: expert e's bytes are at e * record_size."""

    key: str
    file: Path
    record_size: int
    expert_bytes: int
    crc: np.ndarray  # uint32 per expert
    checked: np.ndarray  # bool per expert: its record passed the check in this process
    always: bool

    def offset(self, expert: int) -> int:
        return expert * self.record_size

    def check(self, job) -> bool:
        """Whether a job's buffers hold the record's recorded bytes (reader thread)."""
        _, offset, buffers = job
        e = offset // self.record_size
        if self.checked[e] and not self.always:
            return True
        crc = 0
        for b in buffers:
            crc = zlib.crc32(b, crc)
        ok = crc == int(self.crc[e])
        if ok:
            self.checked[e] = True
        return ok


class PackedStore:
    """The packed records of a checkpoint's layers, until something shows they are bad."""

    def __init__(self, folder: Path, layers: dict[str, PackedLayer]):
        self.folder = folder
        self.layers = layers
        self.disabled: str | None = None
        self._lock = threading.Lock()

    def layer(self, key: str) -> PackedLayer | None:
        return None if self.disabled else self.layers.get(key)

    def disable(self, reason: str) -> None:
        """Stop using the store (every pool falls back to the safetensors); say so once."""
        with self._lock:
            if self.disabled is None:
                self.disabled = reason
                notice(self.folder, reason)


def notice(folder: Path, reason: str) -> None:
    print(f"mlx-streaming: packed store {folder} not used: {reason}; "
          "reading the safetensors (re-pack to use it)", file=sys.stderr)


def open_packed(checkpoint: str | os.PathLike, layers: Sequence[LayerExperts],
                check: str = "first") -> PackedStore | None:
    """The checkpoint's packed store if present and valid for `layers`, else None.

    A store that exists but cannot be used is reported in one line on stderr.
    """
    if check not in CHECK_MODES:
        raise ValueError(f"packed check must be one of {', '.join(CHECK_MODES)}, got {check!r}")
    folder = packed_dir(checkpoint)
    if not (folder / INDEX_NAME).exists():
        return None
    try:
        index = load_index(Path(checkpoint), folder)
        found = match_layers(index, folder, layers, check == "always")
    except PackedStoreError as e:
        notice(folder, str(e))
        return None
    return PackedStore(folder, found)


def load_index(checkpoint: Path, folder: Path) -> dict:
    try:
        index = json.loads((folder / INDEX_NAME).read_text())
        if not isinstance(index, dict):
            raise ValueError
    except (OSError, UnicodeDecodeError, ValueError):
        raise PackedStoreError("damaged (its index is unreadable)") from None
    if index.get("format") != FORMAT or index.get("version") != FORMAT_VERSION:
        raise PackedStoreError(
            f"format version {index.get('version')!r}, this engine reads {FORMAT_VERSION}"
        )
    try:
        current = fingerprint(checkpoint)
    except OSError as e:
        raise PackedStoreError(f"cannot read the checkpoint ({e.strerror})") from None
    if index.get("source") != current:
        raise PackedStoreError("stale (the checkpoint changed since it was packed)")
    return index


def match_layers(index: dict, folder: Path, layers: Sequence[LayerExperts], always: bool) -> dict:
    try:
        by_key = {entry["key"]: entry for entry in index["layers"]}
        found = {}
        for layer in layers:
            entry = by_key.get(layer.key)
            want = [(c.name, c.stride) for c in layer.components]
            if entry is None or [(c["name"], c["nbytes"]) for c in entry["components"]] != want:
                raise PackedStoreError(f"damaged (layer {layer.key} is missing or differs)")
            size = record_size(layer.expert_bytes)
            crc = np.asarray(entry["crc32"], dtype=np.uint32)
            if (entry["num_experts"] != layer.num_experts or entry["record_size"] != size
                    or entry["expert_bytes"] != layer.expert_bytes or crc.shape != (layer.num_experts,)):
                raise PackedStoreError(f"damaged (layer {layer.key} has the wrong record layout)")
            file = folder / entry["file"]
            if file.parent != folder:
                raise PackedStoreError("damaged (a layer file is outside the store)")
            actual = file.stat().st_size if file.is_file() else None
            if actual != size * layer.num_experts:
                raise PackedStoreError(
                    f"damaged ({file.name} is {actual} bytes, expected {size * layer.num_experts})"
                )
            found[layer.key] = PackedLayer(layer.key, file, size, layer.expert_bytes, crc,
                                           np.zeros(layer.num_experts, dtype=bool), always)
        return found
    except (KeyError, TypeError, ValueError, OverflowError) as e:
        if isinstance(e, PackedStoreError):
            raise
        raise PackedStoreError("damaged (its index is malformed)") from None


