"""Deterministic tiny random checkpoints in mlx-lm format.

Tests, benchmarks and the bundled demo model need real MoE checkpoints without
downloading any. This builds one with mlx-lm's own model class (so the weight
names, shapes and quantization are exactly what `mlx_lm.convert` writes and
`mlx_lm.load` expects), fills every parameter from a seeded numpy generator (so
the bytes are identical on every machine), and writes it the way mlx-lm does.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import math
import os
import zlib
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.utils import _get_classes, get_total_parameters, quantize_model, save_config

from . import tokenizer
from .support import moe_modules
from .mtp import HEAD_ARCHITECTURES, build_head, head_prefix, quantize_head
from .architectures import (
    ARCHITECTURES,
    EXPERT_WIDTH_FIELD,
    tiny_config,
)

__all__ = [
    "ARCHITECTURES",
    "QUANTS",
    "build_checkpoint",
    "describe",
    "supported_quants",
    "tiny_config",
]

QUANTS = (None, "4bit", "8bit", "mxfp4")

# Bump when the bytes written for the same arguments change, so stale
# checkpoints built by an older factory are rebuilt instead of reused.
FACTORY_VERSION = 2
MARKER = "factory.json"
PARTIAL = "factory.partial"  # present while a build is in progress (or was interrupted)


def supported_quants(arch: str) -> tuple:
    """The entries of QUANTS that apply to `arch`.

    mxfp4 is what gpt-oss ships in; the other architectures are published as
    affine 4/8-bit conversions. Any other MoE module of mlx-lm is built in float32 only.
    """
    if arch not in ARCHITECTURES:
        if arch not in moe_modules():
            raise ValueError(f"unknown architecture {arch!r}; choose from {ARCHITECTURES}")
        return (None,)  # the matrix checks the streaming layer, in float32
    if arch == "gpt_oss":
        return (None, "4bit", "8bit", "mxfp4")
    return (None, "4bit", "8bit")


def quant_params(quant: str, config: dict) -> dict:
    """{"group_size", "bits", "mode"} for a QUANTS name.

    Affine uses mlx-lm's default group size 64, or 32 when the expert matrices'
    input dims are not multiples of 64 (mlx-lm would silently leave such layers
    unquantized, and the experts are the point of these checkpoints).
    """
    if quant == "mxfp4":
        return {"group_size": 32, "bits": 4, "mode": "mxfp4"}
    if quant not in ("4bit", "8bit"):
        raise ValueError(f"unknown quant {quant!r}; choose from {QUANTS}")
    width = config.get(EXPERT_WIDTH_FIELD.get(config["model_type"]) or "intermediate_size")
    group_size = 64 if config["hidden_size"] % 64 == 0 and width % 64 == 0 else 32
    return {"group_size": group_size, "bits": int(quant[0]), "mode": "affine"}


def build_checkpoint(
    path,
    arch: str = "qwen3_moe",
    *,
    quant: str | None = None,
    shards: int = 1,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_experts: int = 8,
    top_k: int = 2,
    moe_intermediate_size: int = 32,
    mtp: bool = False,
    tool_template: bool = False,
    **overrides,
) -> Path:
    """Write a random mlx-lm checkpoint into `path` and return the path.

    Writes config.json, the weights (model.safetensors, or `shards` files
    model-0000i-of-0000n.safetensors) with model.safetensors.index.json,
    tokenizer.json and tokenizer_config.json. A complete checkpoint already at
    `path` that was built with the same arguments is reused: `factory.json`
    records them and is written last, so an interrupted build is redone.
    `overrides` go into config.json (see `tiny_config`). `mtp` adds a multi-token-
    prediction head under the names the real checkpoints use (checkpoints/mtp.py), for
    the architectures in HEAD_ARCHITECTURES. `tool_template` gives the tokenizer a chat
    template with tool support (Qwen's `<tool_call>` format).
    """
    path = Path(path)
    if quant not in supported_quants(arch):
        raise ValueError(f"{arch} supports quant in {supported_quants(arch)}, not {quant!r}")
    if shards < 1:
        raise ValueError("shards must be >= 1")
    if mtp and arch not in HEAD_ARCHITECTURES:
        raise ValueError(f"mtp heads exist for {HEAD_ARCHITECTURES}, not {arch!r}")
    if mtp:  # recorded only when set, so existing checkpoints keep their marker
        overrides = {**_MTP_CONFIG[arch], **overrides}
    arguments = _normalise(
        dict(
            arch=arch,
            quant=quant,
            shards=shards,
            seed=seed,
            hidden_size=hidden_size,
            num_layers=num_layers,
            num_experts=num_experts,
            top_k=top_k,
            moe_intermediate_size=moe_intermediate_size,
            overrides=overrides,
            **({"mtp": True} if mtp else {}),
            **({"tool_template": True} if tool_template else {}),
        )
    )
    path.mkdir(parents=True, exist_ok=True)
    with _locked(path):
        if _is_complete(path, arguments):
            return path
        _claim(path)
        _remove_outputs(path)

        config = tiny_config(
            arch,
            hidden_size=hidden_size,
            num_layers=num_layers,
            num_experts=num_experts,
            top_k=top_k,
            moe_intermediate_size=moe_intermediate_size,
            **overrides,
        )
        # On the CPU everywhere, so quantized bytes do not depend on the backend.
        with mx.stream(mx.cpu):
            model, config = _make_model(config, seed, quant)
            head = _make_head(model, config, seed, quant) if mtp else {}
            files = _save_weights(path, model, shards, head)
        del model
        save_config(config, path / "config.json")
        tokenizer.write_tokenizer(path, tool_template=tool_template)

        marker = {"factory_version": FACTORY_VERSION, "arguments": arguments, "files": files}
        tmp = path / (MARKER + ".tmp")
        tmp.write_text(json.dumps(marker, indent=2))
        tmp.replace(path / MARKER)
        (path / PARTIAL).unlink()
    return path


def describe(path) -> dict:
    """{"arch", "num_layers", "num_experts", "top_k", "quant"} of a checkpoint, from its
    config.json (so it also works on checkpoints written by mlx_lm.convert)."""
    from .config import describe as describe_config, read_config

    info = describe_config(read_config(Path(path)))
    return {
        "arch": info["architecture"],
        "num_layers": info["layers"],
        "num_experts": info["experts"] or 0,
        "top_k": info["top_k"] or 0,
        "quant": info["quant"],
    }


# -- building ---------------------------------------------------------------


def _make_model(config: dict, seed: int, quant: str | None):
    """Instantiate mlx-lm's model, fill it block by block, quantizing as we go.

    Working one decoder layer at a time keeps at most one layer in float32
    next to the (quantized) rest, so large checkpoints fit in memory.
    """
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    blocks: dict[str, list] = {}
    for key, value in tree_flatten(model.parameters()):
        blocks.setdefault(_block(key), []).append((key, value.shape))
    # decoder layers first, then embeddings / final norm / lm_head
    order = sorted(blocks, key=lambda b: (b == "", _layer_index(b)))

    qparams = quant_params(quant, config) if quant else None
    model_predicate = getattr(model, "quant_predicate", None)
    per_path: dict = {}
    special = _unused_token_ids(config)
    for block in order:
        new = [
            (key, mx.array(_init_array(key, shape, seed, config, special)))
            for key, shape in blocks[block]
        ]
        model.update(tree_unflatten(new))
        del new
        if qparams:
            per_path.update(_quantize_block(model, block, qparams, model_predicate))
        # Evaluate only this block: the others still hold MLX's lazy random init.
        mx.eval([v for k, v in tree_flatten(model.parameters()) if _block(k) == block])
    if qparams:
        config = dict(config)
        config["quantization"] = {**qparams, **per_path}
        config["quantization_config"] = config["quantization"]
    return model, config


# The config field that declares the head, as the real checkpoints spell it.
_MTP_CONFIG = {
    "deepseek_v3": {"num_nextn_predict_layers": 1},
    "glm4_moe": {"num_nextn_predict_layers": 1},
    "qwen3_next": {"mtp_num_hidden_layers": 1},
}


def _make_head(model, config: dict, seed: int, quant: str | None) -> dict:
    """The MTP head's tensors by checkpoint name, filled and quantized like the model's.

    Each tensor is drawn from its own checkpoint name's stream. DeepSeek-style heads
    carry their own output projection and a copy of the embedding; here both are the
    target's (the DeepSeek-V3 report shares them), so the head drafts printable tokens.
    Per-path quantization entries are added to `config["quantization"]`.
    """
    prefix = head_prefix(config)
    head = build_head(config)
    special = _unused_token_ids(config)
    head.update(tree_unflatten([
        (key, mx.array(_init_array(prefix + key, value.shape, seed, config, special)))
        for key, value in tree_flatten(head.parameters())
    ]))
    if quant:
        # shared_head.head is replaced by the target's lm_head below
        config["quantization"].update(quantize_head(
            head, quant_params(quant, config), prefix,
            getattr(model, "quant_predicate", None), skip=("shared_head.head",),
        ))
        config["quantization_config"] = config["quantization"]
    weights = dict(tree_flatten(head.parameters()))
    if "shared_head" in head:
        weights = {k: v for k, v in weights.items() if not k.startswith("shared_head.head.")}
        weights.update({f"shared_head.head.{k}": v
                        for k, v in tree_flatten(model.lm_head.parameters())})
        weights.update({f"embed_tokens.{k}": v
                        for k, v in tree_flatten(model.model.embed_tokens.parameters())})
    mx.eval(weights)
    return {prefix + k: v for k, v in weights.items()}


def _quantize_block(model, block, qparams, model_predicate) -> dict:
    """Quantize the modules of one block with mlx-lm's quantize_model.

    Returns the per-layer entries (e.g. the 8-bit routers some models ask for)
    that quantize_model records in config["quantization"].
    """

    def predicate(path, module):
        if _block(path + ".") != block:
            return False
        result = model_predicate(path, module) if model_predicate else True
        # mlx-lm asks for e.g. 64-wide groups on routers; skip those the width
        # does not allow instead of failing.
        if isinstance(result, dict) and module.weight.shape[-1] % result["group_size"]:
            return False
        return result

    with contextlib.redirect_stdout(io.StringIO()):  # quantize_model prints bpw
        _, qconfig = quantize_model(
            model,
            {},
            qparams["group_size"],
            qparams["bits"],
            mode=qparams["mode"],
            quant_predicate=predicate,
        )
    return {k: v for k, v in qconfig["quantization"].items() if k not in qparams}


def _init_array(key: str, shape, seed: int, config: dict, zero_rows) -> np.ndarray:
    """A float32 value for parameter `key`, drawn from a stream seeded by (seed, arch, key).

    Seeding per key makes every tensor independent of build order and of the
    other tensors. Values come from PCG64's raw output, which numpy guarantees
    stable across versions and platforms (its distributions are not), so the
    checkpoint is bit-identical everywhere. Weights are uniform with std
    1/sqrt(fan_in) and norms are 1, which keeps activations O(1).
    """
    arch = config["model_type"]
    bits = np.random.PCG64([seed, zlib.crc32(arch.encode()), zlib.crc32(key.encode())])
    parts = key.split(".")
    leaf, owner = parts[-1], parts[-2] if len(parts) > 1 else ""

    def rand(std):
        a = _uniform(bits, shape)
        a *= np.float32(std * math.sqrt(3.0))
        return a

    if leaf == "weight" and "norm" in owner:
        return np.ones(shape, np.float32)
    if leaf == "e_score_correction_bias":  # deepseek / glm routing bias
        return rand(0.02)
    if leaf == "bias":
        return rand(0.05)
    if leaf == "sinks":  # gpt-oss attention sinks
        return rand(0.5)
    if leaf == "A_log":  # qwen3-next gated delta decay: log(A), A in [1, 16)
        return np.log(8.5 + 7.5 * _uniform(bits, shape))
    if leaf == "dt_bias":
        return 1.0 + rand(0.1)
    if owner == "conv1d":  # depthwise conv weight (channels, kernel, 1)
        return rand(1.0 / math.sqrt(math.prod(shape[1:])))
    if owner == "embed_tokens":
        w = rand(1.0)
        if config.get("tie_word_embeddings"):
            w[zero_rows] = 0.0  # it is the output projection too; see below
        return w
    w = rand(1.0 / math.sqrt(shape[-1]))
    if owner == "lm_head":
        # Padding ids have no token, special tokens would end generation early
        # and lone bytes print as junk; a zero row keeps their logit at 0,
        # below the typical maximum over the other ~300 tokens.
        w[zero_rows] = 0.0
    return w


def _uniform(bits: np.random.PCG64, shape) -> np.ndarray:
    """float32 uniform on [-1, 1): 16-bit steps cut from the raw 64-bit stream (fast)."""
    n = math.prod(shape)
    raw = bits.random_raw(-(-n // 4)).astype("<u8", copy=False)
    a = raw.view("<i2")[:n].astype(np.float32).reshape(shape)
    a *= np.float32(1.0 / 32768)
    return a


def _unused_token_ids(config: dict) -> np.ndarray:
    """Ids the random model should never emit: padding, special, and non-text tokens."""
    ids = tokenizer.token_ids()
    special = [ids[t] for t in tokenizer.SPECIAL_TOKENS + tokenizer.THINK_TOKENS]
    padding = range(ids["size"], config["vocab_size"])
    unused = set(special).union(padding, tokenizer.unprintable_ids())
    return np.array(sorted(unused), dtype=np.int64)


def _block(key: str) -> str:
    """Group key: everything up to the first numeric component ("model.layers.3")."""
    parts = key.split(".")
    for i, p in enumerate(parts[:-1]):
        if p.isdigit():
            return ".".join(parts[: i + 1])
    return ""


def _layer_index(block: str) -> int:
    return int(block.rsplit(".", 1)[-1]) if block else -1


# -- writing ----------------------------------------------------------------


def _save_weights(path: Path, model, shards: int, extra: dict) -> list[str]:
    """Save like mlx_lm.utils.save_model, but split into `shards` files of ~equal size;
    `extra` tensors (an MTP head) are saved with the model's."""
    weights = {**dict(tree_flatten(model.parameters())), **extra}
    keys = sorted(weights)
    shards = min(shards, len(keys))
    total = sum(weights[k].nbytes for k in keys)
    # Contiguous runs of the sorted keys, cut where the running size crosses
    # each 1/shards mark, every shard keeping at least one tensor.
    cumulative = np.cumsum([weights[k].nbytes for k in keys])
    cuts = [0]
    for j in range(1, shards):
        cut = int(np.searchsorted(cumulative, total * j / shards)) + 1
        cuts.append(min(max(cut, cuts[-1] + 1), len(keys) - (shards - j)))
    cuts.append(len(keys))
    groups = [keys[a:b] for a, b in zip(cuts, cuts[1:])]
    names = (
        ["model.safetensors"]
        if shards == 1
        else [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    )
    weight_map = {}
    for name, group in zip(names, groups):
        mx.save_safetensors(
            str(path / name), {k: weights[k] for k in group}, metadata={"format": "mlx"}
        )
        weight_map.update({k: name for k in group})
    index = {
        "metadata": {"total_size": total, "total_parameters": get_total_parameters(model)},
        "weight_map": dict(sorted(weight_map.items())),
    }
    with open(path / "model.safetensors.index.json", "w") as f:
        json.dump(index, f, indent=4)
    return names + ["model.safetensors.index.json", "config.json", "tokenizer.json",
                    "tokenizer_config.json"]


def _normalise(arguments: dict) -> dict:
    """The JSON form of the arguments, so a fresh call compares equal to the marker."""
    return json.loads(json.dumps(arguments, sort_keys=True))


def _is_complete(path: Path, arguments: dict) -> bool:
    try:
        marker = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return (
        marker.get("factory_version") == FACTORY_VERSION
        and marker.get("arguments") == arguments
        and all((path / f).is_file() for f in marker.get("files", ()))
    )


def _claim(path: Path) -> None:
    """Refuse to overwrite a checkpoint the factory did not write (e.g. a real model)."""
    ours = (path / MARKER).exists() or (path / PARTIAL).exists()
    if not ours and ((path / "config.json").exists() or any(path.glob("model*.safetensors"))):
        raise FileExistsError(f"{path} holds a checkpoint not built by the factory")
    (path / PARTIAL).touch()


def _remove_outputs(path: Path) -> None:
    """Delete what a previous build wrote (stale shards would be loaded too)."""
    (path / MARKER).unlink(missing_ok=True)
    for f in path.glob("model*.safetensors"):
        f.unlink()
    for name in ("model.safetensors.index.json", "config.json", "tokenizer.json",
                 "tokenizer_config.json"):
        (path / name).unlink(missing_ok=True)


@contextlib.contextmanager
def _locked(path: Path):
    """Serialise concurrent builds into the same directory (e.g. parallel tests).

    Locks the directory itself, so no lock file is left in the checkpoint.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock
