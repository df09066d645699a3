"""The memory-budget planner (llm_mlx_streaming.engine.planner)."""

import json
import math
import re
import struct

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from exactness import greedy_tokens, prompt_tokens, vocab_size
from fixtures.architectures import tiny_config
from llm_mlx_streaming.cli.plan import format_plan
from llm_mlx_streaming.engine.planner import KV_STEP, Plan, PlanError, checkpoint_layout, default_reserve, kv_cache_bytes, plan_memory
from llm_mlx_streaming.errors import CheckpointError
from llm_mlx_streaming.sizes import format_size, parse_size

E, TOP_K, LAYERS = 8, 2, 4


@pytest.fixture(scope="module")
def ckpt(build):
    """4-bit qwen3_moe, 4 MoE layers x 8 experts, top-2, hidden 64, expert width 32."""
    return build("qwen3_moe", quant="4bit", num_layers=LAYERS, num_experts=E, top_k=TOP_K)


def header(path):
    """The raw safetensors header of the one-shard checkpoint."""
    with open(path / "model.safetensors", "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        h = json.loads(fh.read(n))
    h.pop("__metadata__", None)
    return {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in h.items()}


def per_expert_by_hand():
    # 4-bit affine, group size 32 (the expert width 32 is not a multiple of 64):
    # a (rows, cols) matrix is rows x cols/8 uint32 words + rows x cols/32 float32
    # scales + as many float32 biases.
    def q4(rows, cols):
        return rows * (cols // 8) * 4 + 2 * rows * (cols // 32) * 4

    return 2 * q4(32, 64) + q4(64, 32)  # gate_proj, up_proj (32 x 64), down_proj (64 x 32)


def budget_for(layout, kv, slots, reserve=0):
    return layout.dense_bytes + kv + reserve + sum(s * b for s, b in zip(slots, layout.expert_bytes))


# -- the checkpoint arithmetic ------------------------------------------------------


def test_dense_and_expert_bytes_match_the_header_by_hand(ckpt):
    sizes = header(ckpt)
    experts = {k: n for k, n in sizes.items() if ".switch_mlp." in k}
    dense = sum(n for k, n in sizes.items() if k not in experts)
    layout = checkpoint_layout(ckpt)
    assert layout.dense_bytes == dense
    assert layout.num_experts == E and layout.top_k == TOP_K
    assert layout.layer_keys == [f"model.layers.{i}.mlp.switch_mlp" for i in range(LAYERS)]
    assert layout.expert_bytes == [per_expert_by_hand()] * LAYERS == [4608] * LAYERS
    assert layout.checkpoint_bytes == sum(sizes.values())


def test_kv_cache_by_hand(ckpt):
    config = json.loads((ckpt / "config.json").read_text())
    # 4 layers x (K and V) x 2 kv heads x head_dim 16 x float32, max_context + 255 positions
    kv, text = kv_cache_bytes(config, 1000)
    assert kv == LAYERS * 2 * 2 * 16 * 4 * (1000 + KV_STEP - 1)
    assert text == "1000 tokens, 4 layers"
    assert kv_cache_bytes(config, 1000, bytes_per_element=2)[0] == kv // 2
    assert kv_cache_bytes(config, 0)[0] == 0


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3", "qwen3_next", "gpt_oss"])
def test_kv_estimate_bounds_mlx_lm_caches(build, arch):
    """The estimate is an upper bound of what mlx-lm allocates, and tight where the
    worst case happens: a prompt on a 256-token boundary followed by one token."""
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    path = build(arch)
    config = json.loads((path / "config.json").read_text())
    model, _ = load(str(path))

    def allocated(chunks):
        cache = make_prompt_cache(model)
        for n in chunks:
            mx.eval(model(mx.array([list(range(1, n + 1))]), cache=cache))
        total = 0
        for c in cache:
            arrays = [getattr(c, "keys", None), getattr(c, "values", None), *getattr(c, "cache", [])]
            total += sum(a.nbytes for a in arrays if a is not None)
        return total

    worst = allocated([256, 1])
    estimate = kv_cache_bytes(config, 257)[0]
    if arch == "gpt_oss":  # its sliding layer holds sliding_window - 1 + the last chunk
        assert worst <= estimate
        assert allocated([300]) <= kv_cache_bytes(config, 300)[0]
    else:
        assert worst == estimate
    assert allocated([100, 100]) <= kv_cache_bytes(config, 200)[0]


# -- the plan ------------------------------------------------------------------------


@pytest.mark.parametrize("slots", [[2] * 4, [3, 3, 2, 2], [4] * 4, [8, 5, 4, 4], [8, 8, 8, 7]])
def test_the_pool_fits_the_budget_and_is_spent(ckpt, slots):
    layout = checkpoint_layout(ckpt)
    kv = kv_cache_bytes(layout.config, 512)[0]
    for extra in (0, 1, 4607):
        budget = budget_for(layout, kv, slots, reserve=10_000) + extra
        plan = plan_memory(ckpt, budget, max_context=512, reserve_bytes=10_000)
        assert plan.slots_per_layer == slots  # less than one expert more buys nothing
        assert plan.dense_bytes == layout.dense_bytes and plan.kv_bytes == kv
        assert plan.reserve_bytes == 10_000
        assert plan.pool_bytes == sum(s * 4608 for s in slots)
        assert plan.expected_peak_bytes == layout.dense_bytes + kv + 10_000 + plan.pool_bytes
        assert plan.expected_peak_bytes <= budget
        assert plan.unused_bytes == extra < 4608
        assert plan.whole_layers == [i for i, s in enumerate(slots) if s == E]


def test_default_reserve():
    assert default_reserve(parse_size("1GB")) == 256 * 1024**2
    assert default_reserve(parse_size("16GB")) == int(0.05 * 16e9)
    assert default_reserve(parse_size("5.36870912GB")) == 256 * 1024**2  # the crossover


def test_a_bigger_budget_never_takes_a_slot_away(ckpt):
    layout = checkpoint_layout(ckpt)
    kv = kv_cache_bytes(layout.config, 256)[0]
    low = budget_for(layout, kv, [TOP_K] * LAYERS)
    high = budget_for(layout, kv, [E] * LAYERS) + 5000
    previous = None
    for whole_from, order in ((0.0, None), (0.5, None), (1.0, None), (0.5, [3, 1, 0, 2])):
        previous = None
        for budget in range(low, high, 997):  # steps smaller than one expert
            plan = plan_memory(ckpt, budget, max_context=256, reserve_bytes=0,
                               whole_from=whole_from, whole_order=order)
            assert all(s >= TOP_K for s in plan.slots_per_layer)
            assert plan.expected_peak_bytes <= budget
            if previous:
                assert all(a >= b for a, b in zip(plan.slots_per_layer, previous.slots_per_layer))
                assert set(previous.whole_layers) <= set(plan.whole_layers)
            previous = plan
        assert previous.whole_layers == list(range(LAYERS))
        assert previous.slots_per_layer == [E] * LAYERS


def test_default_reserve_plans_are_monotonic_too(ckpt):
    """Above 5.4 GB the default reserve grows with the budget (5%); the slots still
    never shrink. A 5M-token context makes this tiny model need that much."""
    context = 5_000_000
    layout = checkpoint_layout(ckpt)
    kv = kv_cache_bytes(layout.config, context)[0]
    start = math.ceil(budget_for(layout, kv, [TOP_K] * LAYERS) / 0.95)
    with pytest.raises(PlanError):
        plan_memory(ckpt, start - 100, max_context=context)
    previous = None
    for budget in range(start, start + 40 * 4608, 1500):
        plan = plan_memory(ckpt, budget, max_context=context)
        assert plan.reserve_bytes == int(0.05 * budget) > 256 * 1024**2
        assert plan.expected_peak_bytes <= budget
        if previous:
            assert all(a >= b for a, b in zip(plan.slots_per_layer, previous.slots_per_layer))
        previous = plan


def test_whole_layers_appear_exactly_when_the_budget_allows(ckpt):
    layout = checkpoint_layout(ckpt)
    kv = kv_cache_bytes(layout.config, 256)[0]

    def plan(slots, extra=0, **kw):
        return plan_memory(ckpt, budget_for(layout, kv, slots) + extra, max_context=256, reserve_bytes=0, **kw)

    # Every layer first grows to half its experts (whole_from=0.5: 4 of 8) ...
    assert plan([4, 4, 4, 4], extra=4 * 4608 - 1).whole_layers == []
    assert plan([4, 4, 4, 4], extra=4 * 4608 - 1).slots_per_layer == [7, 4, 4, 4]
    # ... then the first MoE layers are made whole, one at a time.
    assert plan([8, 4, 4, 4]).whole_layers == [0]
    assert plan([8, 8, 4, 4]).whole_layers == [0, 1]
    # The whole checkpoint (plus KV cache and reserve) makes every layer whole; a byte less does not.
    assert plan([E] * LAYERS).whole_layers == [0, 1, 2, 3]
    assert plan([E] * LAYERS, extra=-1).slots_per_layer == [8, 8, 8, 7]
    assert plan([E] * LAYERS, extra=-1).whole_layers == [0, 1, 2]
    # whole_from=1.0 spreads evenly to the end; 0.0 makes layers whole as early as possible.
    assert plan([7, 7, 7, 7], whole_from=1.0).whole_layers == []
    assert plan([8, 2, 2, 2], whole_from=0.0).whole_layers == [0]
    assert plan([8, 2, 2, 2], whole_from=0.5).slots_per_layer == [4, 4, 3, 3]
    # Another order: the layers a routing trace found worst first.
    assert plan([8, 4, 4, 4], whole_order=[2, 0, 3, 1]).slots_per_layer == [4, 4, 8, 4]
    assert plan([4, 4, 4, 4], extra=-4608, whole_order=[2, 0, 3, 1]).slots_per_layer == [4, 3, 4, 4]
    with pytest.raises(ValueError, match="whole_order"):
        plan([4, 4, 4, 4], whole_order=[0, 1, 2])
    # A budget larger than the whole checkpoint, with the default reserve.
    big = plan_memory(ckpt, "100GB")
    assert big.whole_layers == [0, 1, 2, 3] and big.slots_per_layer == [E] * LAYERS
    assert big.forecast_mb_per_token(0.5) == 0.0


def test_min_slots_for_speculative_decoding(ckpt):
    layout = checkpoint_layout(ckpt)
    kv = kv_cache_bytes(layout.config, 256)[0]
    budget = budget_for(layout, kv, [6] * LAYERS)
    assert plan_memory(ckpt, budget, max_context=256, reserve_bytes=0, min_slots=6).slots_per_layer == [6] * 4
    with pytest.raises(PlanError, match="7 slots x 4 layers"):
        plan_memory(ckpt, budget, max_context=256, reserve_bytes=0, min_slots=7)


def test_a_too_small_budget_is_refused_naming_the_shortfall(ckpt):
    layout = checkpoint_layout(ckpt)
    kv = kv_cache_bytes(layout.config, 256)[0]
    need = budget_for(layout, kv, [TOP_K] * LAYERS, reserve=1000)
    plan_memory(ckpt, need, max_context=256, reserve_bytes=1000)  # exactly enough
    with pytest.raises(PlanError) as err:
        plan_memory(ckpt, need - 5000, max_context=256, reserve_bytes=1000)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"budget {format_size(need - 5000)} is 5.0 KB short: ")
    assert f"dense weights {format_size(layout.dense_bytes)}" in message
    assert f"KV cache {format_size(kv)}" in message and "reserve 1.0 KB" in message
    assert f"2 slots x 4 layers {format_size(2 * 4 * 4608)}" in message
    least = re.search(r"it takes at least (\S+) KB", message).group(1)
    assert need <= float(least) * 1000 < need + 100


def test_the_suggested_budget_is_enough_with_the_default_reserve(ckpt):
    with pytest.raises(PlanError) as err:
        plan_memory(ckpt, "100MB")
    message = str(err.value)
    assert "reserve 268.4 MB" in message  # 256 MiB
    least = re.search(r"it takes at least (\S+ \S+)", message).group(1)
    plan = plan_memory(ckpt, least.replace(" ", ""))
    assert min(plan.slots_per_layer) >= TOP_K
    with pytest.raises(PlanError):
        plan_memory(ckpt, parse_size(least.replace(" ", "")) - 100_000)


def test_a_dense_model_plans_without_experts(build):
    path = build("qwen3")
    plan = plan_memory(path, "1GB")
    assert plan.num_moe_layers == 0 and plan.slots_per_layer == [] and plan.pool_bytes == 0
    assert "fully resident" in format_plan(plan)
    with pytest.raises(PlanError, match="short"):
        plan_memory(path, "1MB", reserve_bytes=0)


def test_gpt_oss_expert_containers(build):
    path = build("gpt_oss", quant="mxfp4")
    layout = checkpoint_layout(path)
    assert layout.layer_keys == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    sizes = header(path)
    assert layout.expert_bytes[0] * E == sum(
        n for k, n in sizes.items() if k.startswith("model.layers.0.mlp.experts.")
    )


@pytest.mark.parametrize("arch, image_tokens", [
    ("qwen3_vl_moe", 4),  # a 32x32 image at min = max pixels 32 x 32: 4 x 4 patches of 8, merged 2 x 2
    ("llama4", 1),  # its vision_model.model.layers outnumber the language model's
])
def test_a_vision_language_plan_names_its_vision_tower_and_an_images_tokens(tmp_path, monkeypatch, arch,
                                                                          image_tokens):
    from click.testing import CliRunner

    from fixtures.vision import build_vision_checkpoint
    from llm_mlx_streaming.cli import mlxs

    path = build_vision_checkpoint(tmp_path / arch, arch)
    sizes = header(path)
    tower = sum(n for k, n in sizes.items() if not k.startswith("language_model."))
    layout = checkpoint_layout(path)
    assert layout.vision_bytes == tower > 0 and layout.skipped_bytes == 0
    assert layout.checkpoint_bytes == sum(sizes.values())  # the tower is dense: counted once
    assert layout.image_tokens == image_tokens
    plan = plan_memory(path, "1GB", max_context=1000)
    assert plan.kv_bytes == kv_cache_bytes(layout.config, 1000 + image_tokens)[0]

    monkeypatch.setenv("LLM_USER_PATH", str(tmp_path / "llm"))
    run = ["plan", str(path), "--budget", "1GB", "--max-context", "1000"]
    data = json.loads(CliRunner().invoke(mlxs, [*run, "--json"]).output)
    assert data["vision_bytes"] == tower and data["image_tokens"] == image_tokens
    text = CliRunner().invoke(mlxs, run).output
    assert re.search(rf"vision tower +{re.escape(format_size(tower))}  ", text)
    assert f"1000 tokens + {image_tokens} image tokens" in text
    assert re.search(rf"image tokens +{image_tokens}  in the KV cache", text)


def test_a_text_only_plan_has_no_vision_lines(ckpt):
    plan = plan_memory(ckpt, "1GB", max_context=1000)
    assert (plan.vision_bytes, plan.image_tokens) == (0, 0)
    assert plan.kv_bytes == kv_cache_bytes(checkpoint_layout(ckpt).config, 1000)[0]
    assert plan.kv_description == "1000 tokens, 4 layers"
    assert "vision" not in format_plan(plan) and "image" not in format_plan(plan)


# -- checkpoints the planner must read correctly or refuse ----------------------------------


def write_fake(path, config, tensors):
    """A checkpoint of headers whose data are zeros: {name: (dtype, shape)}."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    sizes = {"F32": 4, "U32": 4, "BF16": 2}
    h, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        n = sizes[dtype] * math.prod(shape)
        h[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(h).encode()
    with open(path / "model.safetensors", "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw + bytes(offset))
    return path


# A config mlx-lm builds (the planner reads experts from mlx-lm's model of it).
FAKE_CONFIG = {
    **tiny_config("qwen3_next", hidden_size=32, num_experts=4, top_k=2, moe_intermediate_size=16),
    "full_attention_interval": 1, "torch_dtype": "bfloat16",
}


def test_mtp_heads_are_not_counted(tmp_path):
    tensors = {
        "model.embed_tokens.weight": ("BF16", (10, 32)),
        "model.layers.0.mlp.switch_mlp.up_proj.weight": ("BF16", (4, 16, 32)),
        "model.layers.0.mlp.gate.weight": ("BF16", (4, 32)),
        "model.layers.1.mlp.switch_mlp.up_proj.weight": ("BF16", (4, 16, 32)),
        "mtp.layers.0.mlp.switch_mlp.up_proj.weight": ("BF16", (4, 16, 32)),
        "model.layers.2.mlp.switch_mlp.up_proj.weight": ("BF16", (4, 16, 32)),  # deepseek-style MTP layer
    }
    layout = checkpoint_layout(write_fake(tmp_path / "c", FAKE_CONFIG, tensors))
    assert layout.layer_keys == ["model.layers.0.mlp.switch_mlp", "model.layers.1.mlp.switch_mlp"]
    assert layout.expert_bytes == [16 * 32 * 2] * 2
    assert layout.dense_bytes == (10 * 32 + 4 * 32) * 2
    assert layout.skipped_bytes == 2 * 4 * 16 * 32 * 2
    # bfloat16 activations: 2 bytes per cached element
    assert kv_cache_bytes(layout.config, 1)[0] == 2 * 2 * 2 * 8 * 2 * KV_STEP


def test_unstacked_experts_are_refused(tmp_path):
    tensors = {
        "model.layers.0.mlp.experts.0.up_proj.weight": ("BF16", (16, 32)),
        "model.layers.0.mlp.experts.1.up_proj.weight": ("BF16", (16, 32)),
    }
    with pytest.raises(CheckpointError, match="no stacked expert tensors"):
        checkpoint_layout(write_fake(tmp_path / "c", FAKE_CONFIG, tensors))
    with pytest.raises(CheckpointError, match="not found"):
        plan_memory(tmp_path / "missing", "1GB")


# -- sizes --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, n",
    [
        ("12GB", 12 * 10**9), ("12G", 12 * 10**9), ("12gb", 12 * 10**9), ("12 GB", 12 * 10**9),
        ("1.5GiB", 3 * 2**29), ("512MiB", 512 * 2**20), ("512mib", 512 * 2**20), ("2KiB", 2048),
        ("1TB", 10**12), ("1TiB", 2**40), ("100MB", 10**8), ("64KB", 64000), ("4096", 4096),
        ("4096B", 4096), (".5GB", 5 * 10**8), ("1M", 10**6), (7, 7),
    ],
)
def test_parse_size(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize("text", ["", "GB", "12 XB", "twelve", "-1GB", "1.2.3GB", "12 G B", "1e9", True])
def test_parse_size_refuses_with_one_line(text):
    with pytest.raises(ValueError) as err:
        parse_size(text)
    assert "\n" not in str(err.value) and "not a size" in str(err.value)


def test_format_size():
    assert format_size(0) == "0 B"
    assert format_size(999) == "999 B"
    assert format_size(4608) == "4.6 KB"
    assert format_size(2 * 10**9) == "2.0 GB"
    assert format_size(999_960_000) == "1.0 GB"
    assert format_size(41.5e9) == "41.5 GB"
    assert format_size(1.5e12) == "1.5 TB"
    assert format_size(-1300) == "-1.3 KB"
    assert parse_size(format_size(12 * 10**9).replace(" ", "")) == 12 * 10**9


# -- presenting ---------------------------------------------------------------------------


def test_forecast_and_format(ckpt):
    layout = checkpoint_layout(ckpt)
    kv = kv_cache_bytes(layout.config, 256)[0]
    plan = plan_memory(ckpt, budget_for(layout, kv, [8, 5, 4, 4]), max_context=256, reserve_bytes=0)
    assert plan.whole_layers == [0] and isinstance(plan, Plan)
    assert plan.forecast_mb_per_token(0.8) == pytest.approx(3 * TOP_K * 0.2 * 4608 / 1e6)
    with pytest.raises(ValueError):
        plan.forecast_mb_per_token(1.5)
    text = format_plan(plan)
    assert "layer 0: 8 (whole); layer 1: 5; layers 2-3: 4" in text
    assert "1 of 4 (0)" in text
    assert all(f"at hit rate {h}" in text for h in ("0.5", "0.8", "0.9"))
    assert format_plan(plan, hit_rate=0.75).count("at hit rate") == 1
    assert json.loads(json.dumps(plan.as_dict()))["slots_per_layer"] == [8, 5, 4, 4]


# -- the engine allocates what the plan says ---------------------------------------------------


def test_the_engine_allocates_the_planned_pool(ckpt):
    from llm_mlx_streaming.engine.loading import load_streaming
    from mlx_lm import load

    layout = checkpoint_layout(ckpt)
    kv = kv_cache_bytes(layout.config, 256)[0]
    plan = plan_memory(ckpt, budget_for(layout, kv, [8, 5, 4, 4]), max_context=256, reserve_bytes=0)
    assert plan.slots_per_layer == [8, 5, 4, 4]
    loaded = load_streaming(ckpt, expert_slots=plan.slots_per_layer, policy="lru")
    try:
        assert [p.slots for p in loaded.pools] == plan.slots_per_layer
        assert [p.whole for p in loaded.pools] == [True, False, False, False]
        assert sum(a.nbytes for p in loaded.pools for a in p.arrays.values()) == plan.pool_bytes
        # Everything the model holds is the dense weights plus the pools.
        held = sum(v.nbytes for _, v in tree_flatten(loaded.model.parameters()))
        assert held == plan.dense_bytes + plan.pool_bytes
        prompt = prompt_tokens(vocab_size(ckpt), n=12)
        tokens = greedy_tokens(loaded.model, prompt, n=6)
        reference, _ = load(str(ckpt))
        assert tokens == greedy_tokens(reference, prompt, n=6)
        assert sum(p.counters.unplaced for p in loaded.pools) == 0
        assert sum(p.counters.misses for p in loaded.pools[1:]) > 0
    finally:
        loaded.store.close()


@pytest.mark.parametrize("arch", ["phixtral", "longcat_flash"])  # num_layers, model_dim, num_heads
def test_shapes_are_read_from_the_model_mlx_lm_builds(build, arch):
    from llm_mlx_streaming.checkpoints.config import decoder_shape, read_config
    from llm_mlx_streaming.engine.planner import prefill_step_for

    path = build(arch, num_experts=8, top_k=2)
    layers, hidden, heads = decoder_shape(read_config(path))
    assert layers == 2 and hidden > 0 and heads > 1
    assert plan_memory(path, "1GB", max_context=1024).kv_bytes > 0
    assert prefill_step_for(path, "1GB").tokens(1024) >= 2048


def test_max_context_auto_is_the_models_own_as_long_as_its_kv_cache_takes_a_quarter_of_the_budget(build):
    from llm_mlx_streaming.engine.footprint import kv_cache_bytes
    from llm_mlx_streaming.engine.planner import auto_context, checkpoint_layout

    layout = checkpoint_layout(build("qwen3_moe", max_position_embeddings=32768))
    assert auto_context(layout, 2**40) == 32768  # the model's own
    kv_8k, _ = kv_cache_bytes(layout.config, 8192)
    shorter = auto_context(layout, 4 * kv_8k)  # room for 8192 tokens of KV cache in a quarter
    assert 8192 - 256 <= shorter <= 8192 and shorter % 256 == 0
    assert kv_cache_bytes(layout.config, shorter)[0] <= kv_8k
    assert auto_context(layout, 1) == 4096  # never below the default: too small a budget is the plan's to refuse
