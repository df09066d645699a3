"""The contract across architectures: every supported mlx-lm MoE module x pool sizes x
features, run through the engine as `llm` runs it, printed as a table with the wall time.

    python conformance/contract_cross.py [ARCH ...]

Each checkpoint is tiny, random and float32 (8 experts, top-2), with head dim 32 so that
a 4-bit KV cache in groups of 32 applies. Every cell runs at pool sizes all, top-k and 2
slots through `get_manager().run(LoadSpec, Request)`:

- plain: greedy tokens and logprobs equal stock mlx-lm's `generate_step`;
- overlap on: the same with every decode call overlapping its reads with compute and
  reading ahead the next layer's predicted experts (experts/prefetch.py);
- k 3: speculation with the ngram drafter and with drafters whose drafts are all right
  (oracle) and all wrong (adversary): greedy tokens equal stock mlx-lm's greedy tokens;
- kv_bits 4: tokens and logprobs equal stock mlx-lm's quantized cache (kv_bits 4, groups
  of 32, from token 0); where stock mlx-lm cannot quantize a sliding window it is run with
  the engine's caches (the windows kept full precision, the rest quantized by mlx-lm);
- long cold prompt: an 80-token prompt fed in one model call (the expert chunk), every
  mixer in tiles of 16 and a snapshot at token 32, equal to stock mlx-lm's prefill in
  16-token chunks at every pool size, and four such prompts joining a batch equal to stock
  mlx-lm's BatchGenerator given the same prefilled caches; the passes over the experts at
  2 slots are listed, and the models whose mixers cannot all be tiled (fed in mlx-lm's
  chunks, still checked) with the reason;
- conversation cache: turn 2 of a conversation, loaded from the cache on disk with nothing
  in memory, gives the tokens of the same turn computed cold (no cache), and the tokens and
  logprobs of stock mlx-lm's turn 2 on the cache it kept from turn 1;
- batch: four requests joined at set passes of the engine's continuous batch (two
  prefilled together, two joining mid-decode) give each sequence stock mlx-lm's
  BatchGenerator tokens for the same joins;
- agent pattern: an agent's system prompt, then its next turn (A2), a new session after an
  unrelated side request (B1) and a new session after a restart (the conversation cache on
  disk): each gives the tokens of the same prompt computed cold and stock mlx-lm's greedy
  tokens, reusing at least 95% of the prefix it shares with the earlier prompts (from a
  conversation in memory, a snapshot or the disk; the reuse is listed under the table);
- llm CLI: `llm -m mlx-stream/ARCH "..."` run twice (the second run reuses the conversation
  cache) prints stock mlx-lm's greedy text for the same chat-templated prompt.

ok, FAIL or n/a; the reasons are listed under the table. An architecture whose stock greedy
output is nearly constant (fewer than 3 distinct tokens for every prompt tried) is named.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx.utils import tree_flatten
from mlx_lm.utils import load_config, load_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fixtures.factory import ARCHITECTURES, build_checkpoint  # noqa: E402
from llm_mlx_streaming.checkpoints.support import UNSUPPORTED, moe_modules  # noqa: E402
from llm_mlx_streaming.checkpoints.vision import UNSUPPORTED_VISION, vision_moe_modules  # noqa: E402
from llm_mlx_streaming.engine.disk_cache import DiskCacheSpec  # noqa: E402
from llm_mlx_streaming.engine.kv import KVSpec, blocker, make_cache  # noqa: E402
from llm_mlx_streaming.engine.manager import get_manager  # noqa: E402
from llm_mlx_streaming.engine.planner import ATTENTION_TILE  # noqa: E402
from llm_mlx_streaming.engine.prefill import tile_mixers, tiling_of  # noqa: E402
from llm_mlx_streaming.engine.request import Injected, LoadSpec, Request  # noqa: E402
from llm_mlx_streaming.engine.snapshots import SYSTEM, Boundary, SnapshotSpec  # noqa: E402
from fixtures.scripted import ScriptedDrafter  # noqa: E402
from fixtures.batches import engine_batch, stock_batch  # noqa: E402
from llm_mlx_streaming.engine.batch import alone_reason  # noqa: E402
from llm_mlx_streaming.engine.manager import EngineManager  # noqa: E402

EXPERTS, TOP_K, HEAD_DIM, N = 8, 2, 32, 10
POOLS = {"all": None, "top-k": TOP_K, "2": 2}
KV = KVSpec(4, 32, 0)
FEATURES = ("plain", "overlap on", "k 3", "kv_bits 4", "long cold prompt", "conversation cache", "agent pattern",
            "batch", "llm CLI")
PROMPT = "Tell me about tea"


def shape(arch: str) -> dict:
    """Head dim 32: hand-picked families derive it from the hidden size, others are told."""
    return {"hidden_size": 128} if arch in ARCHITECTURES else {"head_dim": HEAD_DIM}


def tokens(vocab: int, n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, vocab, n)]


def stock(model, prompt, step=2048, cache=None, **kwargs):
    out = list(generate_step(mx.array(prompt), model, max_tokens=N, prefill_step_size=step,
                             prompt_cache=cache, **kwargs))
    return [t for t, _ in out], [np.array(l) for _, l in out]


def engine(path, slots, request, tile=None, overlap="auto"):
    """(tokens, logprobs, stats) of one request with nothing in memory, as `llm` runs it."""
    manager = get_manager()
    spec = LoadSpec(Path(path), expert_slots=slots, overlap=overlap)
    list(manager.queue_load(spec))
    manager.prompts.reset()
    tiled = tile_mixers(manager.loaded.model, tile).wrapped if tile else None
    try:
        generation = manager.run(spec, request)
        out = list(generation)
    finally:
        if tile:
            tile_mixers(manager.loaded.model, ATTENTION_TILE)
    stats = dict(generation.stats, tiled_layers=tiled, tiling=tiling_of(manager.loaded.model))
    return [r.token for r in out], [np.array(r.logprobs) for r in out], stats


def same(a, b) -> bool:
    return a[0] == b[0] and len(a[1]) == len(b[1]) and all(np.array_equal(x, y) for x, y in zip(a[1], b[1]))


class Cell:
    def __init__(self):
        self.state, self.notes = "ok", []

    def fail(self, why):
        self.state = "FAIL"
        self.notes.append(why)

    def na(self, why):
        if self.state == "ok":
            self.state = "n/a"
        self.notes.append(why)


def plain(path, model, prompt, cell, overlap="auto") -> int:
    """Checks each pool size; returns the experts read ahead in all."""
    expected = stock(model, prompt)
    ahead = 0
    for name, slots in POOLS.items():
        got = engine(path, slots, Request(prompt=prompt, max_tokens=N), overlap=overlap)
        if not same(got, expected):
            cell.fail(f"pool {name}: {got[0]} != stock {expected[0]}")
        ahead += got[2].get("prefetch_loads") or 0
    return ahead


def overlapped(path, model, prompt, cell):
    if not plain(path, model, prompt, cell, overlap="on"):
        cell.notes.append("no expert was read ahead at any pool size")


def speculation(path, model, prompt, cell):
    # The start, stock's first replies to it, the start again: the ngram drafter finds the
    # repeat, and the prompt (10 tokens) leaves room in a 16-token sliding window. The
    # scripted drafters verify on every architecture: the oracle's drafts are all right,
    # the adversary's all wrong.
    prompt = prompt[:4] + stock(model, prompt[:4])[0][:2] + prompt[:4]
    expected = stock(model, prompt)[0]
    vocab = load_config(path)["vocab_size"]
    drafters = {"ngram": lambda: None, "oracle": lambda: ScriptedDrafter(prompt + expected, vocab),
                "adversary": lambda: ScriptedDrafter(prompt + expected, vocab, wrong=True)}
    drafted, off = {}, None
    for kind, make in drafters.items():
        for name, slots in POOLS.items():
            request = Request(prompt=prompt, max_tokens=N, k=3, draft="ngram", injected=Injected(drafter=make()))
            got, _, stats = engine(path, slots, request)
            if got != expected:
                cell.fail(f"{kind} drafts, pool {name}: {got} != stock greedy {expected}")
            drafted[kind] = max(drafted.get(kind, 0), stats.get("draft_tokens") or 0)
            off = stats.get("speculation_off") or off
    if not any(drafted.values()):
        cell.na(f"speculation off: {off} (output checked: stock greedy)" if off
                else "no drafter's drafts were verified")
    else:
        if not drafted["ngram"]:
            cell.notes.append("the ngram drafter proposed no drafts (verified: oracle and adversary)")
        if off:
            cell.notes.append(f"drafted {max(drafted.values())}+ tokens, then: {off}")


def kv_bits(path, model, prompt, cell):
    prompt = prompt + prompt[:16]  # 40 tokens
    reason = blocker(load_config(path), (n for n, _ in tree_flatten(model.parameters())))
    if reason:  # the engine keeps such a cache full precision, with a note (engine/kv.py)
        expected = stock(model, prompt)
        for name, slots in POOLS.items():
            got = engine(path, slots, Request(prompt=prompt, max_tokens=N, kv=KV))
            if reason not in (got[2].get("kv_note") or ""):
                cell.fail(f"pool {name}: kv_note {got[2].get('kv_note')!r} does not say {reason!r}")
            elif not same(got, expected):
                cell.fail(f"pool {name}: full precision {got[0]} != stock {expected[0]}")
        return cell.na(f"kv_bits not applied: {reason} (full precision checked against stock)")
    kwargs = KV.generate_kwargs()
    try:
        expected = stock(model, prompt, **kwargs)
    except Exception as e:  # RotatingKVCache.to_quantized: not implemented
        try:
            expected = stock(model, prompt, cache=make_cache(model, KV), **kwargs)
        except Exception:
            return cell.na(f"stock mlx-lm cannot run kv_bits 4: {type(e).__name__}: {e}")
        cell.notes.append(f"stock mlx-lm alone raises {type(e).__name__}; compared with its "
                          "sliding windows kept full precision, as the engine keeps them")
    for name, slots in POOLS.items():
        got = engine(path, slots, Request(prompt=prompt, max_tokens=N, kv=KV))
        note = got[2].get("kv_note") or ""
        if "not applied" in note:
            return cell.na(note)
        if got[2].get("kv_bits") is None:
            return cell.na("no layer's cache is quantized")
        if not same(got, expected):
            cell.fail(f"pool {name}: {got[0]} != stock {expected[0]}")


def long_cold(path, model, prompt, cell):
    """An 80-token prompt (five tiles of 16) fed in one expert chunk, a snapshot boundary
    inside it, alone at every pool size and joining a batch: stock mlx-lm's prefill in
    16-token chunks, and one pass over the experts."""
    prompt = (prompt * 4)[:80]
    expected = stock(model, prompt, step=16)
    limit = None
    for i, (name, slots) in enumerate(POOLS.items()):
        spec = SnapshotSpec(every=0, max_count=8 + i, max_bytes=10**9)  # a store of its own: a cold prompt
        request = Request(prompt=prompt, max_tokens=N, prefill_step=128, snapshots=spec,
                          boundaries=(Boundary(32, SYSTEM),))
        got = engine(path, slots, request, tile=16)
        stats = got[2]
        limit = stats["tiling"].limit
        if not same(got, expected):
            cell.fail(f"pool {name}: {got[0]} != stock {expected[0]}")
        elif stats.get("untiled_calls"):
            cell.fail(f"pool {name}: {stats['untiled_calls']} mixer calls were not tiled")
        elif limit is None and stats["prefill_calls"] != 1:
            cell.fail(f"pool {name}: {stats['prefill_calls']} model calls, not one")
        elif name == "2" and limit is None:
            cell.notes.append(f"{stats['expert_passes']} passes over the experts at 2 slots (the prompt's "
                              "last token and one decode step included)")
    if limit is not None:
        cell.notes.append(f"in mlx-lm's chunks (checked exact): {limit}")
    if alone_reason(Request(prompt=[1], max_batch=4), model) is None:
        from mlx_lm.utils import load_tokenizer

        vocab = load_config(path)["vocab_size"]
        prompts = [prompt[:4] + tokens(vocab, n, seed) for seed, n in enumerate((70, 40, 3, 55))]
        want = stock_batch(model, load_tokenizer(path), prompts, chunk=16)
        manager = EngineManager()
        manager.load(path, expert_slots=2)
        tile_mixers(manager.loaded.model, 16)
        try:
            if (got := engine_batch(manager, prompts)) != want:
                cell.fail(f"batched: {got} != stock BatchGenerator {want}")
        finally:
            manager.unload()


def conversation(path, model, prompt, cell, root):
    extra = prompt[::-2][:10]  # the next message
    cache = make_prompt_cache(model)  # stock mlx-lm's own second turn, on its kept cache
    reply = stock(model, prompt, cache=cache)[0]
    follow = prompt + reply + extra
    expected = stock(model, extra, cache=cache)
    for name, slots in POOLS.items():
        disk = DiskCacheSpec(Path(root) / f"kv-{name}", 10**9)
        first = engine(path, slots, Request(prompt=prompt, max_tokens=N, conversation_cache=disk))
        if first[2].get("disk_cache_error"):  # refused, said once, the reply exact
            return cell.na(f"not saved: {first[2]['disk_cache_error']}")
        warm = engine(path, slots, Request(prompt=follow, max_tokens=N, conversation_cache=disk))
        cold = engine(path, slots, Request(prompt=follow, max_tokens=N))
        if warm[2].get("disk_cache_tokens") != len(prompt) + N:
            cell.fail(f"pool {name}: turn 2 took {warm[2].get('disk_cache_tokens')} tokens from disk, "
                      f"not {len(prompt) + N}")
        elif warm[0] != cold[0]:
            cell.fail(f"pool {name}: from disk {warm[0]} != cold {cold[0]}")
        elif not same(warm, expected):
            cell.fail(f"pool {name}: from disk {warm[0]} != stock mlx-lm's cached turn {expected[0]}")
        elif not same(warm, cold):
            gap = max(float(np.abs(a - b).max()) for a, b in zip(warm[1], cold[1]))
            cell.notes.append(f"tokens equal the cold turn's; logprobs differ by up to {gap:.1e}, as "
                              "stock mlx-lm's cached turn differs from its cold one (a split prefill)")


def agent(path, model, prompt, cell, root):
    """A2, B1 after a side request, and a new session after a restart, at each pool size."""
    vocab = load_config(path)["vocab_size"]
    system = prompt[:16]
    spec = SnapshotSpec(every=0, max_count=8, max_bytes=10**9)

    def ask(manager, tokens, disk=None):
        request = Request(prompt=tokens, max_tokens=N, conversation_cache=disk, snapshots=spec,
                          boundaries=(Boundary(len(system), SYSTEM),))
        generation = manager.run(None, request)
        out = list(generation)
        return [r.token for r in out], [np.array(r.logprobs) for r in out], generation.stats

    reuse = []
    for name, slots in POOLS.items():
        disk = DiskCacheSpec(Path(root) / f"agent-{name}", 10**9)
        warm, restarted = EngineManager(), EngineManager()
        warm.load(path, expert_slots=slots)
        restarted.load(path, expert_slots=slots)
        try:
            first = system + tokens(vocab, 12, 21)
            reply, _, stats = ask(warm, first, disk)
            unsaved = stats.get("disk_cache_error")
            turns = {"A2": (first + reply + tokens(vocab, 6, 22), len(first) + len(reply)),
                     "B1": (system + tokens(vocab, 12, 23), len(system))}
            got = {}
            for turn, (tokens_, shared) in turns.items():
                if turn == "B1":
                    ask(warm, tokens(vocab, 20, 24), disk)  # an unrelated side request
                got[turn] = (ask(warm, tokens_, disk), tokens_, shared)
            later = system + tokens(vocab, 12, 25)
            if unsaved:  # refused, said once: a new process prefills it whole, exactly
                cell.na(f"restart: not saved: {unsaved}")
            else:
                got["restart"] = (ask(restarted, later, disk), later, len(system))
            for turn, (result, tokens_, shared) in got.items():
                stats = result[2]
                cold = EngineManager()
                cold.load(path, expert_slots=slots)
                expected = ask(cold, tokens_)
                cold.unload()
                if result[0] != expected[0] or result[0] != stock(model, tokens_)[0]:
                    cell.fail(f"pool {name}, {turn}: {result[0]} != cold {expected[0]}")
                elif stats["reused_tokens"] < 0.95 * shared:
                    cell.fail(f"pool {name}, {turn}: reused {stats['reused_tokens']} of {shared} shared "
                              f"({stats.get('reuse_note')})")
                reuse.append(f"{turn} {stats['reused_tokens']}/{shared} {stats.get('reused_from')}")
        finally:
            warm.unload()
            restarted.unload()
    cell.notes.append("pool all/top-k/2: " + ", ".join(reuse[:3]) + " (the same at every pool)"
                      if reuse[:3] == reuse[3:6] == reuse[6:] else ", ".join(reuse))


def batched(path, model, prompt, cell):
    from mlx_lm.utils import load_tokenizer

    reason = alone_reason(Request(prompt=[1], max_batch=4), model)
    if reason:  # the engine runs its requests one at a time, as plain checks
        return cell.na(f"runs alone: {reason}")
    vocab = load_config(path)["vocab_size"]
    prompts = [prompt[:4] + tokens(vocab, n, seed) for seed, n in enumerate((5, 10, 1, 7))]
    expected = stock_batch(model, load_tokenizer(path), prompts)
    for name, slots in POOLS.items():
        manager = EngineManager()  # its own engine, driven from this thread as the tests drive it
        manager.load(path, expert_slots=slots)
        try:
            got = engine_batch(manager, prompts)
            if got != expected:
                cell.fail(f"pool {name}: {got} != stock BatchGenerator {expected}")
            elif manager.counters().unplaced or manager.bad_slots():
                cell.fail(f"pool {name}: unplaced {manager.counters().unplaced}, bad slots {manager.bad_slots()}")
        finally:
            manager.unload()


def through_llm(path, arch, cell, root):
    """`llm -m mlx-stream/ARCH PROMPT` twice per pool size, in an llm user dir of its own:
    both runs (the second reuses the conversation cache on disk) print stock mlx-lm's
    greedy text for the chat-templated prompt."""
    from click.testing import CliRunner
    from llm.cli import cli
    from mlx_lm import generate, load

    from llm_mlx_streaming.prompt.split import ReplySplitter

    model, tokenizer = load(str(path))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    splitter = ReplySplitter(tokenizer)
    text = generate(model, tokenizer, prompt, max_tokens=N)
    expected = "".join(c for k, c in splitter.feed(text) + splitter.flush() if k == "text") + "\n"
    user_dir = Path(root) / f"{arch}-llm"
    user_dir.mkdir()
    os.environ["LLM_USER_PATH"] = str(user_dir)
    for name, slots in POOLS.items():
        entry = {"path": str(path)} | ({"expert_slots": slots} if slots else {})
        (user_dir / "mlx-streaming.json").write_text(json.dumps({"models": {arch: entry}}))
        for run in ("first", "second"):
            result = CliRunner().invoke(cli, ["-m", f"mlx-stream/{arch}", PROMPT, "-o", "max_tokens", str(N)])
            if result.exit_code:
                return cell.fail(f"pool {name}, {run} run: exit {result.exit_code}: "
                                 f"{(result.output or repr(result.exception)).strip().splitlines()[-1]}")
            if result.stdout != expected:
                cell.fail(f"pool {name}, {run} run: {result.stdout!r} != stock {expected!r}")


def choose_prompt(model, vocab):
    """The first prompt (of a few seeds) whose stock greedy output is not nearly constant."""
    for seed in range(10):
        prompt = tokens(vocab, 24, seed)
        if len(set(stock(model, prompt)[0])) >= 3:
            return prompt, None
    return tokens(vocab, 24, 0), "stock greedy output has < 3 distinct tokens for every prompt tried"


def row(arch, root):
    path = build_checkpoint(Path(root) / arch, arch, num_experts=EXPERTS, top_k=TOP_K, **shape(arch))
    model, config = load_model(path)
    prompt, degenerate = choose_prompt(model, config["vocab_size"])
    cells = {}
    runs = {"plain": plain, "overlap on": overlapped, "k 3": speculation, "kv_bits 4": kv_bits, "long cold prompt": long_cold,
            "batch": batched}
    for feature in FEATURES:
        cell = cells[feature] = Cell()
        try:
            if feature == "conversation cache":
                conversation(path, model, prompt, cell, Path(root) / f"{arch}-disk")
            elif feature == "agent pattern":
                agent(path, model, prompt, cell, Path(root) / f"{arch}-agent")
            elif feature == "llm CLI":
                through_llm(path, arch, cell, root)
            else:
                runs[feature](path, model, prompt, cell)
        except Exception as e:  # a failure of the engine, shown in the table
            cell.fail(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    return cells, degenerate


def vision_row(arch, root) -> str:
    """A MoE VLM family: greedy tokens for a prompt with one PNG, stock mlx-vlm against
    the engine at pools all/top-k/2: "ok", "FAIL: ..." or "unsupported"."""
    import io as _io

    import llm
    from llm.parts import AttachmentPart, Message, TextPart
    from mlx_vlm import load as vlm_load
    from mlx_vlm.generate import stream_generate as vlm_stream
    from mlx_vlm.prompt_utils import apply_chat_template
    from PIL import Image

    from fixtures.vision import TOP_K as VISION_TOP_K, build_vision_checkpoint
    from llm_mlx_streaming.prompt.vision import render_with_images

    if arch in UNSUPPORTED_VISION:
        return "unsupported"
    path = build_vision_checkpoint(Path(root) / f"vision-{arch}", arch)
    png = _io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(png, "PNG")
    png = png.getvalue()
    model, processor = vlm_load(str(path))
    text = apply_chat_template(processor, model.config, PROMPT, num_images=1)
    expected = [r.token for r in vlm_stream(model, processor, text, image=[Image.open(_io.BytesIO(png))],
                                            max_tokens=12, temperature=0.0)][:12]
    engine = EngineManager()
    message = Message(role="user", parts=[AttachmentPart(attachment=llm.Attachment(content=png)),
                                          TextPart(text=PROMPT)])
    try:
        for name, slots in {"all": None, "top-k": VISION_TOP_K, "2": 2}.items():
            load = LoadSpec(path, expert_slots=slots)
            tokenizer = engine.tokenizer_for(load).wait_started().started.tokenizer
            ids, _, vision = render_with_images(tokenizer, [message])
            if engine.prompts is not None:
                engine.prompts.reset()
            generation = engine.run(load, Request(prompt=ids, max_tokens=12, vision=vision))
            list(generation)
            if generation.tokens != expected:
                return f"FAIL: pool {name} differs from stock mlx-vlm"
    finally:
        engine.unload()
    return "ok"


def vision_section(root) -> int:
    """The vision column: every MoE VLM module of the installed mlx-vlm; the failures."""
    print("\n| vision-language module | vision |\n|---|---|")
    fails = 0
    for arch in vision_moe_modules():
        try:
            state = vision_row(arch, root)
        except Exception as e:  # a failure of the engine, shown in the table
            state = f"FAIL: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        fails += state.startswith("FAIL")
        print(f"| {arch} | {state} |", flush=True)
    return fails


def main(archs) -> int:
    start = time.perf_counter()
    rows, degenerate = {}, {}
    with tempfile.TemporaryDirectory() as root:
        for arch in archs:
            rows[arch], why = row(arch, root)
            if why:
                degenerate[arch] = why
            print(arch, " ".join(c.state for c in rows[arch].values()), file=sys.stderr, flush=True)
    get_manager().unload()
    head = ["architecture", *FEATURES]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for arch, cells in rows.items():
        print("| " + " | ".join([arch] + [cells[f].state for f in FEATURES]) + " |")
    notes = [f"- {arch}, {f}: {note}" for arch, cells in rows.items() for f in FEATURES
             for note in dict.fromkeys(cells[f].notes)]
    notes += [f"- {arch}: {why}" for arch, why in degenerate.items()]
    if notes:
        print("\n" + "\n".join(notes))
    fails = sum(c.state == "FAIL" for cells in rows.values() for c in cells.values())
    with tempfile.TemporaryDirectory() as root:
        vision_fails = vision_section(root)
    print(f"\n{len(rows)} architectures x pools all/top-k/2 x {len(FEATURES)} features, "
          f"{fails} failed; MoE vision-language modules: {vision_fails} failed: "
          f"{time.perf_counter() - start:.0f} s")
    fails += vision_fails
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or [m for m in moe_modules() if m not in UNSUPPORTED]))
