"""`llm mlxs verify`: a model's files against hashes known to be right."""

from __future__ import annotations

import click

from ..options.settings import load_settings

from .group import mlxs
from .common import ByteProgress, report_problems
from .lookup import find_checkpoint
from ..checkpoints import integrity


@mlxs.command(short_help="Check a model's files against their known hashes.")
@click.argument("name", required=False)
@click.option("--quick", is_flag=True, help="Hash only files under 16 MB; check the others' sizes and headers")
@click.option("--record", is_flag=True, help="Hash the files now and keep the hashes as the reference (while they are good)")
def verify(name, quick, record):
    """Check every file of a model against hashes known to be right (offline).

    A model from the Hugging Face cache is checked against the content address the
    cache keeps for each file; any other folder against the hashes recorded by
    `llm mlxs add --hash` or `llm mlxs verify --record`. Each bad file is one line;
    the exit status is 1 when any is bad. NAME as for `llm mlxs plan`.

    \b
    llm mlxs verify q30
    llm mlxs verify q30 --quick
    llm mlxs verify ~/models/my-moe --record
    """
    if quick and record:
        raise click.UsageError("--quick and --record do not go together")
    label, path, _ = find_checkpoint(name, load_settings())
    bar = ByteProgress("hashing")
    try:
        if record:
            manifest = integrity.record_manifest(path, progress=bar)
            bar.close()
            click.echo(f"Recorded the hashes of {label} in {manifest}")
            return
        source, expected = integrity.expected_files(path)
        problems = integrity.verify_files(path, expected, quick=quick, progress=bar)
    finally:
        bar.close()
    report_problems(problems, f"{len(problems)} of the {len(expected)} files of {label} do not match {source}")
    click.echo(f"ok: {len(expected)} files match {source}" + (" (quick)" if quick else ""))
