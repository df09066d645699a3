"""Tiny `config.json` dicts for the mlx-lm model classes the factory supports.

Each builder maps the factory's generic knobs (number of experts, top-k,
expert width) onto the architecture's own field names, and picks the extra
fields so that every code path the streaming engine must handle exists even in
a 2-layer model: dense-first layers, shared experts, grouped routing, linear
attention, sliding windows.
"""

from __future__ import annotations

from . import tokenizer

ARCHITECTURES = (
    "qwen3_moe",
    "qwen2_moe",
    "mixtral",
    "olmoe",
    "deepseek_v3",
    "gpt_oss",
    "qwen3_next",
    "glm4_moe",
    "qwen3",
)

# What `config["architectures"]` says in the real Hugging Face checkpoints.
_HF_CLASS = {
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

# The config field each architecture uses for the generic knobs (None: dense).
EXPERTS_FIELD = {
    "qwen3_moe": "num_experts",
    "qwen2_moe": "num_experts",
    "mixtral": "num_local_experts",
    "olmoe": "num_experts",
    "deepseek_v3": "n_routed_experts",
    "gpt_oss": "num_local_experts",
    "qwen3_next": "num_experts",
    "glm4_moe": "n_routed_experts",
    "qwen3": None,
}
EXPERT_WIDTH_FIELD = {
    "qwen3_moe": "moe_intermediate_size",
    "qwen2_moe": "moe_intermediate_size",
    "mixtral": "intermediate_size",
    "olmoe": "intermediate_size",
    "deepseek_v3": "moe_intermediate_size",
    "gpt_oss": "intermediate_size",
    "qwen3_next": "moe_intermediate_size",
    "glm4_moe": "moe_intermediate_size",
    "qwen3": None,
}


def default_vocab_size() -> int:
    """The tokenizer's size rounded up to a multiple of 64, as real models pad it."""
    n = tokenizer.token_ids()["size"]
    return -(-n // 64) * 64


def _heads(hidden_size: int) -> tuple[int, int, int]:
    """(num heads, num kv heads, head dim): head dim 16..64, GQA with 2 q per kv."""
    head_dim = max(8, min(64, hidden_size // 4))
    heads = max(1, hidden_size // head_dim)
    return heads, max(1, heads // 2), head_dim


def _expert_groups(num_experts: int, top_k: int) -> tuple[int, int]:
    """(n_group, topk_group) for sigmoid group routing; n_group > 1 when possible.

    mlx-lm scores a group by its top-2 experts, so a group needs >= 2 experts.
    """
    for n_group in (8, 4, 2):
        size = num_experts // n_group
        if num_experts % n_group == 0 and size >= 2:
            topk_group = max(1, n_group // 2)
            while topk_group * size < top_k:
                topk_group += 1
            return n_group, topk_group
    return 1, 1


def tiny_config(
    arch: str,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_experts: int = 8,
    top_k: int = 2,
    moe_intermediate_size: int = 32,
    vocab_size: int | None = None,
    **overrides,
) -> dict:
    """config.json dict for mlx-lm's model class of `arch` (model_type=arch).

    The ARCHITECTURES have hand-picked fields; any other MoE module of mlx-lm gets
    `generic_config` (where a `head_dim` override sets every attention head dim, see
    there). `overrides` are applied last, so any field can be forced.
    """
    if arch not in ARCHITECTURES:
        return _generic_checkpoint_config(
            arch, hidden_size=hidden_size, num_layers=num_layers, num_experts=num_experts,
            top_k=top_k, moe_intermediate_size=moe_intermediate_size,
            head_dim=overrides.pop("head_dim", None), vocab_size=vocab_size, overrides=overrides,
        )
    if EXPERTS_FIELD[arch] is not None and not 1 <= top_k <= num_experts:
        raise ValueError(f"need 1 <= top_k <= num_experts, got {top_k=} {num_experts=}")
    heads, kv_heads, head_dim = _heads(hidden_size)
    ids = tokenizer.token_ids()
    cfg = {
        "model_type": arch,
        "architectures": [_HF_CLASS[arch]],
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": 2 * hidden_size,  # dense MLPs
        "vocab_size": vocab_size or default_vocab_size(),
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "max_position_embeddings": 4096,
        # Untied everywhere: with tied random embeddings the current token's
        # own logit dominates and greedy decoding repeats it at once.
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "eos_token_id": ids[tokenizer.IM_END],
        "pad_token_id": ids[tokenizer.ENDOFTEXT],
    }
    if cfg["vocab_size"] < ids["size"]:
        raise ValueError(f"vocab_size must be >= the tokenizer's {ids['size']}")
    if EXPERTS_FIELD[arch]:
        cfg[EXPERTS_FIELD[arch]] = num_experts
        cfg[EXPERT_WIDTH_FIELD[arch]] = moe_intermediate_size
        cfg["num_experts_per_tok"] = top_k
    _ARCH_FIELDS[arch](cfg, num_layers=num_layers, num_experts=num_experts, top_k=top_k)
    cfg.update(overrides)
    return cfg


def _qwen3_moe(cfg, **_):
    cfg.update(decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)


def _qwen2_moe(cfg, **_):
    # Qwen2-MoE's attention takes head_dim = hidden // heads; _heads() keeps that.
    cfg.update(
        shared_expert_intermediate_size=2 * cfg["moe_intermediate_size"],
        rope_theta=1000000.0,
    )


def _mixtral(cfg, **_):
    cfg.update(rope_theta=1000000.0)


def _olmoe(cfg, **_):
    # mlx-lm's default ties the embeddings for OLMoE; keep an lm_head like the others.
    cfg.update(norm_topk_prob=False, attention_bias=False, mlp_bias=False)


def _grouped_routing(arch, num_layers, num_experts, top_k) -> dict:
    """DeepSeek-style routing (shared by glm4_moe): a dense first layer, one shared
    expert, and sigmoid scores picked group-first."""
    if num_layers < 2:
        raise ValueError(f"{arch} needs num_layers >= 2 (layer 0 is dense)")
    n_group, topk_group = _expert_groups(num_experts, top_k)
    return dict(
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=n_group,
        topk_group=topk_group,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
    )


def _deepseek_v3(cfg, *, num_layers, num_experts, top_k):
    h = cfg["hidden_size"]
    cfg.update(
        _grouped_routing("deepseek_v3", num_layers, num_experts, top_k),
        num_key_value_heads=cfg["num_attention_heads"],
        moe_layer_freq=1,
        q_lora_rank=h // 2,
        kv_lora_rank=h // 2,
        qk_rope_head_dim=max(4, cfg["head_dim"] // 2),
        qk_nope_head_dim=cfg["head_dim"],
        v_head_dim=cfg["head_dim"],
        attention_bias=False,
    )


def _gpt_oss(cfg, *, num_layers, **_):
    if num_layers < 2:
        raise ValueError("gpt_oss needs num_layers >= 2 (one sliding, one full layer)")
    # Alternate sliding and full attention (the real model does too), with a
    # window small enough that a short generation wraps the rotating cache.
    cfg.update(
        sliding_window=16,
        layer_types=[
            "sliding_attention" if i % 2 == 0 else "full_attention"
            for i in range(num_layers)
        ],
        rope_theta=150000,
        rms_norm_eps=1e-5,
    )


def _qwen3_next(cfg, *, num_layers, **_):
    h = cfg["hidden_size"]
    k_dim = cfg["head_dim"]
    cfg.update(
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        shared_expert_intermediate_size=cfg["moe_intermediate_size"],
        # Every `full_attention_interval`-th layer is full attention, the rest
        # linear (gated delta net); with >= 2 layers both kinds exist.
        full_attention_interval=max(2, min(4, num_layers)),
        linear_num_key_heads=max(1, h // (2 * k_dim)),
        linear_num_value_heads=max(1, h // k_dim),
        linear_key_head_dim=k_dim,
        linear_value_head_dim=k_dim,
        linear_conv_kernel_dim=4,
        partial_rotary_factor=0.25,
        attention_bias=False,
    )


def _glm4_moe(cfg, *, num_layers, num_experts, top_k):
    cfg.update(
        _grouped_routing("glm4_moe", num_layers, num_experts, top_k),
        use_qk_norm=True,
        attention_bias=True,
        partial_rotary_factor=0.5,
    )


def _qwen3(cfg, **_):
    pass


_ARCH_FIELDS = {
    "qwen3_moe": _qwen3_moe,
    "qwen2_moe": _qwen2_moe,
    "mixtral": _mixtral,
    "olmoe": _olmoe,
    "deepseek_v3": _deepseek_v3,
    "gpt_oss": _gpt_oss,
    "qwen3_next": _qwen3_next,
    "glm4_moe": _glm4_moe,
    "qwen3": _qwen3,
}


# -- any mlx-lm module, built from its own ModelArgs -------------------------

# Small values for the ModelArgs fields mlx-lm's families share, by field name:
# "H" hidden size, "2H" dense MLP width, "L" layers, "E" experts, "K" experts per
# token, "W" expert width, "V" vocabulary. Fields not named here keep mlx-lm's default.
_GENERIC_FIELDS = {
    "hidden_size": "H", "d_model": "H", "model_dim": "H",
    "num_hidden_layers": "L", "n_layers": "L", "num_layers": "L",
    "num_attention_heads": 4, "n_heads": 4, "num_heads": 4, "swa_num_attention_heads": 4,
    "num_key_value_heads": 2, "swa_num_key_value_heads": 2, "num_attention_groups": 2,
    "num_global_key_value_heads": 2,
    "head_dim": 16, "v_head_dim": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
    "swa_head_dim": 16, "swa_v_head_dim": 16, "global_head_dim": 16, "index_head_dim": 16,
    "index_n_heads": 2, "index_topk": 8, "rotary_dim": 8,
    "kv_lora_rank": 32, "q_lora_rank": 32, "o_lora_rank": 32,
    "intermediate_size": "2H", "ffn_hidden_size": "2H",
    "moe_intermediate_size": "W", "expert_ffn_hidden_size": "W",
    "shared_expert_intermediate_size": "W", "moe_shared_expert_intermediate_size": "W",
    "shared_intermediate_size": "W", "share_expert_dim": "W",
    "num_experts": "E", "n_routed_experts": "E", "num_local_experts": "E",
    "moe_num_experts": "E",
    "num_experts_per_tok": "K", "moe_topk": "K", "moe_k": "K", "moe_top_k": "K",
    "num_experts_per_token": "K", "top_k_experts": "K",
    "n_shared_experts": 1, "num_shared_experts": 1, "num_shared_expert": 1,
    "moe_num_shared_experts": 1,
    "vocab_size": "V", "num_vocab": "V", "vocab_size_per_layer_input": "V",
    "max_position_embeddings": 4096, "model_max_length": 4096,
    "rope_theta": 10000.0, "rope_scaling": None, "tie_word_embeddings": False,
    "n_group": 2, "topk_group": 1, "num_expert_group": 2,
    "first_k_dense_replace": 1, "num_dense_layers": 1,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "moe_layer_freq": 1,
    "norm_topk_prob": True, "routed_scaling_factor": 1.0,
    "sliding_window": 16, "sliding_window_size": 16, "partial_rotary_factor": 0.5,
    "rms_norm_eps": 1e-6, "layernorm_epsilon": 1e-6, "layer_norm_epsilon": 1e-6,
    "norm_eps": 1e-6,
    "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 16,
    "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
    "hidden_size_per_layer_input": 16,
}
_REQUIRED_BY_TYPE = {bool: False, int: 1, float: 1.0}
# What generic_config's `head_dim` sets: the dims of what attention caches ...
_HEAD_DIM_FIELDS = ("head_dim", "v_head_dim", "swa_head_dim", "swa_v_head_dim", "global_head_dim")
# ... and, where the head dim is hidden // heads, the head counts.
_HEADS_FIELDS = ("num_attention_heads", "n_heads", "num_heads")
_KV_HEADS_FIELDS = ("num_key_value_heads",)


def _alternate(num_layers: int, first: str, second: str) -> list[str]:
    return [first if i % 2 == 0 else second for i in range(num_layers)]


def _rope(theta: float = 10000.0, **extra) -> dict:
    return {"rope_theta": theta, "rope_type": "default", **extra}


# What a family needs beyond the shared fields, as a function of the layer count:
# layer patterns with both kinds of layer, dicts mlx-lm indexes without a default.
_FAMILY_FIELDS = {
    "afmoe": lambda n: {"layer_types": _alternate(n, "sliding_attention", "full_attention")},
    "deepseek_v2": lambda n: {"rope_scaling": {
        "factor": 1.0, "mscale_all_dim": 0, "original_max_position_embeddings": 4096,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1}},
    "exaone_moe": lambda n: {
        "layer_types": _alternate(n, "sliding_attention", "full_attention"),
        "is_moe_layer": [i > 0 for i in range(n)], "rope_parameters": _rope()},
    "gemma4_text": lambda n: {
        "enable_moe_block": True, "num_kv_shared_layers": 0,
        "layer_types": _alternate(n, "sliding_attention", "full_attention")},
    "granitemoehybrid": lambda n: {
        "layer_types": _alternate(n, "mamba", "attention"), "mamba_n_heads": 4,
        # heads x head dim = mamba_expand (2) x hidden, as transformers checks
        "mamba_d_head": 32, "mamba_proj_bias": False, "mamba_d_state": 16,
        "mamba_d_conv": 4, "mamba_n_groups": 1, "mamba_conv_bias": True,
        "shared_intermediate_size": 32, "rope_parameters": _rope()},
    "hunyuan": lambda n: {"rope_scaling": {"alpha": 1.0, "factor": 1.0, "type": "dynamic"}},
    "kimi_k3": lambda n: {
        "linear_attn_config": {"kda_layers": list(range(1, n, 2)), "num_heads": 4,
                               "head_dim": 16, "short_conv_kernel_size": 4},
        "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "first_k_dense_replace": 0},
    # mlx-lm's Llama 4 routes to one expert and takes layer 3's cache as the global one
    "llama4": lambda n: {"num_experts_per_tok": 1, "interleave_moe_layer_step": 1,
                         "attention_chunk_size": 16, "num_hidden_layers": max(n, 4),
                         "intermediate_size_mlp": 128},
    "minimax_m3_vl": lambda n: {"moe_layer_freq": [1] * n},
    "muse_spark": lambda n: {
        "num_shared_experts": 0, "rope_parameters": _rope(), "post_norm_eps": 1e-6,
        "layer_rope_theta": [10000.0] * n, "moe_hidden_size": 32,
        "layer_types": _alternate(n, "sliding_attention", "full_attention"),
        "final_logit_softcapping": 30.0, "output_multiplier": 1.0},
    "qwen3_5": lambda n: {"full_attention_interval": 2},
    "qwen3_5_moe": lambda n: {"full_attention_interval": 2},
    "jamba": lambda n: {
        "attn_layer_offset": 1, "attn_layer_period": 2, "expert_layer_offset": 0,
        "expert_layer_period": 1, "mamba_d_conv": 4, "mamba_d_state": 16,
        "mamba_expand": 2},
    "kimi_linear": lambda n: {
        "linear_attn_config": {"kda_layers": list(range(1, n, 2)), "num_heads": 4,
                               "head_dim": 16, "short_conv_kernel_size": 4},
        "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "first_k_dense_replace": 0},
    "lfm2_moe": lambda n: {
        "layer_types": _alternate(n, "conv", "full_attention"), "conv_L_cache": 3,
        "rope_parameters": _rope()},
    "mellum": lambda n: {
        "layer_types": _alternate(n, "sliding_attention", "full_attention"),
        "rope_parameters": {"sliding_attention": _rope(), "full_attention": _rope()}},
    "mimo_v2_flash": lambda n: {
        "hybrid_layer_pattern": [i % 2 for i in range(n)], "moe_layer_freq": [1] * n,
        "topk_method": "noaux_tc", "scoring_func": "sigmoid"},
    "mistral4": lambda n: {"rope_parameters": _rope(
        llama_4_scaling_beta=0.1, original_max_position_embeddings=4096)},
    "glm_moe_dsa": lambda n: {"rope_parameters": _rope(), "topk_method": "noaux_tc",
                              "scoring_func": "sigmoid"},
    "glm4_moe_lite": lambda n: {"num_nextn_predict_layers": 0},
    "longcat_flash": lambda n: {"mla_scale_q_lora": True, "mla_scale_kv_lora": True,
                                "zero_expert_type": "identity", "attention_method": "MLA"},
    "longcat_flash_ngram": lambda n: {"mla_scale_q_lora": True, "mla_scale_kv_lora": True},
    "nemotron_h": lambda n: {
        "hybrid_override_pattern": list("M*E" + "E" * max(0, n - 3)),
        "mamba_num_heads": 4, "mamba_head_dim": 16, "ssm_state_size": 16,
        "conv_kernel": 4, "n_groups": 1, "layer_norm_epsilon": 1e-5},
    "dbrx": lambda n: {"ffn_config": {"ffn_hidden_size": 32, "moe_num_experts": 8,
                                      "moe_top_k": 2},
                       "attn_config": {"kv_n_heads": 2, "clip_qkv": 8, "rope_theta": 10000.0}},
}


def _generic_checkpoint_config(arch, *, vocab_size, overrides, **sizes) -> dict:
    """generic_config plus what every factory checkpoint's config.json says."""
    from .support import moe_modules

    if arch not in moe_modules():
        raise ValueError(
            f"unknown architecture {arch!r}; choose from {ARCHITECTURES} "
            "or any MoE module of mlx-lm"
        )
    if not 1 <= sizes["top_k"] <= sizes["num_experts"]:
        raise ValueError(f"need 1 <= top_k <= num_experts, got {sizes}")
    ids = tokenizer.token_ids()
    vocab_size = vocab_size or default_vocab_size()
    cfg = generic_config(arch, vocab_size=vocab_size, **sizes)
    cfg.update(
        vocab_size=vocab_size,  # also where the module names it otherwise (num_vocab)
        torch_dtype="float32",
        eos_token_id=ids[tokenizer.IM_END],
        pad_token_id=ids[tokenizer.ENDOFTEXT],
    )
    cfg.update(overrides)
    return cfg


def mlx_lm_args_class(module: str):
    """The ModelArgs class of `mlx_lm.models.<module>`."""
    import importlib

    return importlib.import_module(f"mlx_lm.models.{module}").ModelArgs


def text_args_class(module: str):
    """For a wrapper whose ModelArgs holds a `text_config`, the dataclass that reads it:
    the module's own TextArgs / TextModelArgs, or the ModelArgs of the mlx-lm module it
    builds its text model from; None when the ModelArgs has no text_config."""
    import dataclasses
    import importlib
    import inspect

    mod = importlib.import_module(f"mlx_lm.models.{module}")
    if "text_config" not in {f.name for f in dataclasses.fields(mod.ModelArgs)}:
        return None
    for name in ("TextArgs", "TextModelArgs"):
        if hasattr(mod, name):
            return getattr(mod, name)
    for value in vars(mod).values():
        source = value if inspect.ismodule(value) else inspect.getmodule(value)
        if source is None or source is mod or not source.__name__.startswith("mlx_lm.models."):
            continue
        for name in ("TextModelArgs", "TextArgs", "ModelArgs"):
            if hasattr(source, name) and source.__name__ != "mlx_lm.models.base":
                return getattr(source, name)
    return None


def generic_config(
    module: str,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_experts: int = 8,
    top_k: int = 2,
    moe_intermediate_size: int = 32,
    head_dim: int | None = None,
    vocab_size: int,
) -> dict:
    """Model fields for `mlx_lm.models.<module>`, filled from the fields of its own
    ModelArgs (a wrapper's text model's fields go under `text_config`).

    `head_dim` (default 16) sets the cached keys' and values' head dims; a family whose
    args have no head_dim field (it is hidden // heads there) gets hidden // head_dim heads.
    """
    import dataclasses
    import typing

    symbols = {"H": hidden_size, "2H": 2 * hidden_size, "L": num_layers, "E": num_experts,
               "K": top_k, "W": moe_intermediate_size, "V": vocab_size}

    def fill(args_class) -> dict:
        hints = typing.get_type_hints(args_class)
        fields = dataclasses.fields(args_class)
        cfg = {}
        for f in fields:
            if f.name in _GENERIC_FIELDS:
                value = _GENERIC_FIELDS[f.name]
                cfg[f.name] = symbols[value] if isinstance(value, str) else value
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                cfg[f.name] = _REQUIRED_BY_TYPE.get(hints.get(f.name))
        if head_dim is not None:
            cfg.update({k: head_dim for k in _HEAD_DIM_FIELDS if k in cfg})
            if "head_dim" not in cfg:
                heads = max(1, hidden_size // head_dim)
                cfg.update({k: heads for k in _HEADS_FIELDS if k in cfg})
                cfg.update({k: min(heads, v) for k, v in cfg.items() if k in _KV_HEADS_FIELDS})
        cfg["model_type"] = module
        cfg.update(_FAMILY_FIELDS.get(module, lambda n: {})(num_layers))
        return cfg

    text_class = text_args_class(module)
    if text_class is None:
        return fill(mlx_lm_args_class(module))
    return {"model_type": module, "text_config": fill(text_class), "vocab_size": vocab_size}
