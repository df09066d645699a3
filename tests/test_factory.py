"""Tests for the tiny random checkpoint factory (llm_mlx_streaming.checkpoints)."""

import contextlib
import io
import json
import re

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx_lm.models import switch_layers

from fixtures import tokenizer as tok_module
from fixtures.factory import (
    ARCHITECTURES,
    QUANTS,
    build_checkpoint,
    describe,
    supported_quants,
    tiny_config,
)

MOE_ARCHS = [a for a in ARCHITECTURES if a != "qwen3"]
ALL_BUILDS = [(a, q) for a in ARCHITECTURES for q in supported_quants(a)]
PROMPT = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Build each (arch, quant, shards, seed) once per module."""
    cache = {}

    def get(arch, quant=None, shards=1, seed=0):
        key = (arch, quant, shards, seed)
        if key not in cache:
            name = f"{arch}-{quant}-{shards}-{seed}"
            cache[key] = build_checkpoint(
                tmp_path_factory.mktemp(name), arch, quant=quant, shards=shards, seed=seed
            )
        return cache[key]

    return get


def load_weights(path):
    weights = {}
    for f in sorted(path.glob("model*.safetensors")):
        weights.update(mx.load(str(f)))
    return weights


def logits_for(path, text=PROMPT):
    model, tokenizer = mlx_lm.load(str(path))
    ids = tokenizer.encode(text)
    return model(mx.array([ids])), len(ids)


# -- every architecture and quantization ------------------------------------


@pytest.mark.parametrize("arch,quant", ALL_BUILDS)
def test_build_loads_and_runs(built, arch, quant):
    path = built(arch, quant)
    config = json.loads((path / "config.json").read_text())
    logits, n = logits_for(path)
    assert logits.shape == (1, n, config["vocab_size"])
    assert mx.all(mx.isfinite(logits)).item()
    # not degenerate: the positions do not all predict the same distribution
    assert float(mx.std(logits[0, -1])) > 0.1
    assert not mx.allclose(logits[0, 0], logits[0, -1]).item()

    assert config["model_type"] == arch
    assert config["torch_dtype"] == "float32"
    weights = load_weights(path)
    expert_keys = [k for k in weights if ".switch_mlp." in k or ".experts." in k]
    assert bool(expert_keys) == (arch != "qwen3")
    if quant is None:
        assert "quantization" not in config
        assert {v.dtype for v in weights.values()} == {mx.float32}
    else:
        q = config["quantization"]
        assert config["quantization_config"] == q
        bits, mode = {"4bit": (4, "affine"), "8bit": (8, "affine"), "mxfp4": (4, "mxfp4")}[quant]
        assert (q["bits"], q["mode"]) == (bits, mode)
        assert q["group_size"] in (32, 64)
        # the expert containers (and dense linears) are quantized, every one of them
        quantized = {k for k, v in weights.items() if k.endswith(".weight") and v.dtype == mx.uint32}
        for k in expert_keys:
            if k.endswith(".weight"):
                assert k in quantized and k[: -len("weight")] + "scales" in weights
        assert "lm_head.weight" in quantized
    assert describe(path) == {
        "arch": arch,
        "num_layers": 2,
        "num_experts": 0 if arch == "qwen3" else 8,
        "top_k": 0 if arch == "qwen3" else 2,
        "quant": quant,
    }


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_generation_runs_with_cache(built, arch):
    """Decoding uses each model's own caches (rotating, MLA, linear-attention)."""
    model, tokenizer = mlx_lm.load(str(built(arch)))
    prompt = tokenizer.encode(PROMPT)
    tokens = [
        r.token
        for r in mlx_lm.stream_generate(model, tokenizer, prompt=prompt, max_tokens=20)
    ]
    assert len(tokens) == 20  # special / padding tokens are never chosen, so no early stop
    assert len(set(tokens)) >= 3
    assert max(tokens) < tok_module.token_ids()["size"]
    text = tokenizer.decode(tokens)  # only whole, printable characters are emitted
    assert all(ch.isprintable() or ch == "\n" for ch in text), repr(text)


def test_qwen3_moe_generate_is_greedy_and_varied(built):
    model, tokenizer = mlx_lm.load(str(built("qwen3_moe")))
    prompt = tokenizer.encode(PROMPT)
    text = mlx_lm.generate(model, tokenizer, prompt=prompt, max_tokens=20, verbose=False)
    ids = [r.token for r in mlx_lm.stream_generate(model, tokenizer, prompt=prompt, max_tokens=20)]
    assert len(set(ids)) >= 3
    assert tokenizer.decode(ids) == text  # generate() is the same greedy decode


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_routing_spreads_over_experts(built, arch, monkeypatch):
    chosen = []
    original = switch_layers.SwitchGLU.__call__

    def record(self, x, indices):
        chosen.append(np.array(indices).reshape(-1))
        return original(self, x, indices)

    monkeypatch.setattr(switch_layers.SwitchGLU, "__call__", record)
    model, tokenizer = mlx_lm.load(str(built(arch)))
    mx.eval(model(mx.array([tokenizer.encode(tok_module.CORPUS[:500])])))
    moe_layers = 1 if arch in ("deepseek_v3", "glm4_moe") else 2  # layer 0 is dense there
    assert len(chosen) == moe_layers
    for layer in chosen:
        counts = np.bincount(layer, minlength=8)
        assert (counts > 0).all(), counts
        assert counts.max() < 0.5 * counts.sum(), counts


# -- architecture specifics --------------------------------------------------


def test_deepseek_v3_and_glm4_have_dense_first_layer_and_group_routing(built):
    for arch in ("deepseek_v3", "glm4_moe"):
        path = built(arch)
        config = json.loads((path / "config.json").read_text())
        assert config["first_k_dense_replace"] == 1
        assert config["n_group"] > 1 and 1 <= config["topk_group"] < config["n_group"]
        assert config["n_shared_experts"] >= 1
        w = load_weights(path)
        assert not any(k.startswith("model.layers.0.mlp.switch_mlp") for k in w)
        assert "model.layers.0.mlp.gate_proj.weight" in w
        assert "model.layers.1.mlp.switch_mlp.gate_proj.weight" in w
        assert "model.layers.1.mlp.shared_experts.down_proj.weight" in w
        bias = np.array(w["model.layers.1.mlp.gate.e_score_correction_bias"])
        assert bias.shape == (8,) and 0 < np.abs(bias).max() < 0.1


def test_gpt_oss_specifics(built):
    path = built("gpt_oss", "mxfp4")
    config = json.loads((path / "config.json").read_text())
    assert set(config["layer_types"]) == {"sliding_attention", "full_attention"}
    assert config["quantization"]["mode"] == "mxfp4"
    # the router keeps mlx-lm's 8-bit affine override
    assert config["quantization"]["model.layers.0.mlp.router"] == {"group_size": 64, "bits": 8}
    w = load_weights(path)
    for n in ("gate_proj", "up_proj", "down_proj"):
        bias = np.array(w[f"model.layers.0.mlp.experts.{n}.bias"])
        assert bias.shape[0] == 8 and np.abs(bias).max() > 0
    assert np.abs(np.array(w["model.layers.0.self_attn.sinks"])).max() > 0


def test_qwen_shared_experts_and_qwen3_next_hybrid(built):
    w = load_weights(built("qwen2_moe"))
    assert "model.layers.0.mlp.shared_expert_gate.weight" in w
    assert "model.layers.0.mlp.shared_expert.up_proj.weight" in w
    w = load_weights(built("qwen3_next"))
    assert "model.layers.0.linear_attn.in_proj_qkvz.weight" in w
    assert "model.layers.1.self_attn.q_proj.weight" in w
    assert "model.layers.0.mlp.shared_expert_gate.weight" in w
    # sanitize() must leave already-converted weights alone (it adds 1 to
    # norms of raw Hugging Face weights)
    norm = np.array(w["model.layers.0.input_layernorm.weight"])
    assert np.all(norm == 1.0)


def test_qwen3_next_layer_kinds_follow_layer_count(tmp_path):
    for layers in (2, 3, 4):
        config = tiny_config("qwen3_next", num_layers=layers)
        kinds = {(i + 1) % config["full_attention_interval"] == 0 for i in range(layers)}
        assert kinds == {True, False}


def test_same_as_mlx_lm_convert(built, tmp_path):
    """Quantizing in the factory writes exactly what mlx_lm.convert writes."""
    from mlx_lm.convert import convert

    for arch, quant in (("qwen3_moe", "4bit"), ("gpt_oss", "mxfp4"), ("deepseek_v3", "8bit")):
        ours = built(arch, quant)
        q = json.loads((ours / "config.json").read_text())["quantization"]
        out = tmp_path / f"{arch}-{quant}"
        with contextlib.redirect_stdout(io.StringIO()):
            convert(
                str(built(arch)), str(out), quantize=True,
                q_group_size=q["group_size"], q_bits=q["bits"], q_mode=q["mode"],
            )
        assert json.loads((out / "config.json").read_text()) == json.loads(
            (ours / "config.json").read_text()
        )
        theirs, mine = load_weights(out), load_weights(ours)
        assert theirs.keys() == mine.keys()
        for k in mine:
            assert mine[k].dtype == theirs[k].dtype and mx.array_equal(mine[k], theirs[k]).item(), k
        assert describe(out) == describe(ours)  # inferred from config.json alone


# -- determinism, reuse, sharding ---------------------------------------------


def test_builds_are_byte_identical_and_seeded(tmp_path):
    a = build_checkpoint(tmp_path / "a", "qwen3_moe", quant="4bit")
    b = build_checkpoint(tmp_path / "b", "qwen3_moe", quant="4bit")
    c = build_checkpoint(tmp_path / "c", "qwen3_moe", quant="4bit", seed=1)
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert (a / "config.json").read_bytes() == (c / "config.json").read_bytes()


def test_reuse_and_rebuild(tmp_path):
    path = build_checkpoint(tmp_path, "qwen3_moe", shards=3)
    stamp = {f.name: f.stat().st_mtime_ns for f in path.iterdir()}
    assert build_checkpoint(tmp_path, "qwen3_moe", shards=3) == path
    assert {f.name: f.stat().st_mtime_ns for f in path.iterdir()} == stamp

    # different arguments: rebuilt, and the old shards do not linger
    build_checkpoint(tmp_path, "qwen3_moe", shards=1, seed=2)
    assert sorted(f.name for f in path.glob("model*.safetensors")) == ["model.safetensors"]
    assert json.loads((path / "factory.json").read_text())["arguments"]["seed"] == 2

    # an incomplete checkpoint (a file missing) is rebuilt, not reused
    (path / "model.safetensors").unlink()
    build_checkpoint(tmp_path, "qwen3_moe", shards=1, seed=2)
    logits, _ = logits_for(path)
    assert mx.all(mx.isfinite(logits)).item()


@pytest.mark.parametrize("arch,quant", [("qwen3_moe", None), ("qwen3_moe", "4bit"), ("gpt_oss", "mxfp4")])
def test_sharded_matches_single_file(built, arch, quant):
    one, three = built(arch, quant, shards=1), built(arch, quant, shards=3)
    files = sorted(f.name for f in three.glob("model*.safetensors"))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((three / "model.safetensors.index.json").read_text())
    per_file = {f: set(mx.load(str(three / f))) for f in files}
    assert set(index["weight_map"].values()) == set(files)
    for f, keys in per_file.items():
        assert keys == {k for k, v in index["weight_map"].items() if v == f}
    sizes = [(three / f).stat().st_size for f in files]
    assert max(sizes) < 3 * min(sizes)  # roughly balanced
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in load_weights(three).values())
    assert load_weights(one).keys() == load_weights(three).keys()
    a, _ = logits_for(one)
    b, _ = logits_for(three)
    assert mx.array_equal(a, b).item()


def test_a_complete_build_is_reused_and_a_different_one_replaces_it(tmp_path):
    build_checkpoint(tmp_path, "qwen3_moe", quant="4bit")
    weights = tmp_path / "model.safetensors"
    first = (weights.stat().st_ino, weights.stat().st_mtime_ns)
    build_checkpoint(tmp_path, "qwen3_moe", quant="4bit")
    assert (weights.stat().st_ino, weights.stat().st_mtime_ns) == first  # not written again
    build_checkpoint(tmp_path, "qwen3_moe", quant="8bit")
    assert describe(tmp_path)["quant"] == "8bit"


def test_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError):
        build_checkpoint(tmp_path, "llama")
    with pytest.raises(ValueError):
        build_checkpoint(tmp_path, "qwen3_moe", quant="3bit")
    with pytest.raises(ValueError):
        build_checkpoint(tmp_path, "deepseek_v3", num_layers=1)
    with pytest.raises(ValueError):
        tiny_config("qwen3_moe", vocab_size=16)
    assert not (tmp_path / "factory.json").exists()


def test_does_not_overwrite_a_foreign_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"not ours")
    with pytest.raises(FileExistsError):
        build_checkpoint(tmp_path, "qwen3_moe")
    assert (tmp_path / "model.safetensors").read_bytes() == b"not ours"


def test_interrupted_build_is_redone(tmp_path, monkeypatch):
    from fixtures import factory

    def crash(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(factory, "save_config", crash)
    with pytest.raises(KeyboardInterrupt):
        build_checkpoint(tmp_path, "qwen3_moe")
    assert (tmp_path / "model.safetensors").exists() and not (tmp_path / "factory.json").exists()
    monkeypatch.undo()
    build_checkpoint(tmp_path, "qwen3_moe")
    assert describe(tmp_path)["arch"] == "qwen3_moe"
    assert not (tmp_path / "factory.partial").exists()


def test_a_quant_an_architecture_does_not_ship_in_is_refused(tmp_path):
    for arch in ARCHITECTURES:
        for quant in set(QUANTS) - set(supported_quants(arch)):
            with pytest.raises(ValueError, match=re.escape(str(supported_quants(arch)))):
                build_checkpoint(tmp_path / arch, arch, quant=quant)
    assert not list(tmp_path.rglob("*.safetensors"))


def test_tiny_config_field_names():
    assert tiny_config("mixtral", num_experts=4, top_k=1)["num_local_experts"] == 4
    assert tiny_config("gpt_oss", moe_intermediate_size=96)["intermediate_size"] == 96
    ds = tiny_config("deepseek_v3", num_experts=16, top_k=4)
    assert ds["n_routed_experts"] == 16 and ds["num_experts_per_tok"] == 4
    assert ds["topk_group"] * ds["n_routed_experts"] // ds["n_group"] >= 4
    assert tiny_config("qwen3_moe", rope_theta=5.0)["rope_theta"] == 5.0
    assert "num_experts" not in tiny_config("qwen3")


# -- tokenizer -----------------------------------------------------------------


def test_tokenizer_chat_template_and_round_trip(built):
    path = built("qwen3_moe")
    _, tokenizer = mlx_lm.load(str(path))
    ids = tok_module.token_ids()
    assert 400 <= ids["size"] <= 1000
    config = json.loads((path / "config.json").read_text())
    assert config["vocab_size"] >= ids["size"]
    assert json.loads((path / "tokenizer_config.json").read_text())["tokenizer_class"] == (
        "PreTrainedTokenizerFast"
    )

    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Tea?"},
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHi!<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
        "<|im_start|>user\nTea?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert not tokenizer.apply_chat_template(
        messages, add_generation_prompt=False, tokenize=False
    ).endswith("assistant\n")
    tokens = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert tokens[0] == ids["<|im_start|>"] and tokens.count(ids["<|im_end|>"]) == 4
    assert tokenizer.eos_token_id == ids["<|im_end|>"] == config["eos_token_id"]
    assert tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.has_thinking

    for sample in (PROMPT, "naïve café — 😀 costs $3.50\n\tindented  twice", "<think>hm</think>ok"):
        enc = tokenizer.encode(sample)
        assert tokenizer.decode(enc) == sample
        detok = tokenizer.detokenizer  # the streaming path mlx-lm uses
        detok.reset()
        for t in enc:
            detok.add_token(t)
        detok.finalize()
        assert detok.text == sample
    common = "The people of the town went out in the morning."
    assert len(tokenizer.encode(common)) < len(common) / 3  # merges were learned


def test_unprintable_ids_are_lone_bytes_and_controls(built):
    bad = set(tok_module.unprintable_ids())
    assert len(bad) == 128 + 32  # bytes >= 0x80, C0 controls but "\n", and DEL
    _, tokenizer = mlx_lm.load(str(built("qwen3_moe")))
    assert tokenizer.encode("\n")[0] not in bad
    assert tokenizer.encode("\t")[0] in bad
    assert not bad & set(tokenizer.encode("The people of the town."))


def test_tokenizer_is_deterministic():
    tok_module.tokenizer_json.cache_clear()
    first = tok_module.tokenizer_json()
    tok_module.tokenizer_json.cache_clear()
    assert tok_module.tokenizer_json() == first


# -- the realistic tokenizer (bpe32k) ----------------------------------------------


def test_bpe32k_checkpoint_with_the_tool_template(tmp_path):
    path = build_checkpoint(tmp_path / "bpe32k", "qwen3_moe", tool_template=True,
                            tokenizer_kind="bpe32k", max_position_embeddings=65536)
    model, tokenizer = mlx_lm.load(str(path))
    ids = tok_module.token_ids("bpe32k")
    assert ids["size"] == tok_module.BPE32K_VOCAB == 32000
    config = json.loads((path / "config.json").read_text())
    assert config["vocab_size"] == 32000 and config["max_position_embeddings"] == 65536
    assert config["eos_token_id"] == tokenizer.eos_token_id == ids["<|im_end|>"]
    assert json.loads((path / "tokenizer_config.json").read_text())["model_max_length"] == 65536
    marker = json.loads((path / "factory.json").read_text())
    assert marker["arguments"]["tokenizer_kind"] == "bpe32k"

    # Qwen3's added tokens are single tokens; mlx-lm finds the thinking and tool markers
    added = tok_module.THINK_TOKENS + tok_module.TOOL_TOKENS + tok_module.FIM_TOKENS
    for token in tok_module.SPECIAL_TOKENS + added:
        assert tokenizer.encode(token) == [ids[token]]
    assert tokenizer.has_thinking and tokenizer.has_tool_calling
    assert tokenizer.tool_call_start == "<tool_call>"
    for sample in (PROMPT, "naïve café — 😀 costs $3.50\n\tindented  twice",
                   'def f(x):\n    return {"a": [1, 2]}  # done\n', "<tool_call>\n{}\n</tool_call>"):
        assert tokenizer.decode(tokenizer.encode(sample)) == sample
    # a realistic vocabulary: prose and code take far fewer tokens than with "tiny"
    text = ("Use the Read tool to view files, and prefer editing existing files to creating "
            "new ones.\nimport json\nwith open(path) as f:\n    data = json.load(f)\n")
    tiny = mlx_lm.load(str(build_checkpoint(tmp_path / "tiny", "qwen3_moe")))[1]
    assert len(tokenizer.encode(text)) * 2 < len(tiny.encode(text))

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "system", "content": "Context: none."}]
    tools = [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}]
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n\n<tools>\n")
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>system\nContext: none.<|im_end|>\n"
                         "<|im_start|>assistant\n")

    # the random model never emits an added, padding or lone-byte token
    from fixtures.factory import _unused_token_ids  # noqa: PLC0415

    unused = set(_unused_token_ids(config, "bpe32k").tolist())
    assert set(ids.values()) - {ids["size"]} <= unused
    out = [r.token for r in mlx_lm.stream_generate(model, tokenizer, "Hello", max_tokens=24)]
    assert len(out) == 24 and not set(out) & unused


# -- another family's chat format ------------------------------------------------------

CHAT_FORMAT = {
    "tokens": [["<s>", True], ["</s>", True], ["<call>", False], ["</call>", False]],
    "tokenizer_config": {"bos_token": "<s>", "eos_token": "</s>",
                         "chat_template": "{{ bos_token }}{% for m in messages %}{{ m.content }}"
                                          "{% endfor %}"},
    "eos_tokens": ["</s>", "</call>"],
}


def test_a_chat_format_replaces_the_added_tokens_and_is_part_of_the_reuse_marker(tmp_path):
    path = build_checkpoint(tmp_path, "qwen3_moe", chat_format=CHAT_FORMAT)
    model, tokenizer = mlx_lm.load(str(path))
    first = tok_module.token_ids()["size"] - len(sum(tok_module.added_tokens(), ()))
    ids = {token: first + i for i, (token, _) in enumerate(CHAT_FORMAT["tokens"])}
    for token, i in ids.items():
        assert tokenizer.encode(token, add_special_tokens=False) == [i]
    assert tokenizer.encode("<|im_start|>", add_special_tokens=False) != [first]  # ChatML's gone
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "<s>hi"
    config = json.loads((path / "config.json").read_text())
    assert config["vocab_size"] % 64 == 0 and config["vocab_size"] >= first + 4
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (
        ids["<s>"], ids["</s>"], None)
    generation = json.loads((path / "generation_config.json").read_text())
    assert generation == {"bos_token_id": ids["<s>"], "eos_token_id": [ids["</s>"], ids["</call>"]]}
    assert tokenizer.eos_token_ids == {ids["</s>"], ids["</call>"]}
    # the random model never writes them
    assert not mx.any(model.lm_head.weight[first:first + 4]).item()

    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert build_checkpoint(tmp_path, "qwen3_moe", chat_format=CHAT_FORMAT) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    other = {**CHAT_FORMAT, "eos_tokens": ["</s>"]}
    build_checkpoint(tmp_path, "qwen3_moe", chat_format=other)
    assert json.loads((path / "factory.json").read_text())["arguments"]["chat_format"] == other
    build_checkpoint(tmp_path, "qwen3_moe")  # a plain build leaves no generation config
    assert not (path / "generation_config.json").exists()
    with pytest.raises(ValueError):
        build_checkpoint(tmp_path, "qwen3_moe", tool_template=True, chat_format=CHAT_FORMAT)
