"""The wheels for the GPU run, downloaded into .whl/ and brought under a call's 64 MiB.

The lent machine (x86-64, Python 3.12, CUDA 13 with torch's nvidia-* libraries) reaches
no registry, so what its image lacks travels as wheels (tools/device/device_wheels.txt,
pinned with hashes). mlx-cuda-13's wheel alone is 89.8 MB: its libmlx.so holds every
CUDA kernel built for six GPU generations (sm_75 to sm_121a; 67 MB of fat binaries,
each kernel's code already compressed). The repack keeps each kernel's sm_90a code,
which the H100 and H200 run, drops the other generations' in place (no offset in the
library moves), and changes nothing else in the wheel.

    python tools/device/device_wheels.py            # download and repack into .whl/
    python tools/device/device_wheels.py --check    # what device_check.sh --dry-run checks
    python tools/device/device_wheels.py --plan     # the pins against pyproject.toml and the run's imports: no .whl/
"""

from __future__ import annotations

import argparse
import base64
import glob
import hashlib
import importlib
import importlib.metadata as metadata
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PINS = Path(__file__).with_name("device_wheels.txt")
WHEELS = ROOT / ".whl"
PRUNED = "mlx-cuda-13"  # the wheel the repack changes (its hash is no longer the pinned one)
LIBRARY = "mlx/lib/libmlx.so"
ARCH = 90  # Hopper: the H100 and H200 run sm_90a code
LIMIT = 64 * 2**20  # what one call may carry: the working tree and its carried paths
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (35, 34, 31, 28, 27, 17)] + ["manylinux2014_x86_64"]
# What the run needs from the machine's image (KINDS.md, "Python packages already there").
IMAGE = {
    "annotated-doc", "anyio", "attrs", "certifi", "charset-normalizer", "click", "filelock", "fsspec", "h11",
    "hf-xet", "httpcore", "httpx", "huggingface-hub", "idna", "iniconfig", "jinja2", "markupsafe",
    "numpy", "nvidia-cublas", "nvidia-cuda-nvrtc", "nvidia-cuda-runtime", "nvidia-cudnn-cu13",
    "nvidia-cufft", "nvidia-cusolver", "nvidia-nccl-cu13", "packaging", "pip", "pluggy", "protobuf",
    "prometheus-client", "pygments", "pytest", "python-dateutil", "pyyaml", "regex", "requests", "safetensors",
    "sentencepiece", "setuptools", "six", "sortedcontainers", "tabulate", "tokenizers", "tqdm", "transformers",
    "typing-extensions", "urllib3",
}
# Where this machine has a package that the device has another one for.
STANDS_IN = {"mlx-cpu": PRUNED}
NOT_USED = {"llguidance"}  # the project's schema decoding: no device check runs it
# Imported where installed, and done without: httpcore2 imports trio, sqlite-utils pandas
# (and pandas pyarrow), transformers pillow, starlette python-multipart.
OPTIONAL = {"trio", "outcome", "pandas", "pyarrow", "pillow", "python-multipart"}
# What the device run imports: the benchmark, the three test files and the server it starts.
RUN_MODULES = ["device_bench", "conftest", "test_exactness", "test_batch", "test_syncs",
               "llm_mlx_streaming.server.app", "uvicorn"]
# What libmlx.so loads from the image's nvidia-* packages (through its RPATH
# $ORIGIN/../../nvidia/*/lib, which device_check.sh points there) and the driver.
FROM_IMAGE = {"libcublasLt.so.13", "libcudnn.so.9", "libcufft.so.12", "libcusolver.so.12", "libnccl.so.2",
              "libnvrtc.so.13", "libcuda.so.1"}
FATBIN_MAGIC = 0xBA55ED50
CUBIN = 2  # a fat binary entry's kind: 1 is PTX, 2 an ELF cubin


def canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def project_needs() -> list[str]:
    """The project's dependencies as pyproject.toml declares them, markers included (the
    installed metadata may predate the checkout)."""
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]


def unmet(needs: dict[str, str], carried: set[str]) -> list[str]:
    """Each need (requirement -> who needs it) that applies to Python 3.12 on Linux and is
    neither carried nor in the image."""
    from packaging.requirements import Requirement

    env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "extra": ""}
    out = []
    for line, who in needs.items():
        need = Requirement(line)
        name = STANDS_IN.get(canonical(need.name), canonical(need.name))
        if need.marker and not need.marker.evaluate(env) or name in carried | IMAGE | NOT_USED:
            continue
        out.append(f"{need} (for {who})")
    return out


def pins() -> dict[str, tuple[str, str]]:
    """name -> (version, sha256) from device_wheels.txt."""
    out = {}
    for line in PINS.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            spec, digest = line.split(" --hash=sha256:")
            name, version = spec.split("==")
            out[canonical(name)] = (version, digest.strip())
    return out


def wheel_name(path: Path) -> tuple[str, str]:
    name, version = path.name.split("-")[:2]
    return canonical(name), version


# -- the repack ------------------------------------------------------------------------


def sections(lib) -> dict[str, tuple[int, int]]:
    """ELF64 section name -> (file offset, size)."""
    shoff, = struct.unpack_from("<Q", lib, 0x28)
    entsize, count, names = struct.unpack_from("<HHH", lib, 0x3A)
    header = lambda i: shoff + i * entsize  # noqa: E731
    strtab = struct.unpack_from("<Q", lib, header(names) + 24)[0]
    out = {}
    for i in range(count):
        name_at, = struct.unpack_from("<I", lib, header(i))
        offset, size = struct.unpack_from("<QQ", lib, header(i) + 24)
        end = lib.index(b"\0", strtab + name_at)
        out[bytes(lib[strtab + name_at:end]).decode()] = (offset, size)
    return out


def fatbins(lib):
    """(start, header size, end, [(kind, arch, start, end) per entry]) of each fat binary
    in .nv_fatbin; the gaps between them must be zero padding."""
    start, size = sections(lib)[".nv_fatbin"]
    pos, end = start, start + size
    while pos < end:
        if lib[pos:pos + 4] == b"\0\0\0\0":
            pos += 4
            continue
        magic, _, header, fat = struct.unpack_from("<IHHQ", lib, pos)
        assert magic == FATBIN_MAGIC, f"no fat binary header at {pos:#x}"
        entries, at = [], pos + header
        while at < pos + header + fat:
            kind, _, size_of_header, payload = struct.unpack_from("<HHIQ", lib, at)
            arch, = struct.unpack_from("<I", lib, at + 28)
            entries.append((kind, arch, at, at + size_of_header + payload))
            at += size_of_header + payload
        yield pos, header, pos + header + fat, entries
        pos = pos + header + fat


def kernels(lib) -> Counter:
    """(kind, arch) -> entries, over every fat binary."""
    return Counter((kind, arch) for *_, entries in fatbins(lib) for kind, arch, _, _ in entries)


def keep_arch(lib: bytearray, arch: int = ARCH) -> None:
    """Leave in each fat binary only its `arch` cubin, moved up behind its header, the
    rest of the fat binary zeroed; the fat binary's size field shrinks to match."""
    for start, header, end, entries in list(fatbins(lib)):
        kept = [(a, b) for kind, entry_arch, a, b in entries if (kind, entry_arch) == (CUBIN, arch)]
        if len(kept) != 1:
            raise SystemExit(f"fat binary at {start:#x} has {len(kept)} sm_{arch} cubins: cannot prune")
        (a, b), body = kept[0], start + header
        lib[body:body + b - a] = lib[a:b]
        lib[body + b - a:end] = bytes(end - body - (b - a))
        struct.pack_into("<Q", lib, start + 8, b - a)


def record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def repack(wheel: Path) -> None:
    """`wheel` again, its libmlx.so pruned to ARCH and its RECORD rewritten to match."""
    out = wheel.with_suffix(".tmp")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w") as dst:
        record = next(i.filename for i in src.infolist() if i.filename.endswith(".dist-info/RECORD"))
        lines = []
        for info in src.infolist():
            if info.filename == record:
                continue
            data = src.read(info)
            if info.filename == LIBRARY:
                lib = bytearray(data)
                keep_arch(lib)
                data = bytes(lib)
            if not info.is_dir():
                lines.append(record_line(info.filename, data))
            dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
        lines.append(f"{record},,")
        dst.writestr(src.getinfo(record), "\n".join(lines) + "\n", compress_type=zipfile.ZIP_DEFLATED)
    out.replace(wheel)


def download(dest: Path) -> None:
    """The pinned wheels into `dest` (replacing what was there), then the repack."""
    shutil.rmtree(dest, ignore_errors=True)
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", *platforms,
                    "--require-hashes", "-r", str(PINS), "-d", str(dest)], check=True)
    (wheel,) = [w for w in dest.glob("*.whl") if wheel_name(w)[0] == PRUNED]
    before = wheel.stat().st_size
    repack(wheel)
    print(f"{wheel.name}: {before / 1e6:.1f} MB -> {wheel.stat().st_size / 1e6:.1f} MB (sm_{ARCH} kernels only)")


# -- the checks ------------------------------------------------------------------------


def check_set(dest: Path) -> list[Path]:
    """Exactly the pinned wheels; each unchanged one has its pinned hash; the repacked
    one's library holds sm_90 cubins only and its RECORD matches its files."""
    wanted, wheels = pins(), sorted(dest.glob("*.whl"))
    found = {wheel_name(w)[0]: w for w in wheels}
    assert len(found) == len(wheels), "two versions of one package in .whl/"
    assert set(found) == set(wanted), f"missing {set(wanted) - set(found)}, extra {set(found) - set(wanted)}"
    for name, wheel in found.items():
        version, digest = wanted[name]
        assert wheel_name(wheel)[1] == version, (wheel.name, version)
        if name != PRUNED:
            assert hashlib.sha256(wheel.read_bytes()).hexdigest() == digest, f"{wheel.name}: hash differs"
    with zipfile.ZipFile(found[PRUNED]) as z:
        record = next(n for n in z.namelist() if n.endswith(".dist-info/RECORD"))
        for line in z.read(record).decode().splitlines():
            name, digest, _ = line.rsplit(",", 2)
            if digest:
                assert record_line(name, z.read(name)) == line, f"RECORD differs for {name}"
        left = kernels(z.read(LIBRARY))
    assert set(left) == {(CUBIN, ARCH)}, f"{LIBRARY} still holds {sorted(left)}"
    print(f"wheels: the {len(wheels)} pinned ones; {LIBRARY}: {left[(CUBIN, ARCH)]} fat binaries, sm_{ARCH} cubins only")
    return wheels


def requirements(wheels: list[Path]) -> None:
    """Every need (for Python 3.12 on Linux) of every wheel and of the project is carried
    or in the image."""
    needs = {}
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            for line in z.read(meta).decode().splitlines():
                if line.startswith("Requires-Dist:"):
                    needs.setdefault(line.split(":", 1)[1].strip(), wheel.name)
    for line in project_needs():
        needs.setdefault(line, "llm-mlx-streaming")
    left = unmet(needs, {wheel_name(w)[0] for w in wheels})
    assert not left, f"needed, neither carried nor in the image: {left}"
    print(f"requirements: the {len(needs)} listed are carried, in the image, or not for Python 3.12 on Linux")


def imports(carried: set[str]) -> None:
    """Everything the device run imports, imported here: each module outside the stdlib
    and the repository comes from a carried wheel or the image."""
    known = carried | IMAGE | OPTIONAL | {"llm-mlx-streaming"}
    for folder in ("benchmarks", "tests", "."):
        sys.path.insert(0, str(ROOT / folder))
    for name in RUN_MODULES:
        importlib.import_module(name)
    owners = metadata.packages_distributions()
    missing = set()
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None) or ""
        if "." in name or name in sys.stdlib_module_names or not path or path.startswith(str(ROOT)) \
                or name.startswith(("_sysconfigdata", "__editable__")):
            continue
        roots = [p for p in sys.path if p and path.startswith(p.rstrip("/") + "/")]
        top = Path(path).relative_to(max(roots, key=len)).parts[0].split(".")[0] if roots else name
        for dist in owners.get(name) or owners.get(top) or [f"no distribution owns {path}"]:
            if STANDS_IN.get(canonical(dist), canonical(dist)) not in known:
                missing.add(f"{dist} ({name})")
    assert not missing, f"imported by the run, neither carried nor in the image: {sorted(missing)}"
    print(f"imports: what {', '.join(RUN_MODULES)} import is carried, in the image or the stdlib")


def python312() -> str | None:
    """A Python 3.12 interpreter on this machine, if there is one."""
    for candidate in [os.environ.get("PYTHON312"), shutil.which("python3.12"),
                      *sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.12*/bin/python3.12")))]:
        if candidate and subprocess.run([candidate, "-c", "import pip"], capture_output=True).returncode == 0:
            return candidate
    return None


def install(wheels: list[Path]) -> None:
    """The device's install command (pip --no-index --no-deps --target) with a Python 3.12,
    and the libraries the installed libmlx.so then lacks: only what the image has.
    Without a Python 3.12, pip's dry run of the install for one."""
    python = python312()
    with tempfile.TemporaryDirectory() as target:
        if python:
            subprocess.run([python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                            "--root-user-action=ignore", "--target", target, *map(str, wheels)], check=True)
            assert glob.glob(f"{target}/mlx/core.cpython-312-*.so") and (Path(target) / "mlx_lm").is_dir()
            ldd = subprocess.run(["ldd", f"{target}/{LIBRARY}"], capture_output=True, text=True, check=True).stdout
            lacking = {line.split()[0] for line in ldd.splitlines() if "not found" in line}
            assert lacking <= FROM_IMAGE, f"{LIBRARY} lacks {sorted(lacking - FROM_IMAGE)}, which the image has not"
            version = subprocess.run([python, "--version"], capture_output=True, text=True).stdout.strip()
            print(f"install: the {len(wheels)} wheels install into a --target dir with {version} ({python}); "
                  f"{LIBRARY} lacks only what the image has ({len(lacking)} libraries)")
            return
        platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--dry-run", "--no-index", "--no-deps",
                        "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
                        *platforms, "--target", target, *map(str, wheels)], check=True)
        print(f"install: no Python 3.12 here; pip's dry run for 3.12 accepts the {len(wheels)} wheels")


def travelling_bytes(carry: list[str]) -> int:
    """Bytes a call sends: tracked and untracked-not-ignored files, shared/, carried paths."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, capture_output=True, check=True).stdout.decode().split("\0")
    files = {ROOT / f for f in listed if f}
    for extra in ["shared", *carry]:
        files.update(p for p in (ROOT / extra).rglob("*") if p.is_file())
    return sum(p.lstat().st_size for p in files if p.exists() or p.is_symlink())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="check .whl/, the install and the size; download nothing")
    parser.add_argument("--plan", action="store_true",
                        help="check the pins against pyproject.toml and the run's imports; no .whl/ needed")
    parser.add_argument("--dest", type=Path, default=WHEELS)
    args = parser.parse_args()
    if args.plan:
        left = unmet(dict.fromkeys(project_needs(), "llm-mlx-streaming"), set(pins()))
        assert not left, f"in pyproject.toml, neither pinned in {PINS.name} nor in the image: {left}"
        print(f"plan: the {len(project_needs())} dependencies of pyproject.toml are pinned, in the image, "
              f"or not for Python 3.12 on Linux")
        imports(set(pins()))
        return
    if not args.check:
        download(args.dest)
    wheels = check_set(args.dest)
    requirements(wheels)
    imports({wheel_name(w)[0] for w in wheels})
    install(wheels)
    size = travelling_bytes([os.path.relpath(args.dest, ROOT)])
    carried = sum(w.stat().st_size for w in wheels)
    print(f"size: the tree and {os.path.relpath(args.dest, ROOT)}/ travel as {size / 2**20:.1f} MiB "
          f"(wheels {carried / 2**20:.1f} MiB) of {LIMIT / 2**20:.0f} MiB")
    assert size < LIMIT, "over what one call may carry"


if __name__ == "__main__":
    main()
