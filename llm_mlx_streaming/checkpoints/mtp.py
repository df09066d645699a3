"""Multi-token-prediction (MTP) heads: where a checkpoint keeps them and how to build one.

DeepSeek-V3, GLM-4.5 and Qwen3-Next checkpoints carry a small extra block trained to
predict the token after next from the model's last hidden state and the next token's
embedding. mlx-lm's sanitize() drops it at load (or, on an already-converted
checkpoint, refuses its tensors as unexpected), so the engine loads it itself from the
same safetensors. The head is built from mlx-lm's own layer classes, so its decoder
layer (attention, router, shared and routed experts) is the architecture's own code;
only its parameter names are placed the way the checkpoints store them:

- deepseek_v3 / glm4_moe (config ``num_nextn_predict_layers``): one extra decoder layer
  ``model.layers.{num_hidden_layers}.*`` with ``enorm``, ``hnorm``, ``eh_proj`` (2H -> H),
  ``shared_head.norm``, ``shared_head.head`` (its own output projection) and a copy of
  the embedding, ``embed_tokens`` (shared with the target; not read);
- qwen3_next (config ``mtp_num_hidden_layers``, or ``num_nextn_predict_layers``):
  ``mtp.fc`` (2H -> H), ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``,
  ``mtp.layers.0.*`` (a full-attention decoder layer with MoE) and ``mtp.norm``; the
  embedding and ``lm_head`` are the target's.

Both compute ``h' = proj(concat(norm_e(embed(x_{t+1})), norm_h(h_t)))`` (embedding first),
run h' through the decoder layer, and read logits through the final norm and the head.
Tensors are stored in mlx-lm's layout: experts stacked under ``mlp.switch_mlp`` and
norm weights as mlx-lm holds them (Qwen3-Next's zero-centred norms with their +1 applied),
i.e. what a conversion that kept the head writes.
"""

from __future__ import annotations

import contextlib
import io
import sys

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from ..experts.index import CheckpointIndex

__all__ = ["DEPTH_FIELDS", "HEAD_ARCHITECTURES", "MTPHead", "build_head", "declared_layers",
           "has_head", "head_prefix", "output_head", "quantize_head"]

HEAD_ARCHITECTURES = ("deepseek_v3", "glm4_moe", "qwen3_next")

# Config fields that declare the number of MTP layers, by architecture (the first is
# the one a checkpoint of that architecture writes).
DEPTH_FIELDS = {
    "deepseek_v3": ("num_nextn_predict_layers",),
    "glm4_moe": ("num_nextn_predict_layers",),
    "qwen3_next": ("mtp_num_hidden_layers", "num_nextn_predict_layers"),
}
# mlx-lm's decoder layer class of each architecture.
_DECODER_LAYER = {
    "deepseek_v3": "DeepseekV3DecoderLayer",
    "glm4_moe": "DecoderLayer",
    "qwen3_next": "Qwen3NextDecoderLayer",
}


def declared_layers(config: dict) -> int:
    """How many MTP layers config.json declares (0: none, or an architecture without)."""
    for name in DEPTH_FIELDS.get(config.get("model_type"), ()):
        if config.get(name):
            return int(config[name])
    return 0


def has_head(path, config: dict) -> bool:
    """Whether the checkpoint at `path` declares an MTP head and holds its tensors
    (read from the safetensors headers only)."""
    if not declared_layers(config):
        return False
    prefix = head_prefix(config)
    return any(k.startswith(prefix) for k in CheckpointIndex(path).tensors)


def head_prefix(config: dict) -> str:
    """The checkpoint name prefix of the first MTP layer, e.g. ``model.layers.61.``."""
    if config["model_type"] == "qwen3_next":
        return "mtp."
    return f"model.layers.{config['num_hidden_layers']}."


def is_head_tensor(key: str, config: dict) -> bool:
    """True for every tensor of the MTP head(s) (all layers, when several are declared)."""
    if config.get("model_type") == "qwen3_next":
        return key.startswith("mtp.")
    if config.get("model_type") not in DEPTH_FIELDS:
        return False
    parts = key.split(".")
    return (
        len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit()
        and int(parts[2]) >= config["num_hidden_layers"]
    )


class MTPHead(nn.Module):
    """The first MTP layer of a checkpoint; parameter names are the checkpoint's names
    without `head_prefix`.

    ``step(target, tokens, hidden, cache)`` maps pairs (h_t, x_{t+1}) to
    ``(hidden', logits)``: hidden' is what the next chained step takes as its h.
    """

    def __init__(self, arch: str, args, decoder_layer: type):
        super().__init__()
        h, eps = args.hidden_size, args.rms_norm_eps
        self.arch = arch
        if arch == "qwen3_next":
            # layer index whose (idx + 1) % interval == 0: a full-attention layer
            layer = decoder_layer(args, layer_idx=args.full_attention_interval - 1)
            self.fc = nn.Linear(2 * h, h, bias=False)
            self.pre_fc_norm_embedding = nn.RMSNorm(h, eps=eps)
            self.pre_fc_norm_hidden = nn.RMSNorm(h, eps=eps)
            self.layers = [layer]
            self.norm = nn.RMSNorm(h, eps=eps)
        else:
            # The decoder layer's parameters sit at the head's top level, next to the
            # projection and its own output head: model.layers.N.{self_attn,mlp,...}.
            layer = decoder_layer(args, layer_idx=args.num_hidden_layers)
            for name, child in layer.children().items():
                setattr(self, name, child)
            self._layer_call = type(layer).__call__
            self.enorm = nn.RMSNorm(h, eps=eps)
            self.hnorm = nn.RMSNorm(h, eps=eps)
            self.eh_proj = nn.Linear(2 * h, h, bias=False)
            self.shared_head = nn.Module()
            self.shared_head.norm = nn.RMSNorm(h, eps=eps)
            self.shared_head.head = nn.Linear(h, args.vocab_size, bias=False)

    def step(self, target, tokens: mx.array, hidden: mx.array, cache):
        """(hidden', logits) for `tokens` (1, L) and the hidden states (1, L, H) that
        precede them, extending the head's own `cache` by L positions."""
        embedded = target.model.embed_tokens(tokens)
        if self.arch == "qwen3_next":
            x = self.fc(mx.concatenate(
                [self.pre_fc_norm_embedding(embedded), self.pre_fc_norm_hidden(hidden)], axis=-1
            ))
            x = self.layers[0](x, mask=create_attention_mask(x, cache), cache=cache)
            x = self.norm(x)
            return x, output_head(target)(x)
        x = self.eh_proj(mx.concatenate([self.enorm(embedded), self.hnorm(hidden)], axis=-1))
        mask = create_attention_mask(x, cache, return_array=self.arch == "deepseek_v3")
        x = self._layer_call(self, x, mask, cache)
        return x, self.shared_head.head(self.shared_head.norm(x))


def output_head(model):
    """The target's own output projection: lm_head, or the tied embedding as a linear map."""
    lm_head = getattr(model, "lm_head", None)
    return lm_head if lm_head is not None else model.model.embed_tokens.as_linear


def build_head(config: dict) -> MTPHead:
    """An MTP head of mlx-lm's layer classes for `config` (weights not loaded)."""
    from .classes import model_classes

    arch = config["model_type"]
    if arch not in HEAD_ARCHITECTURES:
        raise ValueError(f"{arch} has no MTP head; architectures with one: {HEAD_ARCHITECTURES}")
    model_class, args_class = model_classes(config)
    module = sys.modules[model_class.__module__]
    return MTPHead(arch, args_class.from_dict(config), getattr(module, _DECODER_LAYER[arch]))


def classes_without_head(config: dict):
    """mlx-lm's (model class, args class) for `config`, the model's sanitize() first
    dropping MTP head tensors: mlx-lm drops them itself only in the layouts it expects
    (deepseek_v3 only for layer 61, qwen3_next only with unstacked experts), and its
    strict load would otherwise refuse a converted checkpoint that kept its head."""
    from .classes import model_classes

    model_class, args_class = model_classes(config)
    if not declared_layers(config):
        return model_class, args_class
    return _WITHOUT_HEAD.setdefault(model_class, _subclass_without_head(model_class)), args_class


_WITHOUT_HEAD: dict[type, type] = {}


def _subclass_without_head(model_class: type) -> type:
    def sanitize(self, weights):
        config = {"model_type": self.model_type, "num_hidden_layers": self.args.num_hidden_layers}
        weights = {k: v for k, v in weights.items() if not is_head_tensor(k, config)}
        return model_class.sanitize(self, weights) if hasattr(model_class, "sanitize") else weights

    return type(model_class.__name__, (model_class,), {"sanitize": sanitize,
                                                       "__module__": model_class.__module__})


def quantize_head(head: MTPHead, qparams: dict, prefix: str, model_predicate=None,
                  skip=()) -> dict:
    """Quantize `head` with mlx-lm's quantize_model as the model's layers are
    (`qparams`: group_size, bits, mode; `model_predicate`: the model class's per-path
    choices, asked with checkpoint names). Returns the per-path entries, by checkpoint
    name, that belong in config["quantization"]."""
    from mlx_lm.utils import quantize_model

    def predicate(path, module):
        if path in skip:
            return False
        result = model_predicate(prefix + path, module) if model_predicate else True
        # mlx-lm asks for e.g. 64-wide groups on routers; skip those the width does not allow
        if isinstance(result, dict) and module.weight.shape[-1] % result["group_size"]:
            return False
        return result

    with contextlib.redirect_stdout(io.StringIO()):  # quantize_model prints bits per weight
        _, qconfig = quantize_model(head, {}, qparams["group_size"], qparams["bits"],
                                    mode=qparams["mode"], quant_predicate=predicate)
    return {prefix + k: v for k, v in qconfig["quantization"].items() if k not in qparams}

