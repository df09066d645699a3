"""`llm mlxs pack`: write, verify or remove a checkpoint's packed store."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import click

from ..errors import MlxStreamError, one_line
from ..options.settings import load_settings

from .group import mlxs
from ..sizes import format_size
from .common import ByteProgress, report_problems
from .lookup import has_packed, find_checkpoint
from ..engine.planner import checkpoint_layout
from ..errors import CheckpointError


@mlxs.command(short_help="Pack a model's experts: one read per expert.")
@click.argument("name", required=False)
@click.option("--verify", is_flag=True, help="Check the packed store (every record against its checksum and the checkpoint) instead of packing")
@click.option("--remove", is_flag=True, help="Delete the packed store")
def pack(name, verify, remove):
    """Pack a model's experts into one contiguous record each (one read per expert).

    The packed store is written beside the checkpoint (in mlxs-packed/) and used
    when the packed setting is auto (the default) while it matches the checkpoint.
    NAME as for `llm mlxs plan`.

    \b
    llm mlxs pack q30            write (or rewrite) the store
    llm mlxs pack q30 --verify   check it against the checkpoint: each problem, or ok
    llm mlxs pack q30 --remove   delete it
    """
    from ..checkpoints.packing import pack_checkpoint, verify_packed
    from ..experts.packed import packed_dir, store_files

    if verify and remove:
        raise click.UsageError("--verify and --remove do not go together")
    settings = load_settings()
    label, path, _ = find_checkpoint(name, settings)
    folder = packed_dir(path)
    if remove:
        if not folder.exists():
            raise MlxStreamError(f"{label} has no packed store ({folder})")
        _forget_loaded(path)
        shutil.rmtree(folder)
        click.echo(f"Removed the packed store of {label} ({folder})")
        return
    if verify:
        if not has_packed(path):
            command = f"llm mlxs pack {name}" if name else "llm mlxs pack"
            raise MlxStreamError(f"{label} has no packed store; write one with `{command}`")
        problems = _with_progress(ByteProgress("verifying"), verify_packed, path,
                                  f"Cannot verify the packed store of {label}")
        report_problems(problems, f"the packed store of {label} has {len(problems)} problem"
                        f"{'s' if len(problems) != 1 else ''}; run `llm mlxs pack` again to rewrite it")
        click.echo("ok")
        return
    _check_space(path, folder)
    report = _Progress()
    out = _with_progress(report, pack_checkpoint, path, f"Cannot pack {label}")
    _forget_loaded(path)
    size = sum(p.stat().st_size for p in store_files(out))
    click.echo(f"Packed {label}: {report.layers} MoE layers, {format_size(size)} in {out}")
    if settings.packed == "off":
        click.echo("Note: the packed setting is off; `llm mlxs config packed auto` uses the store", err=True)


class _Progress:
    """pack_checkpoint's progress: a bar on a terminal, a line per layer otherwise."""

    def __init__(self):
        self.bar = None
        self.layers = 0
        self.done = 0
        self.total = 0
        self.tty = sys.stderr.isatty()

    def __call__(self, layer: int, layers: int, done: int, total: int) -> None:
        if self.tty:
            if self.bar is None:
                self.bar = click.progressbar(length=total, label="packing", file=sys.stderr)
                self.bar.__enter__()
            self.bar.update(done - self.done)
        elif layer != self.layers and self.layers:
            self._line(self.layers, layers, self.done, total)
        self.layers, self.done, self.total = layer, done, total
        self._of = layers

    def _line(self, layer, layers, done, total) -> None:
        click.echo(f"layer {layer}/{layers} packed ({format_size(done)} of {format_size(total)})", err=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)
        elif self.layers and self.done == self.total:
            self._line(self.layers, self._of, self.done, self.total)


def _check_space(path: Path, folder: Path) -> None:
    """Refuse to start a pack the disk cannot hold (the store is about the experts' size)."""
    from ..experts.packed import record_size, store_files

    try:
        layout = checkpoint_layout(path)
    except (CheckpointError, ValueError, OSError):
        return  # pack_checkpoint reports it
    need = sum(record_size(b) * layout.num_experts for b in layout.expert_bytes)
    if folder.exists():
        need -= sum(p.stat().st_size for p in store_files(folder))
    free = shutil.disk_usage(path).free
    if need > free:
        raise MlxStreamError(
            f"not enough disk space to pack: the store needs {format_size(need)}, "
            f"{format_size(free)} is free on {path}"
        )


def _forget_loaded(path: Path) -> None:
    """A model loaded in this process (Python callers, tests) reloads on its next
    prompt, so it picks up (or drops) the packed store."""
    manager = sys.modules.get("llm_mlx_streaming.engine.manager")
    if manager is None:
        return
    mgr = manager.get_manager()
    if mgr.checkpoint is not None and mgr.checkpoint == path.expanduser().resolve():
        mgr.unload()


def _with_progress(bar, work, path, failure: str):
    """`work(path, progress=bar)`, the bar closed after; a read or format error is one
    line starting with `failure`."""
    try:
        return work(path, progress=bar)
    except (ValueError, OSError, KeyError) as exc:
        raise MlxStreamError(f"{failure}: {one_line(exc)}") from None
    finally:
        bar.close()

