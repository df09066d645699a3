"""``llm mlxs ...``: settings, the model registry, memory plans, packed stores,
routing traces and figures from logs.db — one module per command group.
docs/llm-plugin.md documents every command.
"""

import click


def register(cli: click.Group) -> None:
    cli.add_command(mlxs)


@click.group()
def mlxs():
    """Stream Mixture-of-Experts models from disk with MLX (model: mlx-stream)."""


from . import config, models, mtp, pack, plan, serve, simulate, stats, verify  # noqa: E402,F401  (they add the commands)
