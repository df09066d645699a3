"""Where every expert's bytes live in a checkpoint, from the safetensors headers alone.

A stacked expert tensor of shape (E, *shape) is stored row-major, so expert e of it is the
contiguous byte range [begin + e * stride, begin + (e + 1) * stride). Reading only the
headers lets the engine find those ranges without ever touching the tensors.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from ..errors import CheckpointError

DTYPE_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4,
    "U64": 8, "I64": 8, "F64": 8,
}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a shard: its file, absolute byte offset, dtype and full shape."""

    file: Path
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ExpertComponent:
    """One per-expert tensor of an expert container (e.g. `up_proj.scales`)."""

    name: str
    file: Path
    offset: int  # absolute offset of expert 0
    stride: int  # bytes per expert
    dtype: str
    shape: tuple[int, ...]  # per-expert shape

    def span(self, expert: int) -> tuple[int, int]:
        """(offset, length) of one expert's bytes."""
        return self.offset + expert * self.stride, self.stride


@dataclass(frozen=True)
class LayerExperts:
    """All per-expert tensors of one MoE layer's expert container."""

    key: str  # module path, e.g. "model.layers.3.mlp.switch_mlp"
    num_experts: int
    components: tuple[ExpertComponent, ...]

    @property
    def expert_bytes(self) -> int:
        return sum(c.stride for c in self.components)


def read_header(file: Path) -> dict[str, TensorEntry]:
    """Parse one safetensors header and check the file holds every byte it promises."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as fh:
            raw = fh.read(8)
            if len(raw) < 8:
                raise CheckpointError(f"{file}: not a safetensors file (too short)")
            (header_len,) = struct.unpack("<Q", raw)
            if header_len > size - 8:
                raise CheckpointError(f"{file}: header length {header_len} exceeds the file")
            header = json.loads(fh.read(header_len))
    except OSError as e:
        raise CheckpointError(f"{file}: cannot read ({e.strerror})") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CheckpointError(f"{file}: safetensors header is not valid JSON") from None
    data_start = 8 + header_len
    entries = {}
    end = data_start
    try:
        for name, info in header.items():
            if name == "__metadata__":
                continue
            begin, stop = (int(x) for x in info["data_offsets"])
            entries[name] = TensorEntry(
                file, data_start + begin, stop - begin, info["dtype"], tuple(info["shape"])
            )
            end = max(end, data_start + stop)
    except (AttributeError, KeyError, TypeError, ValueError):
        raise CheckpointError(f"{file}: safetensors header is malformed") from None
    if end > size:
        raise CheckpointError(
            f"{file}: shard is truncated: its header needs {end} bytes, the file has {size}"
        )
    return entries


class CheckpointIndex:
    """Every tensor of a checkpoint directory, by name, across shards."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.tensors: dict[str, TensorEntry] = {}
        for file in weight_files(self.path):
            self.tensors.update(read_header(file))

    def layer(self, key: str, components: dict[str, tuple], num_experts: int) -> LayerExperts:
        """The byte map of the container at module path `key`.

        `components` maps a parameter name relative to the container (e.g.
        "up_proj.weight") to the per-expert shape the loaded model expects.
        """
        found = []
        for name, shape in components.items():
            full = f"{key}.{name}"
            entry = self.tensors.get(full)
            if entry is None:
                raise CheckpointError(
                    f"{self.path}: expert tensor {full!r} is missing from the checkpoint"
                )
            if entry.shape[0] != num_experts or tuple(entry.shape[1:]) != tuple(shape):
                raise CheckpointError(
                    f"{entry.file}: tensor {full!r} has shape {list(entry.shape)}, "
                    f"expected {[num_experts, *shape]}"
                )
            itemsize = DTYPE_SIZES.get(entry.dtype)
            if itemsize is None:
                raise CheckpointError(f"{entry.file}: tensor {full!r} has unsupported dtype {entry.dtype}")
            stride = itemsize * math.prod(shape)
            if stride * num_experts != entry.nbytes:
                raise CheckpointError(f"{entry.file}: tensor {full!r} size does not match its shape")
            found.append(ExpertComponent(name, entry.file, entry.offset, stride, entry.dtype, tuple(shape)))
        return LayerExperts(key, num_experts, tuple(found))


def weight_files(path: Path) -> list[Path]:
    """The safetensors shards of an mlx-lm checkpoint, as mlx-lm itself finds them."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError):
            raise CheckpointError(f"{index}: not a valid safetensors index") from None
        files = sorted({path / name for name in weight_map.values()})
        missing = [f for f in files if not f.exists()]
        if missing:
            raise CheckpointError(f"{missing[0]}: shard listed in the index is missing")
        return files
    files = sorted(path.glob("model*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no model*.safetensors weight files")
    return files
