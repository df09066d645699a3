"""The model and argument classes mlx-lm would build for a config.

mlx-lm picks them with a private helper (`mlx_lm.utils._get_classes`, as its own loader
does); every use here goes through this one function, so a change in mlx-lm is mended
in one place.
"""

from __future__ import annotations


def model_classes(config: dict) -> tuple[type, type]:
    """(Model, ModelArgs) of the mlx-lm module for `config["model_type"]`."""
    from mlx_lm.utils import _get_classes

    return _get_classes(config)
