"""MTP heads: the factory writes them under the real checkpoints' names, the engine loads
them (mlx-lm drops them), their experts stream through a pool, and the head computes
what the published formula says."""

import json
import shutil

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache
from mlx_lm.utils import load_model

from llm_mlx_streaming.engine.loading import load_streaming
from llm_mlx_streaming.experts.index import CheckpointIndex
from llm_mlx_streaming.speculation.mtp_head import ATTACHMENT, NoHeadError, mtp_head

HEADS = [("deepseek_v3", None), ("deepseek_v3", "4bit"), ("qwen3_next", None),
         ("qwen3_next", "8bit"), ("glm4_moe", "4bit")]
TOKENS = [[11, 42, 97, 230]]

# The names vLLM / sglang read (deepseek_mtp.py, qwen3_next_mtp.py), relative to the
# head's prefix; the decoder layer's own tensors come on top.
DEEPSEEK_NAMES = {"enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                  "shared_head.head.weight", "embed_tokens.weight"}
QWEN3_NEXT_NAMES = {"fc.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight",
                    "norm.weight"}


def _head_tensors(path, prefix):
    return {k[len(prefix):]: e for k, e in CheckpointIndex(path).tensors.items()
            if k.startswith(prefix)}


@pytest.mark.parametrize("arch,quant", HEADS)
def test_factory_writes_the_head_under_the_real_names(build, arch, quant):
    path = build(arch, quant=quant, mtp=True)
    config = json.loads((path / "config.json").read_text())
    if arch == "qwen3_next":
        assert config["mtp_num_hidden_layers"] == 1
        names, expected, layer = _head_tensors(path, "mtp."), QWEN3_NEXT_NAMES, "layers.0."
    else:
        assert config["num_nextn_predict_layers"] == 1
        prefix = f"model.layers.{config['num_hidden_layers']}."
        names, expected, layer = _head_tensors(path, prefix), DEEPSEEK_NAMES, ""
    assert expected <= set(names)
    for proj in ("gate_proj", "up_proj", "down_proj"):  # stacked routed experts
        entry = names[f"{layer}mlp.switch_mlp.{proj}.weight"]
        assert entry.shape[0] == config.get("n_routed_experts", config.get("num_experts"))
    assert f"{layer}self_attn.o_proj.weight" in names
    assert f"{layer}post_attention_layernorm.weight" in names
    fc = names["fc.weight" if arch == "qwen3_next" else "eh_proj.weight"]
    assert fc.shape[0] == config["hidden_size"]  # (H, 2H), packed when quantized
    if quant:
        assert (fc.dtype, names[f"{layer}mlp.switch_mlp.up_proj.weight"].dtype) == ("U32", "U32")


@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_next"])
def test_the_head_leaves_the_target_model_untouched(build, arch):
    """Same seed with and without a head: the target's tensors are bit-identical, and the
    engine loads the head-carrying checkpoint (stock mlx-lm refuses its extra tensors)."""
    plain, with_head = build(arch), build(arch, mtp=True)
    with pytest.raises(ValueError, match="parameters not in model"):
        load_model(with_head, lazy=True)
    stock, _ = load_model(plain)
    loaded = load_streaming(with_head, expert_slots=3)
    try:
        tokens = mx.array(TOKENS)
        assert mx.array_equal(stock(tokens), loaded.model(tokens)).item()
    finally:
        loaded.store.close()


def _rms(x, weight, eps):
    return x * mx.rsqrt(mx.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def _reference(path, arch, tokens, hidden):
    """The head's logits written from the formula, with a stock mlx-lm decoder layer
    holding every expert: proj(concat(norm_e(embed(x)), norm_h(h))) -> layer -> norm -> head."""
    import sys

    from mlx_lm.models.base import create_attention_mask
    from llm_mlx_streaming.checkpoints.classes import model_classes

    config = json.loads((path / "config.json").read_text())
    weights = {}
    for file in path.glob("model*.safetensors"):
        weights.update(mx.load(str(file)))
    eps = config["rms_norm_eps"]
    model_class, args_class = model_classes(config)
    args = args_class.from_dict(config)
    module = sys.modules[model_class.__module__]
    embedded = weights["model.embed_tokens.weight"][tokens]
    if arch == "qwen3_next":
        p = "mtp."
        e = _rms(embedded, weights[p + "pre_fc_norm_embedding.weight"], eps)
        h = _rms(hidden, weights[p + "pre_fc_norm_hidden.weight"], eps)
        x = mx.concatenate([e, h], axis=-1) @ weights[p + "fc.weight"].T
        layer = module.Qwen3NextDecoderLayer(args, layer_idx=args.full_attention_interval - 1)
        prefix = p + "layers.0."
    else:
        p = f"model.layers.{config['num_hidden_layers']}."
        e = _rms(embedded, weights[p + "enorm.weight"], eps)
        h = _rms(hidden, weights[p + "hnorm.weight"], eps)
        x = mx.concatenate([e, h], axis=-1) @ weights[p + "eh_proj.weight"].T
        layer_class = module.DecoderLayer if arch == "glm4_moe" else module.DeepseekV3DecoderLayer
        layer = layer_class(args, layer_idx=config["num_hidden_layers"])
        prefix = p
    own = {k for k, _ in tree_flatten(layer.parameters())}
    layer.load_weights([(k[len(prefix):], v) for k, v in weights.items()
                        if k.startswith(prefix) and k[len(prefix):] in own])
    mask = create_attention_mask(x, None, return_array=arch == "deepseek_v3")
    x = layer(x, mask, KVCache())
    if arch == "qwen3_next":
        return _rms(x, weights["mtp.norm.weight"], eps) @ weights["lm_head.weight"].T
    return _rms(x, weights[p + "shared_head.norm.weight"], eps) @ weights[p + "shared_head.head.weight"].T


@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_next", "glm4_moe"])
def test_head_computes_the_published_formula(build, arch):
    """With fewer slots than the pass needs (the expert-major path runs), the streamed head
    gives the reference's logits; the pool read what it says it read."""
    path = build(arch, mtp=True)
    loaded = load_streaming(path, expert_slots=2)
    try:
        tokens = mx.array(TOKENS)
        hidden = loaded.model.model(tokens)
        head = mtp_head(loaded)
        _, logits = head.head.step(loaded.model, tokens, hidden, KVCache())
        expected = _reference(path, arch, tokens, hidden)
        np.testing.assert_allclose(np.array(logits), np.array(expected), rtol=1e-5, atol=1e-5)
        pool = head.pool
        assert pool.slots == 2 and pool not in loaded.pools
        assert pool.counters.misses > 2  # more distinct experts than slots were streamed
        assert pool.counters.bytes_read == pool.counters.misses * pool.layout.expert_bytes
        assert pool.counters.unplaced == 0 and pool.bad_slots() == 0
    finally:
        loaded.store.close()


def test_the_head_pool_follows_the_models_pools(build):
    loaded = load_streaming(build("qwen3_next", mtp=True), expert_slots=3)
    try:
        head = mtp_head(loaded)
        assert head.pool.slots == 3 and mtp_head(loaded) is head
        assert len(loaded.layers) == 2
        loaded.build_pools([8, 2], "lru")  # a memory plan with a whole layer: not the head
        assert head.pool.slots == 2
        loaded.build_pools(None, "lru")
        assert head.pool.whole and head.pool.counters.misses == head.pool.num_experts
    finally:
        loaded.store.close()


@pytest.mark.parametrize("arch,kwargs,says", [
    ("deepseek_v3", {}, "declares none"),
    ("qwen3_moe", {}, "declares none"),
    ("deepseek_v3", {"num_nextn_predict_layers": 1}, "no model.layers.2.* tensors"),
])
def test_a_checkpoint_without_a_head_is_one_line(build, arch, kwargs, says):
    loaded = load_streaming(build(arch, **kwargs), expert_slots=2)
    try:
        with pytest.raises(NoHeadError, match=says) as raised:
            mtp_head(loaded)
        assert "\n" not in str(raised.value) and "MTP" in str(raised.value)
        assert ATTACHMENT not in loaded.attachments
    finally:
        loaded.store.close()


# -- the drafter ---------------------------------------------------------------------


def _drafter(loaded):
    from llm_mlx_streaming.speculation.drafter import DraftContext
    from llm_mlx_streaming.speculation.kinds import make_drafter

    return make_drafter("mtp", DraftContext(model=loaded.model, tokenizer=loaded.tokenizer,
                                            checkpoint=loaded.path, loaded=loaded))


@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_next"])
def test_drafter_drafts_the_heads_greedy_chain(build, arch):
    """First draft: the reference head's argmax after the accepted pairs. Each further
    draft: what the head gives when its previous output and draft are appended as one
    more pair in a single fresh pass (so the chain's cache handling is checked against
    a batched computation). Proposing again gives the same drafts: guesses leave the
    head's cache as it was."""
    path = build(arch, mtp=True)
    loaded = load_streaming(path, expert_slots=3)
    try:
        drafter = _drafter(loaded)
        assert (drafter.name, drafter.needs_hidden) == ("mtp", True)
        prompt = TOKENS[0]
        hidden = loaded.model.model(mx.array([prompt]))
        drafter.reset(prompt[:1])
        drafter.accept(prompt[1:], hidden[0, :-1])  # pairs (h_t, x_t+1)
        drafter.gate = 1.01  # no draft is that sure: the chain stops after the first
        assert len(drafter.propose(3)) == 1 and drafter.cache.offset == len(prompt) - 1
        drafter.gate = 0.0  # every draft chains
        drafts = drafter.propose(3)
        assert drafts == drafter.propose(3) and drafter.cache.offset == len(prompt) - 1
        expected = _reference(path, arch, mx.array([prompt[1:]]), hidden[:, :-1])
        assert drafts[0] == int(mx.argmax(expected[0, -1]).item())

        step = mtp_head(loaded).head.step
        tokens, states = list(prompt[1:]), hidden[:, :-1]
        for i in range(1, 3):
            out, _ = step(loaded.model, mx.array([tokens]), states, KVCache())
            tokens.append(drafts[i - 1])
            states = mx.concatenate([hidden[:, :-1], out[:, len(prompt) - 2:]], axis=1)
            _, logits = step(loaded.model, mx.array([tokens]), states, KVCache())
            assert drafts[i] == int(mx.argmax(logits[0, -1]).item())

        drafter.accept([drafts[0]], hidden[0, -1:])
        assert drafter.cache.offset == len(prompt)
        # the next chat turn: its prefill starts at the reply's last token, unfed so far
        drafter.reset(prompt + [drafts[0]])
        assert drafter.cache.offset == len(prompt) and drafter.propose(2) == []
        drafter.reset(prompt[:2])  # a prompt sharing two tokens: one pair still holds
        assert drafter.cache.offset == 1
        drafter.reset([7, 8])  # another conversation: a new cache
        assert drafter.cache.offset == 0
    finally:
        loaded.store.close()


def test_draft_mtp_without_a_head_is_one_line(build):
    from llm_mlx_streaming.speculation.drafter import DraftContext, DraftError
    from llm_mlx_streaming.speculation.kinds import make_drafter

    loaded = load_streaming(build("deepseek_v3"), expert_slots=2)
    try:
        with pytest.raises(DraftError, match=r"no multi-token-prediction \(MTP\) head") as raised:
            _drafter(loaded)
        assert "\n" not in str(raised.value)
        with pytest.raises(DraftError, match="streamed model"):
            make_drafter("mtp", DraftContext(model=loaded.model, tokenizer=None))
    finally:
        loaded.store.close()


def test_the_engine_counts_and_rewires_the_head_pool(build):
    """The head's reads are in the engine's counters; a new reader (threads, page cache)
    and new pool sizes reach the head's pool too, so it never reads through a closed store."""
    from llm_mlx_streaming.engine.manager import EngineManager

    manager = EngineManager()
    manager.load(build("deepseek_v3", mtp=True), expert_slots=2)
    try:
        loaded = manager.loaded
        head = mtp_head(loaded)
        tokens = mx.array(TOKENS)
        hidden = loaded.model.model(tokens)
        before = manager.counters().misses
        mx.eval(head.head.step(loaded.model, tokens, hidden, KVCache()))
        assert manager.counters().misses - before == head.pool.counters.misses > 0
        manager.configure(expert_slots=2, page_cache="bypass")
        assert head.pool.store is manager.loaded.store
        mx.eval(head.head.step(loaded.model, tokens, hidden, KVCache()))
        manager.configure(expert_slots=3)
        assert head.pool.slots == 3 and head.pool.store is manager.loaded.store
        mx.eval(head.head.step(loaded.model, tokens, hidden, KVCache()))
        assert manager.bad_slots() == 0
    finally:
        manager.unload()


def test_a_damaged_head_is_one_line(build, tmp_path):
    """A head tensor of the wrong shape is refused at load, naming it; the drafter says
    so in one line instead of failing inside a generation."""
    from llm_mlx_streaming.speculation.drafter import DraftError

    path = tmp_path / "damaged"
    shutil.copytree(build("deepseek_v3", mtp=True), path)
    weights = mx.load(str(path / "model.safetensors"))
    weights["model.layers.2.hnorm.weight"] = mx.ones((32,))
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    loaded = load_streaming(path, expert_slots=2)
    try:
        with pytest.raises(DraftError, match=r"model\.layers\.2\.hnorm\.weight.*\[32\]") as raised:
            _drafter(loaded)
        assert "\n" not in str(raised.value) and ATTACHMENT not in loaded.attachments
    finally:
        loaded.store.close()


# -- through the engine and the plugin -----------------------------------------------


def _run(engine, prompt, **request):
    from llm_mlx_streaming.engine.request import Request

    generation = engine.run(None, Request(prompt=list(prompt), max_tokens=16, **request))
    return [r.token for r in generation], generation.stats


@pytest.mark.parametrize("arch,quant", [("deepseek_v3", "4bit"), ("qwen3_next", None)])
def test_engine_greedy_with_draft_mtp_equals_plain_decoding(build, arch, quant):
    """k > 0 with the head drafting emits what k = 0 emits, at a pool smaller than a verify
    pass needs and at full size; the next turn (the session's cache reused, the head's
    kept) too. The head's pool streams and stays intact."""
    from llm_mlx_streaming.engine.manager import EngineManager

    path = build(arch, quant=quant, mtp=True)
    prompt = [11, 42, 97, 230, 55, 66, 11, 42]
    for slots in (3, None):
        engine = EngineManager()
        engine.load(path, expert_slots=slots)
        try:
            first, stats = _run(engine, prompt, k=3, draft="mtp")  # a fresh session
            (drafter,) = engine.running.carried.drafters.values()
            # the head saw every position: the prompt as it was prefilled, then the passes
            assert drafter.start == 0 and drafter.cache.offset == len(drafter.seen) - 1
            plain, _ = _run(engine, prompt, k=0)
            assert first == plain and stats["draft"] == "mtp" and stats["draft_tokens"] > 0
            drafter.gate = 0.0  # a random head is never confident: make it chain k drafts
            for k in (3, "auto"):
                tokens, stats = _run(engine, prompt, k=k, draft="mtp")
                assert tokens == plain, (slots, k)
                assert stats["draft_tokens"] > 0 and stats["unplaced"] == 0
                if k == 3:  # several drafts per pass (fewer only near max_tokens)
                    assert stats["draft_tokens"] > 2 * stats["verify_passes"]
                # a prefix the session reused: the head's pairs start where it saw it
                assert drafter.cache.offset == len(drafter.seen) - 1 - drafter.start
            follow = prompt + plain + [97, 230]
            assert _run(engine, follow, k=3, draft="mtp")[0] == _run(engine, follow, k=0)[0]
            head = engine.loaded.attachments[ATTACHMENT].pool
            assert head.counters.hits + head.counters.misses > 0
            assert engine.bad_slots() == 0
        finally:
            engine.unload()


def _cli_env(tmp_path, monkeypatch, checkpoint):
    from plugin_support import LlmEnv

    monkeypatch.setenv("LLM_USER_PATH", str(tmp_path / "llm"))
    env = LlmEnv(tmp_path / "llm", checkpoint)
    env.write_settings(default_model="m", models={"m": {"path": str(checkpoint), "expert_slots": 3}})
    return env


def test_cli_draft_mtp_prints_what_k0_prints(build, tmp_path, monkeypatch):
    from plugin_support import assert_ok

    checkpoint = build("qwen3_next", mtp=True)
    env = _cli_env(tmp_path, monkeypatch, checkpoint)
    added = assert_ok(env.run("mlxs", "add", str(checkpoint), "--name", "withhead"))
    assert "an MTP head for -o draft mtp" in added.stdout
    common = ["-m", "mlx-stream/m", "-o", "temperature", "0", "-o", "max_tokens", "12"]
    plain = assert_ok(env.run(*common, "-o", "k", "0", "tell me"))
    drafted = assert_ok(env.run(*common, "-o", "k", "3", "-o", "draft", "mtp", "tell me"))
    assert drafted.stdout == plain.stdout and plain.stdout.strip()
    stats = env.turns()[-1]["stats"]
    assert stats["draft"] == "mtp" and stats["draft_tokens"] > 0


def test_cli_draft_mtp_without_a_head_is_one_line(llm_env):
    from plugin_support import assert_ok, assert_one_line_error

    added = assert_ok(llm_env.run("mlxs", "add", str(llm_env.checkpoint), "--name", "nohead"))
    assert "MTP" not in added.stdout
    result = llm_env.run("-m", "mlx-stream", "-o", "k", "2", "-o", "draft", "mtp", "hi")
    assert_one_line_error(result, "no multi-token-prediction (MTP) head")
    assert llm_env.turns() == []


def test_a_checkpoint_with_a_head_packs_and_serves_as_a_draft_model(build, tmp_path):
    """`llm mlxs pack` and a draft model load it like the engine does (stock mlx-lm would
    refuse the head's tensors); the head then reads from the safetensors next to a packed
    store that holds the layers."""
    from llm_mlx_streaming.checkpoints.packing import pack_checkpoint
    from llm_mlx_streaming.speculation.draft_model import build_draft_model
    from llm_mlx_streaming.speculation.drafter import DraftContext

    path = tmp_path / "packed"
    shutil.copytree(build("deepseek_v3", mtp=True), path)
    pack_checkpoint(path)
    loaded = load_streaming(path, expert_slots=2)
    try:
        assert loaded.store.packed is not None
        head = mtp_head(loaded)
        tokens = mx.array(TOKENS)
        mx.eval(head.head.step(loaded.model, tokens, loaded.model.model(tokens), KVCache()))
        assert head.pool.counters.misses > 0 and head.pool.bad_slots() == 0
        context = DraftContext(model=loaded.model, tokenizer=loaded.tokenizer, loaded=loaded)
        assert build_draft_model(context, "self", path).name
    finally:
        loaded.store.close()


# -- importing a real checkpoint's head --------------------------------------------


def _hf_source(mlx_with_head, arch, out):
    """The head of a factory checkpoint (float) written back in the Hugging Face layout
    the original checkpoints use: experts one by one, DeepSeek's kv_b_proj unsplit,
    Qwen3-Next's norms zero-centred. Only the head's shard, as a download would hold."""
    config = json.loads((mlx_with_head / "config.json").read_text())
    prefix = "mtp." if arch == "qwen3_next" else f"model.layers.{config['num_hidden_layers']}."
    weights = {}
    for k, v in mx.load(str(mlx_with_head / "model.safetensors")).items():
        if not k.startswith(prefix):
            continue
        if ".switch_mlp." in k:
            head, leaf = k.split(".switch_mlp.")
            weights.update({f"{head}.experts.{e}.{leaf}": v[e] for e in range(v.shape[0])})
        elif arch == "qwen3_next" and "norm" in k.split(".")[-2]:
            weights[k] = v - 1.0
        elif k.endswith("self_attn.embed_q.weight"):
            continue  # joined with unembed_out into kv_b_proj below
        else:
            weights[k] = v
    if arch == "deepseek_v3":
        base = prefix + "self_attn."
        loaded = mx.load(str(mlx_with_head / "model.safetensors"))
        embed_q, unembed = loaded[base + "embed_q.weight"], loaded[base + "unembed_out.weight"]
        del weights[base + "unembed_out.weight"]
        kv_b = mx.concatenate([embed_q.swapaxes(-1, -2), unembed], axis=1)
        weights[base + "kv_b_proj.weight"] = kv_b.reshape(-1, kv_b.shape[-1])
    out.mkdir()
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    (out / "config.json").write_text(json.dumps(config))
    return out


def _head_of(path):
    from llm_mlx_streaming.checkpoints.mtp import is_head_tensor

    config = json.loads((path / "config.json").read_text())
    out = {}
    for file in path.glob("model*.safetensors"):
        out.update({k: v for k, v in mx.load(str(file)).items()
                    if is_head_tensor(k, config) and ".embed_tokens." not in k})
    return out


@pytest.mark.parametrize("arch,quant", [("qwen3_next", None), ("qwen3_next", "8bit"),
                                        ("deepseek_v3", "4bit")])
def test_importing_a_hugging_face_head_gives_what_a_kept_head_is(build, tmp_path, arch, quant):
    """A model converted without its head, plus the head of the original (Hugging Face
    layout) checkpoint, gives exactly the tensors of the model converted with its head;
    the new folder serves `-o draft mtp`, the model's own folder is untouched."""
    from llm_mlx_streaming.checkpoints.mtp import has_head
    from llm_mlx_streaming.checkpoints.mtp_import import import_head

    source = _hf_source(build(arch, mtp=True), arch, tmp_path / "hf")
    model = build(arch, quant=quant)
    before = sorted(p.name for p in model.iterdir())
    out = import_head(model, source, tmp_path / "with-head")
    assert sorted(p.name for p in model.iterdir()) == before and not has_head(model, json.loads((model / "config.json").read_text()))
    got, want = _head_of(out), _head_of(build(arch, quant=quant, mtp=True))
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and mx.array_equal(got[k], want[k]).item(), k
    loaded = load_streaming(out, expert_slots=3)
    try:
        assert _drafter(loaded).name == "mtp"
    finally:
        loaded.store.close()


def test_importing_a_head_refuses_what_does_not_fit(build, tmp_path):
    from llm_mlx_streaming.checkpoints.mtp_import import import_head
    from llm_mlx_streaming.errors import CheckpointError

    model = build("qwen3_next")
    with pytest.raises(CheckpointError, match="declares no MTP head"):
        import_head(model, build("qwen3_next"), tmp_path / "a")
    with pytest.raises(CheckpointError, match="not the model .* was converted from"):
        import_head(model, build("deepseek_v3", mtp=True), tmp_path / "b")
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "x").write_text("")
    with pytest.raises(CheckpointError, match="is not empty"):
        import_head(model, _hf_source(build("qwen3_next", mtp=True), "qwen3_next", tmp_path / "hf"),
                    tmp_path / "c")


def test_cli_import_mtp_then_add_then_draft(build, tmp_path, monkeypatch):
    from plugin_support import assert_ok, assert_one_line_error

    model = build("qwen3_next")
    env = _cli_env(tmp_path, monkeypatch, model)
    source = _hf_source(build("qwen3_next", mtp=True), "qwen3_next", tmp_path / "hf")
    out = tmp_path / "with-head"
    wrote = assert_ok(env.run("mlxs", "import-mtp", "m", str(source), str(out)))
    assert str(out) in wrote.stdout and f"llm mlxs add {out}" in wrote.stderr
    added = assert_ok(env.run("mlxs", "add", str(out), "--name", "mh"))
    assert "an MTP head" in added.stdout
    common = ["-m", "mlx-stream/mh", "-o", "temperature", "0", "-o", "max_tokens", "8"]
    plain = assert_ok(env.run(*common, "-o", "k", "0", "hi"))
    assert assert_ok(env.run(*common, "-o", "k", "2", "-o", "draft", "mtp", "hi")).stdout == plain.stdout
    assert_one_line_error(env.run("mlxs", "import-mtp", "m", str(model), str(tmp_path / "x")),
                          "declares no MTP head")
    assert_one_line_error(env.run("mlxs", "import-mtp", "m", "no/such-dir-or-repo!", str(tmp_path / "y")),
                          "No such folder")


def test_importing_an_fp8_head_dequantizes_it_as_mlx_lm_does(build, tmp_path):
    """DeepSeek-V3 ships its head in fp8 with 128x128 block scales (`weight_scale_inv`):
    the import dequantizes it through mlx-lm's own sanitize."""
    from llm_mlx_streaming.checkpoints.mtp_import import import_head

    source = _hf_source(build("deepseek_v3", mtp=True), "deepseek_v3", tmp_path / "hf")
    weights = mx.load(str(source / "model.safetensors"))
    key = "model.layers.2.eh_proj.weight"
    weights[key] = mx.to_fp8(weights[key])
    rows, cols = weights[key].shape
    weights[key.replace("weight", "weight_scale_inv")] = mx.full(
        (-(-rows // 128), -(-cols // 128)), 2.0)
    mx.save_safetensors(str(source / "model.safetensors"), weights)
    out = import_head(build("deepseek_v3"), source, tmp_path / "with-head")
    got = _head_of(out)[key]
    want = (mx.from_fp8(weights[key], dtype=mx.bfloat16) * 2).astype(mx.float32)
    assert got.dtype == mx.float32 and mx.array_equal(got, want).item()
    assert key.replace("weight", "weight_scale_inv") not in _head_of(out)
