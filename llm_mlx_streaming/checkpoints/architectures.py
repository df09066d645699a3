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

    `overrides` are applied last, so any field can be forced (e.g. `n_group`).
    """
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {arch!r}; choose from {ARCHITECTURES}")
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
