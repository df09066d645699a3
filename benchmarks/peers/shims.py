"""The peers declare macOS only: what each needs to run on Linux, applied from outside
in the child process (their files are not changed)."""

from __future__ import annotations

from .common import meminfo_bytes


def shim_bigrig() -> list[str]:
    """bigrig_engine/calibrate.py asks macOS `vm_stat` for free memory; Linux has /proc/meminfo."""
    from bigrig_engine import calibrate

    page = calibrate.PAGE

    def vm(key: str) -> int:
        return meminfo_bytes("MemAvailable") // page if key == "Pages free" else 0

    calibrate._vm = vm
    return ["calibrate._vm: /proc/meminfo MemAvailable instead of macOS `vm_stat`"]


def shim_boyle() -> list[str]:
    """boyle/loader.py wants Metal's working-set size; boyle/_runtime.py wants macOS F_NOCACHE."""
    import fcntl

    import mlx.core as mx

    notes = []
    info = mx.device_info
    if "max_recommended_working_set_size" not in info():
        total = meminfo_bytes("MemTotal")
        mx.device_info = lambda: {**info(), "max_recommended_working_set_size": total}
        notes.append("mx.device_info(): max_recommended_working_set_size = MemTotal (CPU MLX has none)")
    if not hasattr(fcntl, "F_NOCACHE"):
        fcntl.F_NOCACHE = fcntl.F_GETFD  # fcntl(fd, F_GETFD, 1): a no-op, reads stay cached
        notes.append("fcntl.F_NOCACHE -> F_GETFD no-op (Linux has no F_NOCACHE: page cache stays on)")
    return notes
