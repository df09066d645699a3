"""Puts the MTP head of an original Hugging Face checkpoint next to an mlx-lm model.

Conversions (mlx_lm.convert, the mlx-community uploads) drop the head, so `-o draft
mtp` finds none in them. `import_head` reads the head from the original checkpoint
(only the shards that hold it), converts it with the model's own mlx-lm `sanitize()`
the way the decoder layers were converted (fp8 dequantized, DeepSeek's `kv_b_proj`
split for MLA, experts stacked, Qwen3-Next's zero-centred norms given their +1), casts
and quantizes it like the model, and writes a new checkpoint folder: every file of the
model linked (never copied or changed), one more shard `model-mtp.safetensors`, and
config.json and the index extended to declare and list it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
from mlx.utils import tree_flatten

from ..errors import CheckpointError
from ..experts.index import read_header, weight_files
from .config import read_config
from .mtp import DEPTH_FIELDS, HEAD_ARCHITECTURES, build_head, declared_layers, head_prefix, quantize_head

HEAD_SHARD = "model-mtp.safetensors"
INDEX = "model.safetensors.index.json"
_DTYPES = {"F32": mx.float32, "F16": mx.float16, "BF16": mx.bfloat16}


def import_head(model_dir: str | os.PathLike, source: str | os.PathLike,
                out: str | os.PathLike) -> Path:
    """Write `out`: the mlx-lm model at `model_dir` plus the MTP head of the Hugging Face
    checkpoint at `source` (the model it was converted from). One-line CheckpointError
    when they do not belong together or the source has no head."""
    model_dir, source, out = (Path(p).expanduser() for p in (model_dir, source, out))
    config, source_config = read_config(model_dir), read_config(source)
    arch = config["model_type"]
    if arch not in HEAD_ARCHITECTURES:
        raise CheckpointError(
            f"{model_dir.name} is {arch}; MTP heads exist for {', '.join(HEAD_ARCHITECTURES)}"
        )
    for field in ("model_type", "hidden_size", "num_hidden_layers", "vocab_size"):
        if source_config.get(field) != config.get(field):
            raise CheckpointError(
                f"{source.name} is not the model {model_dir.name} was converted from "
                f"({field}: {source_config.get(field)!r} vs {config.get(field)!r})"
            )
    if not declared_layers(source_config):
        raise CheckpointError(f"{source.name} declares no MTP head in its config.json")
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"{out} is not empty")

    prefix = head_prefix(config)
    weights = _mlx_layout(arch, config, _read_head(source, prefix))
    config = {**config, DEPTH_FIELDS[arch][0]: 1}  # the first head layer is imported
    head = build_head(config)
    try:
        head.load_weights(list(weights.items()))  # every name and shape
    except ValueError as e:
        raise CheckpointError(f"{source.name}: its MTP head does not fit {arch}: {e}") from None
    head.set_dtype(_dense_dtype(model_dir, config))
    quantization = config.get("quantization")
    per_path = {}
    if quantization:
        qparams = {k: quantization[k] for k in ("group_size", "bits")}
        qparams["mode"] = quantization.get("mode", "affine")
        per_path = quantize_head(head, qparams, prefix, _model_predicate(config))
    tensors = {prefix + k: v for k, v in tree_flatten(head.parameters())}
    mx.eval(tensors)
    _write(model_dir, out, tensors, config, per_path)
    return out


def _read_head(source: Path, prefix: str) -> dict:
    """The first MTP layer's tensors of `source`, read from the shards that hold them."""
    index = source / INDEX
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({source / f for k, f in weight_map.items() if k.startswith(prefix)})
    else:
        files = weight_files(source)
    first = (prefix + "layers.") if prefix == "mtp." else None
    weights = {}
    for file in files:
        if not any(k.startswith(prefix) for k in read_header(file)):
            continue
        for k, v in mx.load(str(file)).items():
            if k.startswith(prefix) and not (first and k.startswith(first)
                                             and not k.startswith(first + "0.")):
                weights[k[len(prefix):]] = v
    if not weights:
        raise CheckpointError(f"{source.name} holds no {prefix}* tensors")
    return weights


def _mlx_layout(arch: str, config: dict, weights: dict) -> dict:
    """Head tensors (relative names, Hugging Face layout) converted by mlx-lm's sanitize,
    run as if the head were decoder layer 0 of a one-layer model."""
    from .classes import model_classes

    model_class, args_class = model_classes(config)
    model = SimpleNamespace(args=args_class.from_dict({**config, "num_hidden_layers": 1}))
    layer = "layers.0." if arch == "qwen3_next" else ""
    renamed = {}
    for k, v in weights.items():
        if k.startswith("embed_tokens."):
            continue  # DeepSeek's copy of the shared embedding: the target's is used
        if k.startswith(layer):
            renamed["model.layers.0." + k[len(layer):]] = v
        elif arch == "qwen3_next" and k == "norm.weight":
            renamed["model.norm.weight"] = v  # sanitize adds the +1
        elif arch == "qwen3_next" and k.startswith("pre_fc_norm_") and v.ndim == 1:
            renamed["head." + k] = v + 1.0  # zero-centred like the other norms
        else:
            renamed["head." + k] = v
    if arch == "qwen3_next" and not any(k.endswith(".experts.0.up_proj.weight") for k in renamed):
        raise CheckpointError("the source's MTP head has no unstacked experts to convert")
    converted = model_class.sanitize(model, renamed)
    back = {}
    for k, v in converted.items():
        if k.startswith("model.layers.0."):
            back[layer + k[len("model.layers.0."):]] = v
        elif k == "model.norm.weight":
            back["norm.weight"] = v
        elif k.startswith("head."):
            back[k[len("head."):]] = v
    return back


def _dense_dtype(model_dir: Path, config: dict):
    """The dtype the model keeps its dense float weights in (its final norm's)."""
    for file in weight_files(model_dir):
        entry = read_header(file).get("model.norm.weight")
        if entry is not None and entry.dtype in _DTYPES:
            return _DTYPES[entry.dtype]
    return mx.bfloat16


def _model_predicate(config: dict):
    """The model class's per-path quantization choices (e.g. 8-bit routers), if any."""
    from .classes import model_classes

    prop = getattr(model_classes(config)[0], "quant_predicate", None)
    return prop.fget(None) if isinstance(prop, property) else None


def _write(model_dir: Path, out: Path, tensors: dict, config: dict, per_path: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if f.is_file() and f.name not in ("config.json", INDEX, HEAD_SHARD):
            os.symlink(f.resolve(), out / f.name)
    mx.save_safetensors(str(out / HEAD_SHARD), tensors, metadata={"format": "mlx"})
    if (model_dir / INDEX).exists():
        index = json.loads((model_dir / INDEX).read_text())
        index["weight_map"].update({k: HEAD_SHARD for k in tensors})
        index["weight_map"] = dict(sorted(index["weight_map"].items()))
        meta = index.setdefault("metadata", {})
        meta["total_size"] = meta.get("total_size", 0) + sum(v.nbytes for v in tensors.values())
        (out / INDEX).write_text(json.dumps(index, indent=4))
    if per_path:
        config["quantization"] = {**config["quantization"], **per_path}
        config["quantization_config"] = config["quantization"]
    (out / "config.json").write_text(json.dumps(config, indent=4))
