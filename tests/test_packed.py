"""The packed store: layout, exactness through it, and every kind of damage refused."""

import json
import os
import shutil
import zlib

import numpy as np
import pytest
from mlx_lm.utils import load_model

from exactness import greedy_tokens, logits_trace, prompt_tokens
from llm_mlx_streaming.checkpoints import packing
from llm_mlx_streaming.checkpoints.packing import layer_maps, pack_checkpoint, verify_packed
from llm_mlx_streaming.engine.loading import load_streaming
from llm_mlx_streaming.experts.packed import ALIGN, FORMAT_VERSION, INDEX_NAME, PACKED_DIR

EXPERTS, TOP_K = 16, 4
CASES = [("qwen3_moe", "4bit"), ("gpt_oss", "mxfp4"), ("mixtral", None)]


def packed_copy(build, tmp_path, arch="qwen3_moe", quant="4bit", **kwargs):
    """A private copy of a session checkpoint (packing writes into it), packed."""
    src = build(arch, quant=quant, num_experts=EXPERTS, top_k=TOP_K, **kwargs)
    path = tmp_path / "ckpt"
    shutil.copytree(src, path)
    pack_checkpoint(path)
    return path


def reference(path, n=24):
    stock, config = load_model(path)
    prompt = prompt_tokens(config["vocab_size"])
    tokens = greedy_tokens(stock, prompt, n)
    return prompt, tokens, logits_trace(stock, prompt, tokens)[1]


def assert_exact(loaded, prompt, tokens, ref_decode):
    got = greedy_tokens(loaded.model, prompt, len(tokens))
    assert got == tokens
    decode = logits_trace(loaded.model, prompt, got)[1]
    assert all(np.array_equal(a, b) for a, b in zip(decode, ref_decode))
    assert sum(pool.bad_slots() for pool in loaded.pools) == 0  # against the safetensors
    assert sum(pool.counters.unplaced for pool in loaded.pools) == 0


@pytest.mark.parametrize("page_cache", ["keep", "bypass"])
@pytest.mark.parametrize("arch,quant", CASES)
def test_decode_through_the_packed_store_is_bit_identical(build, tmp_path, arch, quant, page_cache):
    path = packed_copy(build, tmp_path, arch, quant)
    assert verify_packed(path) == []
    prompt, tokens, ref_decode = reference(path)
    for slots in (TOP_K, TOP_K + 2):
        loaded = load_streaming(path, expert_slots=slots, page_cache=page_cache)
        try:
            store = loaded.store.packed
            assert store is not None
            assert_exact(loaded, prompt, tokens, ref_decode)
            assert store.disabled is None
            misses = sum(p.counters.misses for p in loaded.pools)
            reads = sum(p.counters.reads for p in loaded.pools)
            assert misses > 0 and reads <= misses  # one read (or fewer, merged) per expert
        finally:
            loaded.store.close()


def test_the_safetensors_path_reads_each_component_separately(build, tmp_path):
    path = packed_copy(build, tmp_path)
    loaded = load_streaming(path, expert_slots=TOP_K + 1, packed=False)
    jobs = []
    read = loaded.store.read
    loaded.store.read = lambda js, verify=None: jobs.extend(js) or read(js, verify)
    try:
        assert loaded.store.packed is None
        greedy_tokens(loaded.model, prompt_tokens(1000, n=20), 8)
        misses = sum(pool.counters.misses for pool in loaded.pools)
        comps = len(loaded.pools[0].layout.components)
        # one job per component of each expert read (neighbouring ranges may then
        # share a preadv: tests/test_store.py)
        assert comps == 9 and misses > 0 and len(jobs) == comps * misses
        c = loaded.pools[0].counters
        assert c.bytes_read > 0 and c.read_mb_per_s > 0
    finally:
        loaded.store.close()


def test_records_hold_each_expert_contiguously_page_aligned(build, tmp_path):
    path = packed_copy(build, tmp_path, "mixtral", "8bit", shards=3)
    index = json.loads((path / PACKED_DIR / INDEX_NAME).read_text())
    assert index["version"] == FORMAT_VERSION
    assert set(index["source"]) == {f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)}
    maps = layer_maps(path)
    assert [e["key"] for e in index["layers"]] == [m.key for m in maps]
    for entry, layer in zip(index["layers"], maps):
        assert entry["record_size"] % ALIGN == 0 and entry["record_size"] >= layer.expert_bytes
        assert [c["name"] for c in entry["components"]] == [c.name for c in layer.components]
        blob = (path / PACKED_DIR / entry["file"]).read_bytes()
        assert len(blob) == entry["record_size"] * EXPERTS
        for e in (0, 7, EXPERTS - 1):
            want = b""
            for comp in layer.components:
                offset, length = comp.span(e)
                with open(comp.file, "rb") as fh:
                    fh.seek(offset)
                    want += fh.read(length)
            record = blob[e * entry["record_size"]:][: layer.expert_bytes]
            assert record == want
            assert zlib.crc32(record) == entry["crc32"][e]


def test_progress_reports_layers_and_bytes(build, tmp_path):
    src = build("qwen3_moe", quant="4bit", num_experts=EXPERTS, top_k=TOP_K)
    path = tmp_path / "ckpt"
    shutil.copytree(src, path)
    seen = []
    pack_checkpoint(path, progress=lambda *args: seen.append(args))
    layers = len(layer_maps(path))
    assert seen[-1][0] == seen[-1][1] == layers and seen[-1][2] == seen[-1][3] > 0
    assert [s[2] for s in seen] == sorted(s[2] for s in seen)
    assert {s[0] for s in seen} == set(range(1, layers + 1))


def test_an_interrupted_pack_leaves_no_store_that_looks_valid(build, tmp_path, monkeypatch, capsys):
    path = packed_copy(build, tmp_path)  # a good store exists, then a re-pack dies
    real = packing._write_layer
    calls = []

    def dies(layer, dest, progress):
        calls.append(1)
        if len(calls) == 2:
            dest.write_bytes(b"partial")
            raise KeyboardInterrupt
        return real(layer, dest, progress)

    monkeypatch.setattr(packing, "_write_layer", dies)
    with pytest.raises(KeyboardInterrupt):
        pack_checkpoint(path)
    folder = path / PACKED_DIR
    assert not (folder / INDEX_NAME).exists()
    assert not [p for p in folder.iterdir() if ".tmp-" in p.name]
    loaded = load_streaming(path, expert_slots=TOP_K)
    assert loaded.store.packed is None
    assert "packed store" not in capsys.readouterr().err  # absent, not damaged
    loaded.store.close()
    assert verify_packed(path) and "no packed store" in verify_packed(path)[0]


def _damage(path, kind):
    folder = path / PACKED_DIR
    index_file = folder / INDEX_NAME
    layer0 = folder / "layer-000.bin"
    shard = path / "model.safetensors"
    if kind == "truncated":
        layer0.write_bytes(layer0.read_bytes()[:-100])
    elif kind == "flipped":  # one byte of every record of layer 0
        index = json.loads(index_file.read_text())
        blob = bytearray(layer0.read_bytes())
        for e in range(EXPERTS):
            blob[e * index["layers"][0]["record_size"] + 5] ^= 0x40
        layer0.write_bytes(blob)
    elif kind == "touched":
        st = shard.stat()
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000_000))
    elif kind == "resized":
        with open(shard, "ab") as fh:
            fh.write(b"\0" * 16)
    elif kind == "bad_json":
        index_file.write_text(index_file.read_text()[:-20])
    elif kind == "version":
        index = json.loads(index_file.read_text())
        index["version"] = 99
        index_file.write_text(json.dumps(index))
    elif kind == "layout":
        index = json.loads(index_file.read_text())
        index["layers"][1]["components"].reverse()
        index_file.write_text(json.dumps(index))


DAMAGE = [
    ("truncated", "layer-000.bin is"),
    ("flipped", "fail their checksum"),
    ("touched", "stale"),
    ("resized", "stale"),
    ("bad_json", "index is unreadable"),
    ("version", "format version 99"),
    ("layout", "differs"),
]


@pytest.mark.parametrize("kind,message", DAMAGE)
def test_a_damaged_or_stale_store_is_refused_and_results_stay_exact(build, tmp_path, capsys, kind, message):
    path = packed_copy(build, tmp_path)
    prompt, tokens, ref_decode = reference(path, n=12)
    capsys.readouterr()
    _damage(path, kind)
    loaded = load_streaming(path, expert_slots=TOP_K)
    try:
        assert_exact(loaded, prompt, tokens, ref_decode)
        store = loaded.store.packed
        assert store is None or store.disabled  # refused at load, or at the first bad record
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if "packed store" in line]
        assert len(lines) == 1 and message in lines[0] and "safetensors" in lines[0], err
    finally:
        loaded.store.close()
    problems = verify_packed(path)
    assert problems and all("\n" not in p for p in problems)
    if kind == "flipped":
        assert len(problems) == EXPERTS and all("checksum" in p for p in problems)


def test_a_flipped_byte_is_caught_when_a_whole_layer_is_filled_at_load(build, tmp_path, capsys):
    path = packed_copy(build, tmp_path)
    prompt, tokens, ref_decode = reference(path, n=12)
    folder = path / PACKED_DIR
    record = json.loads((folder / INDEX_NAME).read_text())["layers"][1]["record_size"]
    blob = bytearray((folder / "layer-001.bin").read_bytes())
    blob[9 * record + 100] ^= 1
    (folder / "layer-001.bin").write_bytes(blob)
    capsys.readouterr()
    loaded = load_streaming(path)  # a slot per expert: every record is read at load
    try:
        assert loaded.store.packed.disabled and "checksum" in capsys.readouterr().err
        assert_exact(loaded, prompt, tokens, ref_decode)
    finally:
        loaded.store.close()
    assert verify_packed(path) == [f"{folder / 'layer-001.bin'}: record of expert 9 fails its checksum"]


def test_check_always_catches_damage_after_a_record_was_first_read(build, tmp_path, capsys):
    path = packed_copy(build, tmp_path)
    prompt, tokens, ref_decode = reference(path, n=12)
    loaded = load_streaming(path, expert_slots=TOP_K, packed_check="always")
    try:
        greedy_tokens(loaded.model, prompt, 4)  # records read and checked once
        _damage(path, "flipped")
        assert_exact(loaded, prompt, tokens, ref_decode)
        assert loaded.store.packed.disabled and "checksum" in capsys.readouterr().err
    finally:
        loaded.store.close()


def test_bad_arguments_are_refused(build, tmp_path):
    path = packed_copy(build, tmp_path)
    with pytest.raises(ValueError, match="packed_check"):
        load_streaming(path, packed_check="never")
    with pytest.raises(ValueError, match="page_cache"):
        load_streaming(path, page_cache="maybe")
