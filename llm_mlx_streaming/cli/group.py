"""The ``llm mlxs`` command group, which each command module adds its commands to."""

import click


@click.group()
def mlxs():
    """Stream Mixture-of-Experts models from disk with MLX (model: mlx-stream)."""
