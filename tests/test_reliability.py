"""Failures a hostile user meets outside a generation: each is one line, and every file
is left as it was or as it should be."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import sqlite3
import struct
import tempfile

import pytest

from plugin_support import assert_ok, assert_one_line_error

PROMPT = "Name three file systems"


def _copy(env, tmp_path, name="Copy"):
    path = tmp_path / name
    shutil.copytree(env.checkpoint, path)
    return path


# -- 3: a user directory that cannot be written --------------------------------


def test_settings_that_cannot_be_written_are_one_line_naming_the_file(llm_env, tmp_path, monkeypatch):
    copy = _copy(llm_env, tmp_path)
    before = llm_env.settings_file.read_text()

    def denied(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(llm_env.user_dir))

    monkeypatch.setattr(tempfile, "mkstemp", denied)  # root ignores chmod, so deny the write itself
    name = str(llm_env.settings_file)
    for args in (["mlxs", "config", "max_tokens", "12"], ["mlxs", "config", "--unset", "max_tokens"],
                 ["mlxs", "add", str(copy)], ["mlxs", "remove", "small"], ["mlxs", "default", "tiny-moe"]):
        assert_one_line_error(llm_env.run(*args), "Cannot write the settings file", name, "Permission denied")
    assert llm_env.settings_file.read_text() == before
    assert list(llm_env.user_dir.glob(".mlx-streaming-*")) == []


# -- 4: stats on a damaged log database -------------------------------------------


def test_stats_on_a_damaged_database_is_one_line(llm_env, tmp_path):
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"this is not a database at all" * 100)
    assert_one_line_error(llm_env.run("mlxs", "stats", "-d", str(garbage)), str(garbage))

    assert_ok(llm_env.run("-m", "mlx-stream", "-o", "max_tokens", "3", PROMPT))
    logs = llm_env.user_dir / "logs.db"
    assert_ok(llm_env.run("mlxs", "stats"))
    data = bytearray(logs.read_bytes())
    data[:16] = b"not sqlite, sorry"[:16]  # the header that names the format
    logs.write_bytes(bytes(data))
    assert_one_line_error(llm_env.run("mlxs", "stats"), str(logs))
    assert_one_line_error(llm_env.run("mlxs", "stats", "--json"), str(logs))


# -- 5: a packed store that a restored mtime does not fool ----------------------------


def _edit_expert_keep_mtime(checkpoint):
    """Change bytes of an expert tensor and put the modification time back (touch -r)."""
    shard = checkpoint / "model.safetensors"
    st = shard.stat()
    with open(shard, "r+b") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(n))
        name = next(k for k in header if "switch_mlp.down_proj.weight" in k)
        begin = 8 + n + header[name]["data_offsets"][0]
        fh.seek(begin)
        old = fh.read(64)
        fh.seek(begin)
        fh.write(bytes(b ^ 0x5A for b in old))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert shard.stat().st_mtime_ns == st.st_mtime_ns


def test_a_restored_mtime_does_not_make_a_stale_packed_store_look_fresh(llm_env, tmp_path):
    copy = _copy(llm_env, tmp_path, "Packable")
    assert_ok(llm_env.run("mlxs", "add", str(copy), "--expert-slots", "3"))
    assert_ok(llm_env.run("mlxs", "pack", "Packable"))
    _edit_expert_keep_mtime(copy)

    bad = llm_env.run("mlxs", "pack", "Packable", "--verify")
    assert_one_line_error(bad, "problem")
    assert "stale" in bad.stdout
    result = assert_ok(llm_env.run("-m", "mlx-stream/Packable", "-o", "max_tokens", "8", PROMPT))
    assert "stale" in result.stderr
    assert llm_env.turns()[-1]["stats"]["store"] == "safetensors"  # the edited model's own bytes


def test_verify_compares_the_records_with_the_checkpoints_bytes(build, tmp_path):
    from llm_mlx_streaming.checkpoints.packing import pack_checkpoint, verify_packed
    from llm_mlx_streaming.experts.packed import INDEX_NAME, fingerprint, packed_dir

    path = tmp_path / "ckpt"
    shutil.copytree(build("qwen3_moe", quant="4bit", num_experts=8, top_k=2), path)
    pack_checkpoint(path)
    assert verify_packed(path) == []
    _edit_expert_keep_mtime(path)
    # Even a store whose fingerprint were somehow current is compared byte for byte.
    index_file = packed_dir(path) / INDEX_NAME
    index = json.loads(index_file.read_text())
    index["source"] = fingerprint(path)
    index_file.write_text(json.dumps(index))
    problems = verify_packed(path)
    assert problems and all("differs from the checkpoint" in p for p in problems)


def test_a_killed_pack_leaves_nothing_the_next_pack_counts(llm_env, tmp_path):
    copy = _copy(llm_env, tmp_path, "Packable")
    assert_ok(llm_env.run("mlxs", "add", str(copy)))
    first = assert_ok(llm_env.run("mlxs", "pack", "Packable")).stdout
    folder = copy / "mlxs-packed"
    orphan = folder / "layer-000.bin.tmp-999999999"  # a pack whose process is gone
    orphan.write_bytes(b"\0" * 5_000_000)
    assert assert_ok(llm_env.run("mlxs", "pack", "Packable")).stdout == first
    assert not orphan.exists()


# -- 6: checkpoints that can never run are refused at add (and at load) ----------------


def _config_edit(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("damage, message", [
    ("short_shard", "truncated"),
    ("top_k_too_large", "between 1 and the 8 experts"),
    ("top_k_missing", "between 1 and the 8 experts"),
    ("unknown_type", "model_type 'qwen99_moe'"),
])
def test_add_refuses_a_checkpoint_that_cannot_run(llm_env, tmp_path, damage, message):
    copy = _copy(llm_env, tmp_path, "Bad")
    if damage == "short_shard":
        shard = copy / "model.safetensors"
        shard.write_bytes(shard.read_bytes()[:-1000])
    elif damage == "top_k_too_large":
        _config_edit(copy, num_experts_per_tok=17)
    elif damage == "top_k_missing":
        _config_edit(copy, num_experts_per_tok=None)
    else:
        _config_edit(copy, model_type="qwen99_moe")
    before = llm_env.settings_file.read_text()
    assert_one_line_error(llm_env.run("mlxs", "add", str(copy)), message)
    assert llm_env.settings_file.read_text() == before
    # the same check guards loading (a model that went bad after it was added)
    settings = json.loads(before)
    settings["models"]["small"]["path"] = str(copy)
    llm_env.write_settings(**settings)
    assert_one_line_error(llm_env.run("-m", "mlx-stream", PROMPT), message)
    assert llm_env.turns() == []


# -- 7: the smaller ones --------------------------------------------------------------


def test_names_aliases_and_defaults(llm_env, tmp_path):
    copy = _copy(llm_env, tmp_path, "Other")
    assert_one_line_error(llm_env.run("mlxs", "add", str(copy), "--name", ""), "--name must not be empty")
    assert_ok(llm_env.run("mlxs", "add", str(copy), "--name", "other", "-a", "other"))  # own name as alias
    assert_ok(llm_env.run("-m", "other", "-o", "max_tokens", "2", PROMPT))
    assert llm_env.turns()[-1]["model"] == "mlx-stream/other"

    shutil.rmtree(copy)
    before = llm_env.settings_file.read_text()
    assert_one_line_error(llm_env.run("mlxs", "default", "other"), "no longer exists", str(copy))
    assert_one_line_error(llm_env.run("mlxs", "config", "default_model", "other"), "no longer exists")
    assert llm_env.settings_file.read_text() == before


@pytest.mark.parametrize("damage", ["weights", "tokenizer"])
def test_a_damaged_bundled_demo_model_is_copied_again(tmp_path, monkeypatch, damage):
    from llm_mlx_streaming.checkpoints.default import bundled_path, default_checkpoint

    monkeypatch.setenv("LLM_USER_PATH", str(tmp_path / "llm"))
    path = default_checkpoint()
    weights = path / "model.safetensors"
    good = weights.read_bytes()
    if damage == "weights":
        weights.write_bytes(good[: len(good) // 2])
    else:
        (path / "tokenizer.json").write_text("{broken")
    assert default_checkpoint() == bundled_path()
    assert weights.read_bytes() == good  # copied out of the package again
    json.loads((path / "tokenizer.json").read_text())


# -- llm mlxs verify ----------------------------------------------------------------


def _git_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _fake_hf_cache(checkpoint, root):
    """The checkpoint laid out as huggingface_hub caches it: snapshot links to blobs
    named by content address (sha256 for the LFS weights, git sha1 for the rest)."""
    repo = root / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    for file in sorted(checkpoint.iterdir()):
        if not file.is_file():
            continue
        data = file.read_bytes()
        lfs = file.suffix == ".safetensors"
        digest = hashlib.sha256(data).hexdigest() if lfs else _git_sha1(data)
        (repo / "blobs" / digest).write_bytes(data)
        (snapshot / file.name).symlink_to(os.path.join("..", "..", "blobs", digest))
    return snapshot


def _flip(file, at=None):
    data = bytearray(file.read_bytes())
    at = len(data) - 7 if at is None else at
    data[at] ^= 0x01
    file.write_bytes(bytes(data))


def test_verify_a_model_from_the_hugging_face_cache(llm_env, tmp_path):
    snapshot = _fake_hf_cache(llm_env.checkpoint, tmp_path / "hub")
    assert_ok(llm_env.run("mlxs", "add", str(snapshot), "--name", "hf"))
    ok = assert_ok(llm_env.run("mlxs", "verify", "hf"))
    assert ok.stdout.startswith("ok: ") and "Hugging Face cache" in ok.stdout

    _flip(snapshot / "model.safetensors")  # a flipped bit in the last expert's bytes
    (snapshot / "tokenizer.json").resolve().write_text("{}")
    bad = llm_env.run("mlxs", "verify", "hf")
    assert_one_line_error(bad, "2 of the", "do not match the Hugging Face cache")
    lines = bad.stdout.splitlines()
    assert len(lines) == 2
    assert any("model.safetensors: sha256" in line for line in lines)
    assert any("tokenizer.json: git-sha1" in line for line in lines)
    # --quick hashes the small files (here every file: the test checkpoint is tiny)
    quick = llm_env.run("mlxs", "verify", "hf", "--quick")
    assert quick.exit_code == 1 and "tokenizer.json" in quick.stdout


def test_verify_a_local_folder_against_its_recorded_manifest(llm_env, tmp_path):
    copy = _copy(llm_env, tmp_path, "Local")
    assert_one_line_error(llm_env.run("mlxs", "verify", str(copy)), "no hashes to compare with", "--record")
    added = assert_ok(llm_env.run("mlxs", "add", str(copy), "--hash"))
    assert "Recorded the hashes" in added.stderr
    assert assert_ok(llm_env.run("mlxs", "verify", "Local")).stdout.startswith("ok: ")

    _flip(copy / "model.safetensors")
    (copy / "tokenizer_config.json").unlink()
    bad = llm_env.run("mlxs", "verify", "Local")
    assert_one_line_error(bad, "2 of the", "recorded manifest")
    assert sorted(bad.stdout.splitlines()) == sorted([
        f"{copy / 'model.safetensors'}: sha256 " + bad.stdout.split("model.safetensors: sha256 ")[1].splitlines()[0],
        f"{copy / 'tokenizer_config.json'}: missing",
    ])
    # recording again takes the files as they are now
    assert_ok(llm_env.run("mlxs", "verify", "Local", "--record"))
    assert_ok(llm_env.run("mlxs", "verify", "Local"))


# -- 8: llm's own logging under concurrency -------------------------------------------


def test_concurrent_first_commands_find_logs_db_complete(tmp_path):
    """Five llm processes started at once on a fresh user directory: llm's own
    migrations would race (table "schemas" already exists ...); the plugin builds the
    database once, under a lock, before any command runs."""
    import subprocess
    import sys
    from pathlib import Path

    from llm.migrations import MIGRATIONS

    env = {**os.environ, "LLM_USER_PATH": str(tmp_path / "llm"),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    code = "import sys; from llm.cli import cli; sys.argv = ['llm', 'fragments', 'list']; cli()"
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(5)]
    results = [p.communicate(timeout=120) + (p.returncode,) for p in procs]
    assert [r[2] for r in results] == [0] * 5, [r[1] for r in results]
    conn = sqlite3.connect(tmp_path / "llm" / "logs.db")
    applied = {row[0] for row in conn.execute("select name from _llm_migrations")}
    assert applied == {fn.__name__ for fn in MIGRATIONS}
    assert not list((tmp_path / "llm").glob(".logs.db.tmp-*"))


def test_stats_shows_layer_calls_also_from_rows_logged_under_the_old_names(llm_env):
    assert_ok(llm_env.run("-m", "mlx-stream", "-o", "max_tokens", "4", PROMPT))
    stats = llm_env.turns()[-1]["stats"]
    new = (stats["calls_no_load"], stats["calls_loaded"])
    assert new[1] > 0 and "gpu_fastpath" not in stats
    conn = sqlite3.connect(llm_env.user_dir / "logs.db")
    old = {("gpu_fastpath" if k == "calls_no_load" else "gpu_fallback" if k == "calls_loaded" else k): v
           for k, v in stats.items()}
    conn.execute("update turns set response_json = ?", [json.dumps(old)])
    conn.commit()
    conn.close()
    shown = assert_ok(llm_env.run("mlxs", "stats")).stdout
    assert f"layer calls       {new[0]} with every expert resident, {new[1]} that read experts" in shown
