"""Train the bundled demo model: a small qwen3_moe language model on Python's docs.

Run once by a maintainer, not at install time; the result ships in
llm_mlx_streaming/checkpoints/demo/. Five steps, each deterministic (training from
--seed), `train` resuming from its last checkpoint (see docs/demo-model.md):

    python tools/train_demo.py corpus      # Python 3.11 HTML docs -> plain-text prose
    python tools/train_demo.py tokenizer   # byte-level BPE with the `tokenizers` library
    python tools/train_demo.py train       # PyTorch on the CPU (the `train` extra)
    python tools/train_demo.py export      # mlx-lm checkpoint, 4-bit, into the package
    python tools/train_demo.py trace       # its routing, recorded by the plugin, for tests

`train` needs torch (pip install '.[train]'); `export` needs mlx-lm and runs in
the plugin's own environment. The PyTorch model below computes exactly what
mlx-lm's qwen3_moe model computes, so the exported weights mean the same thing.
"""

from __future__ import annotations

import argparse
import html.parser
import json
import math
import os
import re
import shutil
import sys
import time
from pathlib import Path

import numpy as np

DOCS = Path("/usr/share/doc/python3.11/html")  # Debian package python3.11-doc
WORK = Path("build/demo")  # corpus, tokenizer, training checkpoints (not in git)
WORDS = Path(__file__).resolve().parents[1] / "tests" / "data" / "demo-corpus-words.txt"
PACKAGE_DIR = Path(__file__).resolve().parents[1] / "llm_mlx_streaming" / "checkpoints" / "demo"

# Pages that are lists of names or links, not prose.
SKIP_PAGES = ("genindex", "py-modindex", "search.html", "contents.html", "changelog.html")
ENDOFTEXT = "<|endoftext|>"
VOCAB_SIZE = 4096
VALID_EVERY = 50  # every 50th page is held out for validation

# Not instruction-tuned, so the "chat" template is completion-style: the messages'
# text, one after another, which the model continues. A reply follows the text it
# continued with no separator (that is how it was generated), and a later message
# starts a new paragraph: so a conversation renders as the last prompt plus the
# reply's own tokens, and the next turn prefills only what is new.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if not loop.first and message['role'] != 'assistant' %}{{- '\\n\\n' }}{%- endif %}"
    "{{- message['content'] }}"
    "{%- endfor %}"
)
TOKENIZER_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": None,
    "eos_token": ENDOFTEXT,
    "pad_token": ENDOFTEXT,
    "unk_token": None,
    "add_prefix_space": False,
    "clean_up_tokenization_spaces": False,
    "model_max_length": 2048,
    "chat_template": CHAT_TEMPLATE,
}

CONFIG = dict(
    model_type="qwen3_moe",
    hidden_size=256,
    num_hidden_layers=4,
    intermediate_size=512,  # unused: every layer is sparse
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=64,
    num_experts=16,
    num_experts_per_tok=2,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    moe_intermediate_size=256,
    norm_topk_prob=True,
    rms_norm_eps=1e-6,
    vocab_size=VOCAB_SIZE,
    rope_theta=10000.0,
    tie_word_embeddings=True,
    max_position_embeddings=2048,
)


# -- corpus ------------------------------------------------------------------


class _Prose(html.parser.HTMLParser):
    """Collects the text of paragraphs, list items, definitions and headings inside
    the page body, skipping code blocks, navigation and header links."""

    BLOCKS = {"p", "li", "dt", "dd", "h1", "h2", "h3", "h4", "th", "td"}
    SKIP = {"pre", "script", "style", "nav"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.in_body = 0
        self.skipping: list[str] = []
        self.parts: list[str] = []
        self.blocks: list[str] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "div" and attrs.get("role") == "main":
            self.in_body = 1
        elif tag == "div" and self.in_body:
            self.in_body += 1
        if tag in self.SKIP or (tag == "a" and "headerlink" in (attrs.get("class") or "")):
            self.skipping.append(tag)
        if tag in self.BLOCKS:
            self._flush()

    def handle_endtag(self, tag):
        if tag == "div" and self.in_body:
            self.in_body -= 1
        if self.skipping and tag == self.skipping[-1]:
            self.skipping.pop()
        if tag in self.BLOCKS:
            self._flush()

    def handle_data(self, data):
        if self.in_body and not self.skipping:
            self.parts.append(data)

    def _flush(self):
        text = " ".join("".join(self.parts).split())
        self.parts = []
        if text:
            self.blocks.append(text)


def page_prose(path: Path) -> str:
    parser = _Prose()
    parser.feed(path.read_text(encoding="utf-8", errors="replace"))
    parser._flush()
    # Keep blocks that read as prose: a few words, mostly letters.
    keep = []
    for block in parser.blocks:
        letters = sum(c.isalpha() or c.isspace() for c in block)
        if len(block.split()) >= 4 and letters >= 0.8 * len(block):
            keep.append(block)
    return "\n\n".join(keep)


def cmd_corpus(args):
    pages = sorted(p for p in DOCS.rglob("*.html") if not any(s in str(p) for s in SKIP_PAGES))
    train, valid = [], []
    for i, page in enumerate(pages):
        text = page_prose(page)
        if len(text) < 200:
            continue
        (valid if i % VALID_EVERY == 0 else train).append(text)
    WORK.mkdir(parents=True, exist_ok=True)
    for name, docs in (("train", train), ("valid", valid)):
        (WORK / f"{name}.txt").write_text(f"\n{ENDOFTEXT}\n".join(docs) + "\n", encoding="utf-8")
        print(f"{name}: {len(docs)} pages, {sum(map(len, docs)) / 1e6:.2f} M characters")
    # The training text's vocabulary, for tests/test_demo_model.py's "real words" check.
    words = sorted({w.lower() for doc in train for w in re.findall(r"[A-Za-z]+", doc)})
    WORDS.write_text("\n".join(words) + "\n", encoding="utf-8")
    print(f"{len(words)} distinct words -> {WORDS}")


# -- tokenizer ---------------------------------------------------------------


def cmd_tokenizer(args):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[AddedToken(ENDOFTEXT, special=True, normalized=False)],
    )
    text = (WORK / "train.txt").read_text(encoding="utf-8")
    docs = text.split(f"\n{ENDOFTEXT}\n")
    tok.train_from_iterator(docs, trainer=trainer)
    tok.save(str(WORK / "tokenizer.json"))
    for name in ("train", "valid"):
        docs = (WORK / f"{name}.txt").read_text(encoding="utf-8").split(f"\n{ENDOFTEXT}\n")
        eot = tok.token_to_id(ENDOFTEXT)
        ids = []
        for enc in tok.encode_batch(docs):
            ids.extend(enc.ids)
            ids.append(eot)
        np.asarray(ids, dtype=np.uint16).tofile(WORK / f"{name}.bin")
        print(f"{name}: {len(ids)} tokens, vocab {tok.get_vocab_size()}")


# -- model (PyTorch, the same computation as mlx_lm.models.qwen3_moe) ----------


def build_model(cfg):
    import torch
    from torch import nn
    import torch.nn.functional as F

    class RMSNorm(nn.Module):
        def __init__(self, dim, eps):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(dim))
            self.eps = eps

        def forward(self, x):
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    def rope(x, theta):
        # mlx nn.RoPE(traditional=False): rotate the two halves of each head.
        T, d = x.shape[-2], x.shape[-1]
        half = d // 2
        freqs = theta ** (-torch.arange(0, half, dtype=torch.float32) / half)
        angles = torch.arange(T, dtype=torch.float32)[:, None] * freqs[None]
        cos, sin = angles.cos(), angles.sin()
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            h, nh, nkv, hd = (cfg["hidden_size"], cfg["num_attention_heads"],
                              cfg["num_key_value_heads"], cfg["head_dim"])
            self.nh, self.nkv, self.hd = nh, nkv, hd
            self.q_proj = nn.Linear(h, nh * hd, bias=False)
            self.k_proj = nn.Linear(h, nkv * hd, bias=False)
            self.v_proj = nn.Linear(h, nkv * hd, bias=False)
            self.o_proj = nn.Linear(nh * hd, h, bias=False)
            self.q_norm = RMSNorm(hd, cfg["rms_norm_eps"])
            self.k_norm = RMSNorm(hd, cfg["rms_norm_eps"])

        def forward(self, x):
            B, T, _ = x.shape
            q = self.q_norm(self.q_proj(x).view(B, T, self.nh, self.hd)).transpose(1, 2)
            k = self.k_norm(self.k_proj(x).view(B, T, self.nkv, self.hd)).transpose(1, 2)
            v = self.v_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
            q, k = rope(q, cfg["rope_theta"]), rope(k, cfg["rope_theta"])
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                 enable_gqa=self.nkv != self.nh)
            return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))

    class Experts(nn.Module):
        """The experts' weights stacked as mlx-lm's SwitchGLU stores them."""

        def __init__(self):
            super().__init__()
            E, h, m = cfg["num_experts"], cfg["hidden_size"], cfg["moe_intermediate_size"]
            self.gate_proj = nn.Parameter(torch.randn(E, m, h) * h ** -0.5)
            self.up_proj = nn.Parameter(torch.randn(E, m, h) * h ** -0.5)
            self.down_proj = nn.Parameter(torch.randn(E, h, m) * m ** -0.5 / math.sqrt(2 * cfg["num_hidden_layers"]))

    class MoE(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(cfg["hidden_size"], cfg["num_experts"], bias=False)
            self.switch_mlp = Experts()

        def forward(self, x):
            shape = x.shape
            x = x.reshape(-1, shape[-1])
            probs = torch.softmax(self.gate(x).float(), dim=-1)
            k = cfg["num_experts_per_tok"]
            scores, inds = probs.topk(k, dim=-1)
            if cfg["norm_topk_prob"]:
                scores = scores / scores.sum(-1, keepdim=True)
            out = torch.zeros_like(x)
            w = self.switch_mlp
            for e in range(cfg["num_experts"]):
                tok, slot = torch.where(inds == e)
                if tok.numel() == 0:
                    continue
                xe = x[tok]
                y = (F.silu(xe @ w.gate_proj[e].T) * (xe @ w.up_proj[e].T)) @ w.down_proj[e].T
                out.index_add_(0, tok, y * scores[tok, slot, None])
            # Switch-Transformer load balancing: E * sum_e (share of picks) * (mean prob).
            E = cfg["num_experts"]
            picks = torch.zeros(E).index_add_(0, inds.reshape(-1), torch.ones(inds.numel()))
            balance = E * (picks / inds.numel() * probs.mean(0)).sum()
            return out.reshape(shape), balance, torch.bincount(inds.reshape(-1), minlength=E)

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn = Attention()
            self.mlp = MoE()
            self.input_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
            self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])

        def forward(self, x):
            h = x + self.self_attn(self.input_layernorm(x))
            r, balance, counts = self.mlp(self.post_attention_layernorm(h))
            return h + r, balance, counts

    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
            self.layers = nn.ModuleList(Layer() for _ in range(cfg["num_hidden_layers"]))
            self.norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = Inner()
            for name, p in self.named_parameters():
                if name.endswith("proj.weight") or name.endswith("gate.weight"):
                    nn.init.normal_(p, std=cfg["hidden_size"] ** -0.5)
                if name.endswith("o_proj.weight"):
                    p.data /= math.sqrt(2 * cfg["num_hidden_layers"])
            nn.init.normal_(self.model.embed_tokens.weight, std=0.02)

        def forward(self, ids):
            x = self.model.embed_tokens(ids)
            balance, counts = 0.0, []
            for layer in self.model.layers:
                x, b, c = layer(x)
                balance = balance + b
                counts.append(c)
            x = self.model.norm(x)
            logits = x @ self.model.embed_tokens.weight.T  # tied, as mlx-lm's as_linear
            return logits, balance / len(self.model.layers), torch.stack(counts)

    return Model()


# -- training ----------------------------------------------------------------


def cmd_train(args):
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    train = np.fromfile(WORK / "train.bin", dtype=np.uint16).astype(np.int64)
    valid = np.fromfile(WORK / "valid.bin", dtype=np.uint16).astype(np.int64)
    model = build_model(CONFIG)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    other = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": other, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    ckpt = WORK / "train-state.pt"
    step = 0
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step = state["step"]
        torch.set_rng_state(state["rng"])
        print(f"resumed at step {step}", flush=True)

    def lr_at(s):
        # Warmup, then constant, then a linear decay to 10% over the last `decay` share
        # of the steps: until the decay starts, a run's steps do not depend on --steps,
        # so a run can be resumed with a longer or shorter --steps.
        if s < args.warmup:
            return args.lr * (s + 1) / args.warmup
        decay_start = int(args.steps * (1 - args.decay))
        if s < decay_start:
            return args.lr
        frac = (s - decay_start) / max(1, args.steps - decay_start)
        return args.lr * (1 - 0.9 * min(1.0, frac))

    def batch(s):
        # The batch of step s depends only on (seed, s), so a resumed run sees the same data.
        rng = np.random.default_rng([args.seed, s])
        starts = rng.integers(0, len(train) - args.context - 1, size=args.batch)
        x = np.stack([train[i : i + args.context + 1] for i in starts])
        return torch.from_numpy(x[:, :-1]), torch.from_numpy(x[:, 1:])

    def save():
        tmp = ckpt.with_suffix(".tmp")
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                    "rng": torch.get_rng_state()}, tmp)
        os.replace(tmp, ckpt)
        export_float(model)

    t0, last_save = time.time(), time.time()
    model.train()
    while step < args.steps:
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        x, y = batch(step)
        logits, balance, counts = model(x)
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss = ce + args.balance * balance
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 20 == 0:
            use = counts.float() / counts.sum(-1, keepdim=True)
            print(f"step {step} ce {ce.item():.3f} balance {balance.item():.3f} "
                  f"max-share {use.max().item():.3f} lr {lr_at(step):.2e} "
                  f"{(time.time() - t0) / 60:.1f} min", flush=True)
        if time.time() - last_save > args.save_every or step == args.steps:
            save()
            last_save = time.time()
    # Run again after the last step to only print this (the perplexities `export` prints in MLX).
    windows = args.eval_windows
    print(f"validation perplexity (float32, PyTorch, {windows} windows): "
          f"{evaluate(model, valid, args.context, windows):.1f}", flush=True)


def evaluate(model, ids, context, max_windows):
    import torch
    import torch.nn.functional as F

    model.eval()
    n = min(max_windows, (len(ids) - 1) // context)
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, n, 16):
            rows = [ids[j * context : j * context + context + 1] for j in range(i, min(n, i + 16))]
            x = torch.from_numpy(np.stack(rows))
            logits, _, _ = model(x[:, :-1])
            total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                                     reduction="sum").item()
            count += x[:, 1:].numel()
    model.train()
    return math.exp(total / count)


def export_float(model):
    """Float32 weights under mlx-lm's names (experts already stacked as switch_mlp)."""
    from safetensors.torch import save_file

    weights = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    tmp = WORK / "float.safetensors.tmp"
    save_file(weights, str(tmp))
    os.replace(tmp, WORK / "float.safetensors")


# -- export (mlx-lm) -------------------------------------------------------------


def perplexity(model, ids, context: int) -> float:
    """Validation perplexity of an mlx-lm model over consecutive windows of `context`."""
    import mlx.core as mx
    import mlx.nn as nn

    total, count = 0.0, 0
    for start in range(0, len(ids) - context, context):
        window = mx.array(ids[start : start + context + 1])[None]
        logits = model(window[:, :-1]).astype(mx.float32)
        total += nn.losses.cross_entropy(logits, window[:, 1:], reduction="sum").item()
        count += context
    return math.exp(total / count)


def unigram_perplexity(train, valid) -> float:
    """The baseline: every token predicted by its training frequency (add-one smoothed)."""
    counts = np.bincount(train, minlength=VOCAB_SIZE) + 1.0
    logp = np.log(counts / counts.sum())
    return float(np.exp(-logp[valid].mean()))


def cmd_export(args):
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes, quantize_model, save_config, save_model

    model_class, args_class = _get_classes(CONFIG)
    model = model_class(args_class.from_dict(CONFIG))
    weights = mx.load(str(WORK / "float.safetensors"))
    # The PyTorch experts are bare stacked parameters; SwitchGLU keeps them in .weight.
    weights = {(k + ".weight" if re.search(r"switch_mlp\.\w+_proj$", k) else k): v
               for k, v in weights.items()}
    model.load_weights(list(weights.items()), strict=True)
    config = dict(CONFIG)
    valid = np.fromfile(WORK / "valid.bin", dtype=np.uint16).astype(np.int64)
    valid = valid[: args.eval_windows * args.context + 1]
    figures = {}
    if args.eval_windows:
        figures["float32"] = perplexity(model, valid, args.context)
    if args.bits:
        model, config = quantize_model(model, config, group_size=64, bits=args.bits)
        if args.eval_windows:
            figures[f"{args.bits}-bit"] = perplexity(model, valid, args.context)
    mx.eval(model.parameters())
    if args.eval_windows:
        train = np.fromfile(WORK / "train.bin", dtype=np.uint16).astype(np.int64)
        figures["unigram"] = unigram_perplexity(train, valid)
        print(f"validation perplexity ({len(valid) - 1} tokens): "
              + ", ".join(f"{k} {v:.1f}" for k, v in figures.items()))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.safetensors"):
        stale.unlink()
    save_model(out, model, donate_model=False)
    save_config(config, out / "config.json")
    shutil.copyfile(WORK / "tokenizer.json", out / "tokenizer.json")
    (out / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=2) + "\n")
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"wrote {out} ({size / 1e6:.1f} MB, {len(tree_flatten(model.parameters()))} tensors)")
    if out == PACKAGE_DIR:  # the hashes `llm mlxs verify` checks the copy against
        from llm_mlx_streaming.checkpoints.default import SHIPPED_HASHES
        from llm_mlx_streaming.checkpoints.integrity import hashes

        SHIPPED_HASHES.write_text(json.dumps(hashes(out), indent=1) + "\n")
        print(f"wrote {SHIPPED_HASHES}")


# -- routing trace (the plugin's own recorder) -------------------------------------

TRACE = Path(__file__).resolve().parents[1] / "llm_mlx_streaming" / "experts" / "recorded" / "demo.jsonl"
TRACE_PROMPTS = (
    "Once upon a time",
    "The Python standard library",
    "A list is",
    "To open a file",
    "An exception is raised when",
    "The following example shows how",
    "In this tutorial",
    "Regular expressions",
)


def cmd_trace(args):
    """Record the bundled default's routing the way a user would: `llm mlxs config
    trace on`, then prompts through `llm -m mlx-stream`, in a throw-away llm user dir."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as user_dir:
        env = dict(os.environ, LLM_USER_PATH=user_dir)

        def llm(*argv):
            subprocess.run([sys.executable, "-m", "llm", *argv], env=env, check=True,
                           stdout=subprocess.DEVNULL)

        llm("mlxs", "config", "trace", "on")
        for prompt in TRACE_PROMPTS:
            llm("-m", "mlx-stream", "-o", "max_tokens", str(args.trace_tokens), prompt)
        (recorded,) = Path(user_dir, "mlx-streaming", "traces").glob("*.jsonl")
        shutil.copyfile(recorded, TRACE)
    print(f"wrote {TRACE} ({len(TRACE_PROMPTS)} prompts x {args.trace_tokens} tokens)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("step", choices=["corpus", "tokenizer", "train", "export", "trace"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=1400)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--decay", type=float, default=0.3, help="share of the steps that decay the lr")
    ap.add_argument("--balance", type=float, default=0.01, help="load-balancing loss weight")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--save-every", type=float, default=120.0, help="seconds between checkpoints")
    ap.add_argument("--bits", type=int, default=4, help="export quantization (0: float)")
    ap.add_argument("--out", default=str(PACKAGE_DIR))
    ap.add_argument("--trace-tokens", type=int, default=128)
    ap.add_argument("--eval-windows", type=int, default=40,
                    help="validation windows (of --context tokens) for the perplexities (0: skip)")
    args = ap.parse_args()
    {"corpus": cmd_corpus, "tokenizer": cmd_tokenizer, "train": cmd_train,
     "export": cmd_export, "trace": cmd_trace}[args.step](args)


if __name__ == "__main__":
    main()
