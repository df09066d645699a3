"""`llm mlxs pack`: writes a checkpoint's packed store and checks one (`--verify`);
experts/packed.py holds the format and how the engine reads it.

Here, not in experts/, because finding the layers to pack loads the checkpoint the way
the engine does (config checks, mlx-lm without the MTP head), which is this package's job.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Callable

import numpy as np

from ..errors import CheckpointError
from ..experts.index import CheckpointIndex, LayerExperts
from ..experts.packed import ALIGN, FORMAT, FORMAT_VERSION, INDEX_NAME, PackedStoreError, fingerprint, load_index, match_layers, packed_dir, record_size
from ..experts.store import read_exact
from .config import check_checkpoint
from .mtp import classes_without_head
from .vision import load_lazily, takes_images

_CHUNK_BYTES = 64 << 20  # experts assembled per write while packing

Progress = Callable[[int, int, int, int], None]  # (layer, layers, bytes done, bytes total)


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

    from ..experts.switch import expert_containers

    config = check_checkpoint(path)
    index = CheckpointIndex(path)
    if takes_images(config):
        model = load_lazily(path, config)  # its module paths are the checkpoint's tensor names
    else:
        model, _ = load_model(path, lazy=True, get_model_classes=classes_without_head)
    maps = []
    for name, container in expert_containers(model):
        params = dict(tree_flatten(container.parameters()))
        num_experts = next(iter(params.values())).shape[0]
        maps.append(index.layer(name, {k: v.shape[1:] for k, v in params.items()}, num_experts))
    return maps


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
        index = load_index(checkpoint, folder)
        maps = layer_maps(checkpoint)
        layers = match_layers(index, folder, maps, always=True)
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
