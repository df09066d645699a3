"""The packed expert store: each expert as one contiguous record, read with one preadv.

In a safetensors checkpoint an expert's bytes are spread over one range per component
(9 for a quantized SwiGLU: weight, scales, biases of three projections), far apart in
the file. `pack_checkpoint` rewrites them, beside the checkpoint in `mlxs-packed/`, as
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
safetensors. `verify_packed` checks everything: every record against its checksum and
against the checkpoint's own bytes.
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
from typing import Callable, Sequence

import numpy as np

from ..errors import CheckpointError
from .index import LayerExperts, weight_files
from .store import read_exact

PACKED_DIR = "mlxs-packed"
INDEX_NAME = "index.json"
FORMAT = "mlxs-packed"
FORMAT_VERSION = 2  # 2: the fingerprint holds inode, ctime and a content sample
ALIGN = 4096
CHECK_MODES = ("first", "always")
_CHUNK_BYTES = 64 << 20  # experts assembled per write while packing
_SAMPLES = 16  # 4 KiB blocks of each shard hashed into its fingerprint

Progress = Callable[[int, int, int, int], None]  # (layer, layers, bytes done, bytes total)


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


# -- packing -------------------------------------------------------------------


def pack_checkpoint(path: str | os.PathLike, *, progress: Progress | None = None) -> Path:
    """Write the packed store of the checkpoint at `path`; returns its folder.

    The layer files are written under temporary names and renamed, and the index is
    written last (after the old one is removed), so an interrupted pack never leaves a
    store that looks valid. `progress(layer, layers, bytes_done, bytes_total)` is called
    as the bytes are written (layer counts from 1).
    """
    path = Path(path).expanduser()
    layers = layer_maps(path)
    if not layers:
        raise PackedStoreError(f"{path}: no MoE layer to pack")
    out = packed_dir(path)
    out.mkdir(exist_ok=True)
    (out / INDEX_NAME).unlink(missing_ok=True)
    _remove_orphans(out)
    before = fingerprint(path)
    total = sum(record_size(l.expert_bytes) * l.num_experts for l in layers)
    done = 0
    entries = []
    for i, layer in enumerate(layers):
        name = f"layer-{i:03d}.bin"
        tmp = out / f"{name}.tmp-{os.getpid()}"
        try:
            crcs = _write_layer(layer, tmp, lambda n: progress and progress(i + 1, len(layers), done + n, total))
            tmp.replace(out / name)
        finally:
            tmp.unlink(missing_ok=True)
        size = record_size(layer.expert_bytes)
        done += size * layer.num_experts
        entries.append({
            "key": layer.key,
            "file": name,
            "num_experts": layer.num_experts,
            "expert_bytes": layer.expert_bytes,
            "record_size": size,
            "file_size": size * layer.num_experts,
            "components": [
                {"name": c.name, "nbytes": c.stride, "dtype": c.dtype, "shape": list(c.shape)}
                for c in layer.components
            ],
            "crc32": crcs,
        })
    if fingerprint(path) != before:
        raise PackedStoreError(f"{path}: the checkpoint changed while it was being packed")
    index = {"format": FORMAT, "version": FORMAT_VERSION, "align": ALIGN,
             "source": before, "layers": entries}
    tmp = out / f"{INDEX_NAME}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as fh:
            json.dump(index, fh)
            fh.flush()
            os.fsync(fh.fileno())
        tmp.replace(out / INDEX_NAME)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(out)
    return out


def _remove_orphans(folder: Path) -> None:
    """Delete temporary files of packs that were killed (their process is gone)."""
    for tmp in folder.glob("*.tmp-*"):
        pid = tmp.name.rsplit(".tmp-", 1)[1]
        if pid.isdigit() and int(pid) != os.getpid() and _alive(int(pid)):
            continue  # another pack is writing it right now
        tmp.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # it exists, owned by someone else
    return True


def store_files(folder: Path) -> list[Path]:
    """The files that make up a store (not the temporary files of a pack under way)."""
    return [p for p in folder.iterdir() if p.is_file() and ".tmp-" not in p.name]


def _fsync_dir(folder: Path) -> None:
    """Make the renames durable (where a directory can be fsynced)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_layer(layer: LayerExperts, dest: Path, progress: Callable[[int], None]) -> list[int]:
    """Write one layer's records; returns the crc32 of each record's data bytes."""
    size = record_size(layer.expert_bytes)
    per_chunk = max(1, _CHUNK_BYTES // size)
    fds = {}
    crcs = []
    try:
        with open(dest, "wb") as fh:
            for first in range(0, layer.num_experts, per_chunk):
                n = min(per_chunk, layer.num_experts - first)
                chunk = np.zeros((n, size), dtype=np.uint8)
                col = 0
                for comp in layer.components:
                    if comp.file not in fds:
                        fds[comp.file] = os.open(comp.file, os.O_RDONLY)
                    data = np.empty((n, comp.stride), dtype=np.uint8)
                    read_exact(fds[comp.file], comp.span(first)[0], [memoryview(data).cast("B")])
                    chunk[:, col : col + comp.stride] = data
                    col += comp.stride
                crcs.extend(zlib.crc32(row[: layer.expert_bytes]) for row in chunk)
                fh.write(memoryview(chunk).cast("B"))
                progress((first + n) * size)
            fh.flush()
            os.fsync(fh.fileno())
    finally:
        for fd in fds.values():
            os.close(fd)
    return crcs


def layer_maps(path: Path) -> list[LayerExperts]:
    """The byte maps of every MoE layer, found exactly as the engine finds them."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model

    from ..checkpoints.config import check_checkpoint
    from ..checkpoints.mtp import classes_without_head
    from .index import CheckpointIndex
    from .switch import expert_containers

    check_checkpoint(path)
    index = CheckpointIndex(path)
    model, _ = load_model(path, lazy=True, get_model_classes=classes_without_head)
    maps = []
    for name, container in expert_containers(model):
        params = dict(tree_flatten(container.parameters()))
        num_experts = next(iter(params.values())).shape[0]
        maps.append(index.layer(name, {k: v.shape[1:] for k, v in params.items()}, num_experts))
    return maps


# -- using ---------------------------------------------------------------------


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
        index = _load_index(Path(checkpoint), folder)
        found = _match_layers(index, folder, layers, check == "always")
    except PackedStoreError as e:
        notice(folder, str(e))
        return None
    return PackedStore(folder, found)


def _load_index(checkpoint: Path, folder: Path) -> dict:
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


def _match_layers(index: dict, folder: Path, layers: Sequence[LayerExperts], always: bool) -> dict:
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


# -- checking ------------------------------------------------------------------


def verify_packed(path: str | os.PathLike, progress: Callable[[int, int], None] | None = None) -> list[str]:
    """Every problem of the checkpoint's packed store, each in one line ([] = sound).

    Runs the load-time checks (index, version, fingerprint, layers and components as
    the engine finds them, file sizes), then reads every record and compares it with
    its checksum and with the expert's bytes in the safetensors.
    `progress(bytes_done, bytes_total)` is called as the records are compared.
    """
    checkpoint = Path(path).expanduser()
    folder = packed_dir(checkpoint)
    if not (folder / INDEX_NAME).exists():
        return [f"{folder}: no packed store (no {INDEX_NAME})"]
    try:
        index = _load_index(checkpoint, folder)
        maps = layer_maps(checkpoint)
        layers = _match_layers(index, folder, maps, always=True)
    except PackedStoreError as e:
        return [f"{folder}: {e}"]
    except CheckpointError as e:
        return [str(e)]
    total = sum(m.expert_bytes * m.num_experts for m in maps)
    done = 0
    problems = []
    fds: dict[Path, int] = {}
    try:
        for source in maps:
            layer = layers[source.key]
            record = bytearray(layer.expert_bytes)
            original = bytearray(layer.expert_bytes)
            with open(layer.file, "rb") as fh:
                for e, crc in enumerate(layer.crc):
                    fh.seek(e * layer.record_size)
                    if fh.readinto(record) != len(record) or zlib.crc32(record) != int(crc):
                        problems.append(f"{layer.file}: record of expert {e} fails its checksum")
                    else:
                        _read_expert(source, e, original, fds)
                        if record != original:
                            problems.append(
                                f"{layer.file}: record of expert {e} differs from the checkpoint"
                            )
                    done += layer.expert_bytes
                    if progress:
                        progress(done, total)
    finally:
        for fd in fds.values():
            os.close(fd)
    return problems


def _read_expert(layer: LayerExperts, expert: int, out: bytearray, fds: dict) -> None:
    """An expert's bytes from the safetensors, components in record order."""
    col = 0
    for comp in layer.components:
        if comp.file not in fds:
            fds[comp.file] = os.open(comp.file, os.O_RDONLY)
        view = memoryview(out)[col : col + comp.stride]
        read_exact(fds[comp.file], comp.span(expert)[0], [view])
        col += comp.stride
