"""Checking a checkpoint's files against hashes known to be right (`llm mlxs verify`).

Safetensors carry no checksums, so a flipped byte in an expert gives fluent nonsense
rather than an error. Two sources of truth are used, both offline:

- a model in the Hugging Face cache: each file of a snapshot is a link to a blob named
  by its content address, the sha256 of the file for LFS files (64 hex digits) and the
  git blob sha1 for the others (40 hex digits);
- any other directory: a manifest of sha256 hashes recorded when the files were known
  to be good (`llm mlxs add --hash`, `llm mlxs verify --record`), kept under
  ``llm.user_dir()`` so that read-only checkpoint folders work too.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional

from ..errors import CheckpointError
from ..experts.index import read_header

MANIFEST_VERSION = 1
QUICK_LIMIT = 16 * 1000**2  # --quick hashes only files smaller than this
SKIP_DIRS = ("mlxs-packed",)  # derived from the checkpoint, checked by `pack --verify`
_CHUNK = 8 << 20
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_SHA1 = re.compile(r"^[0-9a-f]{40}$")

Progress = Callable[[int, int], None]  # (bytes done, bytes total)


@dataclass(frozen=True)
class Expected:
    """What one file must be: its hash (`algorithm`: sha256 or git-sha1) and size."""

    name: str  # relative to the checkpoint
    algorithm: str
    digest: str
    size: Optional[int]  # None where the source does not say


def hf_blobs(checkpoint: Path) -> Optional[list[Expected]]:
    """The content addresses of a Hugging Face cache snapshot; None if `checkpoint` is
    not one (a folder under ``snapshots/`` next to a ``blobs/`` folder)."""
    checkpoint = Path(checkpoint)
    if checkpoint.parent.name != "snapshots" or not (checkpoint.parent.parent / "blobs").is_dir():
        return None
    out = []
    for link in sorted(_files(checkpoint, follow=False)):
        name = link.relative_to(checkpoint).as_posix()
        if not link.is_symlink():
            continue  # not a cache entry: nothing records its content
        digest = Path(os.readlink(link)).name
        if _SHA256.match(digest):
            out.append(Expected(name, "sha256", digest, None))
        elif _SHA1.match(digest):
            out.append(Expected(name, "git-sha1", digest, None))
    return out


def manifest_path(checkpoint: Path) -> Path:
    """Where the manifest of the checkpoint folder `checkpoint` is kept."""
    import llm

    key = hashlib.sha256(str(Path(checkpoint).resolve()).encode()).hexdigest()[:24]
    return llm.user_dir() / "mlx-streaming" / "manifests" / f"{key}.json"


def read_manifest(checkpoint: Path) -> Optional[list[Expected]]:
    path = manifest_path(checkpoint)
    if not path.is_file():
        return None
    return _manifest_files(path, f"the manifest of {checkpoint} is damaged; record it again")


def _manifest_files(path: Path, damaged: str) -> list[Expected]:
    """What each file must be, by a manifest file (`damaged`: the error's words)."""
    try:
        data = json.loads(path.read_text())
        if data.get("version") != MANIFEST_VERSION:
            raise ValueError
        return [Expected(name, "sha256", f["sha256"], int(f["size"])) for name, f in data["files"].items()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise CheckpointError(f"{path}: {damaged}") from None


def shipped_manifest(checkpoint: Path) -> Optional[list[Expected]]:
    """The hashes the package ships for the bundled demo, if `checkpoint` is its copy."""
    from .default import SHIPPED_HASHES, bundled_path

    if Path(checkpoint).resolve() != bundled_path().resolve():
        return None
    return _manifest_files(SHIPPED_HASHES, "the demo's shipped hashes are damaged; reinstall the package")


def hashes(checkpoint: Path, progress: Progress | None = None) -> dict:
    """A manifest's contents: the sha256 and size of every file of the checkpoint."""
    checkpoint = Path(checkpoint)
    files = sorted(_files(checkpoint, follow=True))
    total = sum(f.stat().st_size for f in files)
    done = [0]

    def step(n):
        done[0] += n
        if progress:
            progress(done[0], total)

    entries = {}
    for file in files:
        entries[file.relative_to(checkpoint).as_posix()] = {
            "size": file.stat().st_size, "sha256": file_hash(file, "sha256", step),
        }
    return {"version": MANIFEST_VERSION, "files": entries}


def record_manifest(checkpoint: Path, progress: Progress | None = None) -> Path:
    """Hash every file of the checkpoint and keep the hashes as its manifest."""
    checkpoint = Path(checkpoint)
    path = manifest_path(checkpoint)
    data = {**hashes(checkpoint, progress), "checkpoint": str(checkpoint.resolve())}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".manifest-")
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh, indent=1)
        os.replace(tmp, path)
    except OSError as e:
        raise CheckpointError(f"Cannot write the manifest {path}: {e.strerror or e}") from None
    return path


def expected_files(checkpoint: Path) -> tuple[str, list[Expected]]:
    """(where the hashes come from, what each file must be) for a checkpoint."""
    blobs = hf_blobs(checkpoint)
    if blobs:
        return "the Hugging Face cache", blobs
    manifest = read_manifest(checkpoint)
    if manifest is not None:
        return "the recorded manifest", manifest
    shipped = shipped_manifest(checkpoint)
    if shipped is not None:
        return "the hashes shipped with the package", shipped
    raise CheckpointError(
        f"{checkpoint}: no hashes to compare with (not in the Hugging Face cache, no manifest); "
        "record them while the files are good with `llm mlxs verify NAME --record` "
        "(or `llm mlxs add --hash`)"
    )


def verify_files(checkpoint: Path, expected: Iterable[Expected], *, quick: bool = False,
                 progress: Progress | None = None) -> list[str]:
    """One line per file that is missing, of the wrong size or hash ([] = all good).

    `quick` hashes only files under QUICK_LIMIT bytes; larger ones are checked for
    their size and, for safetensors, that the file holds what its header promises."""
    checkpoint = Path(checkpoint)
    expected = list(expected)
    sizes = {}
    for item in expected:
        file = checkpoint / item.name
        sizes[item.name] = file.stat().st_size if file.is_file() else None
    total = sum(s for item in expected if (s := sizes[item.name]) is not None
                and not (quick and s >= QUICK_LIMIT))
    done = [0]

    def step(n):
        done[0] += n
        if progress:
            progress(done[0], total)

    problems = []
    for item in expected:
        file, size = checkpoint / item.name, sizes[item.name]
        if size is None:
            problems.append(f"{file}: missing")
        elif item.size is not None and size != item.size:
            problems.append(f"{file}: {size} bytes, expected {item.size}")
        elif quick and size >= QUICK_LIMIT:
            if file.suffix == ".safetensors":
                try:
                    read_header(file)
                except CheckpointError as e:
                    problems.append(str(e))
        else:
            try:
                digest = file_hash(file, item.algorithm, step)
            except OSError as e:
                problems.append(f"{file}: cannot read ({e.strerror or e})")
                continue
            if digest != item.digest:
                problems.append(f"{file}: {item.algorithm} {digest[:12]}..., expected {item.digest[:12]}...")
    return problems


def file_hash(file: Path, algorithm: str, step: Callable[[int], None] | None = None) -> str:
    """sha256 of a file, or its git blob sha1 (the hash of "blob <size>\\0" + content)."""
    if algorithm == "sha256":
        h = hashlib.sha256()
    else:
        h = hashlib.sha1()
        h.update(b"blob %d\0" % file.stat().st_size)
    with open(file, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
            if step:
                step(len(chunk))
    return h.hexdigest()


def _files(checkpoint: Path, follow: bool) -> list[Path]:
    """The checkpoint's files (links included when not following them), not counting
    the folders the plugin derives from it."""
    out = []
    for root, dirs, names in os.walk(checkpoint, followlinks=follow):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.startswith(".")]
        for name in names:
            if name.startswith("."):
                continue
            p = Path(root) / name
            if p.is_file() or (not follow and p.is_symlink()):
                out.append(p)
    return out
