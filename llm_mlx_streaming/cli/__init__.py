"""``llm mlxs ...``: settings, the model registry, memory plans, packed stores,
routing traces and figures from logs.db — one module per command group.
docs/llm-plugin.md documents every command.
"""

import click

from . import config, launch, models, mtp, pack, plan, serve, simulate, stats, verify
from .group import mlxs


def register(cli: click.Group) -> None:
    cli.add_command(mlxs)
