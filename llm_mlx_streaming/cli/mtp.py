"""`llm mlxs import-mtp`: give an mlx-lm model back the MTP head its conversion dropped."""

from __future__ import annotations

import json
from pathlib import Path

import click

from ..errors import SettingsError
from ..options.settings import load_settings

from .group import mlxs
from .models import HF_REPO_RE, hub_error, looks_local, no_folder
from .lookup import find_checkpoint
from ..checkpoints.config import read_config


@mlxs.command("import-mtp", short_help="Put back a model's MTP head (for -o draft mtp).")
@click.argument("name")
@click.argument("source")
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
def import_mtp(name, source, out):
    """Write OUT: the model NAME plus the multi-token-prediction head of SOURCE.

    mlx-lm conversions drop the MTP head that DeepSeek-V3, GLM-4.5 and Qwen3-Next
    checkpoints carry, so `-o draft mtp` cannot use them. SOURCE is the original
    checkpoint (a local folder, or a Hugging Face repo id: only its config, index and
    the shards that hold the head are downloaded). The head is converted and quantized
    like the model's layers; OUT links the model's files (nothing is copied or changed)
    and adds one shard. NAME as for `llm mlxs plan`.

    \b
    llm mlxs import-mtp qwen3-next Qwen/Qwen3-Next-80B-A3B-Instruct ~/models/qwen3-next-mtp
    llm mlxs add ~/models/qwen3-next-mtp --name qwen3-next-mtp
    """
    from ..checkpoints.mtp_import import import_head

    label, path, _ = find_checkpoint(name, load_settings())
    local = Path(source).expanduser()
    if not local.is_dir():
        if looks_local(source) or not HF_REPO_RE.match(source):
            raise no_folder(source)
        local = _fetch_head(source, path)
    out = out.expanduser()
    import_head(path, local, out)
    click.echo(f"Wrote {label} with the MTP head of {source} to {out}")
    click.echo(f"Add it with: llm mlxs add {out}", err=True)


def _fetch_head(repo_id: str, model: Path) -> Path:
    """Download the config, the index and the shards holding the head (cache first)."""
    from ..checkpoints.mtp import head_prefix
    from ..checkpoints.mtp_import import INDEX

    try:
        from huggingface_hub import hf_hub_download
    except ImportError:  # pragma: no cover
        raise SettingsError("huggingface_hub is not installed; give a local folder instead")
    prefix = head_prefix(read_config(model))
    try:
        folder = Path(hf_hub_download(repo_id, "config.json")).parent
        try:
            index = json.loads(Path(hf_hub_download(repo_id, INDEX)).read_text())
            shards = sorted({f for k, f in index["weight_map"].items() if k.startswith(prefix)})
        except Exception:  # a single-file checkpoint has no index
            shards = ["model.safetensors"]
        if shards:
            click.echo(f"Downloading {len(shards)} shard(s) of {repo_id} with the head...", err=True)
        for shard in shards:
            hf_hub_download(repo_id, shard)
    except Exception as exc:
        raise hub_error(repo_id, exc) from None
    return folder
