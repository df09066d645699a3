"""`llm mlxs ...` commands and `llm models --options`, through llm's real CLI."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from plugin_support import assert_ok, assert_one_line_error


def test_models_options_lists_every_option(llm_env):
    out = assert_ok(llm_env.run("models", "--options", "-m", "mlx-stream")).stdout
    for option in ("max_tokens", "temperature", "top_p", "min_p", "top_k", "seed", "expert_slots", "policy", "memory_budget",
                   "stop", "thinking"):
        assert f"{option}:" in out
    assert "greedy" in out  # descriptions are shown
    listed = assert_ok(llm_env.run("models", "list")).stdout
    assert "mlx-stream/small (aliases: sm)" in listed and "mlx-stream/tiny-moe" in listed


def test_config_show_set_unset(llm_env, monkeypatch):
    from llm_mlx_streaming.options.knobs import GROUPS

    monkeypatch.setenv("COLUMNS", "80")
    out = assert_ok(llm_env.run("mlxs", "config")).stdout
    assert max(len(line) for line in out.splitlines()[1:]) <= 80  # cut to the terminal's width
    titles = [line for line in out.splitlines() if line and not line.startswith(("  ", "* ", "Settings file"))]
    assert titles == [title for title, _ in GROUPS]  # grouped as knobs.py groups them
    lines = {line[2:].split()[0]: line for line in out.splitlines() if line.startswith(("  ", "* "))}
    assert set(lines) == {
        "default_model", "expert_slots", "policy", "max_tokens",
        "memory_budget", "max_context", "buffer_cache", "threads", "page_cache", "overlap", "trace", "packed",
        "k", "draft",  # speculation (issue 9)
        "kv_bits", "kv_group_size", "kv_start", "prefill_step",  # long context (#13)
        "server", "server_hosts", "server_origins", "reply_memory", "max_batch", "max_responses",  # the server
        "image_urls", "max_image_bytes",  # images (#37)
        "conversation_cache", "conversation_cache_size", "conversation_cache_entries",  # features (#11)
        "snapshot_every", "snapshots", "snapshot_memory",  # an agent's prompt read once (#46)
        "max_models", "keep_alive",  # several models in one memory (#47)
    }
    assert lines["default_model"].startswith("* ") and lines["max_tokens"].startswith("  ")
    assert lines["max_tokens"].endswith("...")  # its description is longer than the room left
    long = assert_ok(llm_env.run("mlxs", "config", "--long")).stdout
    assert "full." in long and not any(line.endswith("...") for line in long.splitlines())  # whole, wrapped

    assert_ok(llm_env.run("mlxs", "config", "max_tokens", "7"))
    assert_ok(llm_env.run("mlxs", "config", "policy", "lru"))
    assert llm_env.read_settings()["max_tokens"] == 7
    one = assert_ok(llm_env.run("mlxs", "config", "max_tokens"))
    assert one.stdout == "7\n" and one.stderr.startswith("max_tokens (set): Most tokens generated per response;")
    data = json.loads(assert_ok(llm_env.run("mlxs", "config", "--json")).stdout)
    assert {d["key"]: d["default"] for d in data}["max_tokens"] is False

    # settings are the defaults for options
    assert_ok(llm_env.run("-m", "mlx-stream", "hi"))
    stats = llm_env.turns()[-1]["stats"]
    assert stats["generated_tokens"] == 7 and stats["policy"] == "lru"

    assert_ok(llm_env.run("mlxs", "config", "--unset", "max_tokens"))
    assert "max_tokens" not in llm_env.read_settings()
    assert "models" in llm_env.read_settings()  # the registry survives


def test_config_takes_a_negative_value_as_a_value(llm_env):
    assert_ok(llm_env.run("mlxs", "config", "max_tokens", "-1"))
    assert llm_env.read_settings()["max_tokens"] == -1
    assert_one_line_error(llm_env.run("mlxs", "config", "kv_bits", "-1"), "kv_bits")


def test_config_rejects_bad_keys_and_values(llm_env):
    before = llm_env.settings_file.read_text()
    assert_one_line_error(llm_env.run("mlxs", "config", "nope", "1"), "Unknown setting 'nope'")
    assert_one_line_error(llm_env.run("mlxs", "config", "max_tokens", "many"), "max_tokens")
    assert_one_line_error(llm_env.run("mlxs", "config", "expert_slots", "0"), "expert_slots")
    assert_one_line_error(llm_env.run("mlxs", "config", "policy", "fifo"), "policy")
    assert_one_line_error(llm_env.run("mlxs", "config", "default_model", "ghost"), "Unknown model 'ghost'")
    assert_one_line_error(llm_env.run("mlxs", "config", "--unset", "models"), "Unknown setting")
    assert_one_line_error(llm_env.run("mlxs", "config", "image_urls", "sometimes"), "image_urls")
    assert_one_line_error(llm_env.run("mlxs", "config", "max_image_bytes", "0"), "max_image_bytes")
    assert_one_line_error(llm_env.run("mlxs", "config", "max_image_bytes", "huge"), "max_image_bytes")
    assert llm_env.settings_file.read_text() == before


def test_image_settings_take_sizes(llm_env):
    assert_ok(llm_env.run("mlxs", "config", "max_image_bytes", "5MiB"))
    assert_ok(llm_env.run("mlxs", "config", "image_urls", "on"))
    settings = llm_env.read_settings()
    assert settings["image_urls"] == "on" and settings["max_image_bytes"] == 5 * 2**20


def test_a_vision_checkpoint_declares_image_attachments_a_text_only_one_none(llm_env, tmp_path):
    import llm

    seer = tmp_path / "seer"
    shutil.copytree(llm_env.checkpoint, seer)
    config = json.loads((seer / "config.json").read_text())
    (seer / "config.json").write_text(json.dumps({**config, "vision_config": {"model_type": "siglip_vision_model"}}))
    llm_env.write_settings(default_model="small", models={
        "small": {"path": str(llm_env.checkpoint), "expert_slots": 4}, "seer": {"path": str(seer)}})
    image_types = {"image/png", "image/jpeg", "image/webp", "image/gif"}
    assert llm.get_model("mlx-stream/seer").attachment_types == image_types
    assert llm.get_async_model("mlx-stream/seer").attachment_types == image_types
    assert llm.get_model("mlx-stream/small").attachment_types == frozenset()
    assert llm.get_model("mlx-stream").attachment_types == frozenset()  # the default: small
    assert llm.get_model("mlx-stream/tiny-moe").attachment_types == frozenset()  # the bundled demo
    assert "image/png" in assert_ok(llm_env.run("models", "--options", "-m", "mlx-stream/seer")).stdout


def test_an_image_on_a_text_only_model_is_one_line_and_no_row(llm_env, tmp_path):
    from PIL import Image

    image = tmp_path / "red.png"
    Image.new("RGB", (8, 8), (200, 30, 30)).save(image)
    assert_one_line_error(llm_env.run("-m", "mlx-stream/small", "-a", str(image), "describe"),
                          "does not support attachments")
    assert_one_line_error(llm_env.run("-m", "mlx-stream", "--at", str(image), "image/png", "describe"),
                          "does not support attachments")
    assert llm_env.turns() == []


def test_models_add_remove_default(llm_env, tmp_path):
    copy = tmp_path / "Other-MoE"
    shutil.copytree(llm_env.checkpoint, copy)
    added = assert_ok(llm_env.run("mlxs", "add", str(copy), "-a", "om", "-a", "other"))
    assert "mlx-stream/Other-MoE" in added.stdout and "8 experts x 2 layers" in added.stdout

    out = assert_ok(llm_env.run("mlxs", "models")).stdout
    row = next(line for line in out.splitlines() if "Other-MoE" in line)
    assert "om, other" in row and "qwen3_moe" in row and "8 x 2" in row and "KB" in row
    assert next(line for line in out.splitlines() if "small" in line).startswith("*")

    assert_ok(llm_env.run("-m", "om", "-o", "max_tokens", "3", "via alias"))
    assert llm_env.turns()[-1]["model"] == "mlx-stream/Other-MoE"

    assert_ok(llm_env.run("mlxs", "default", "other"))
    assert llm_env.read_settings()["default_model"] == "Other-MoE"
    assert assert_ok(llm_env.run("mlxs", "default")).stdout == "Other-MoE\n"
    assert_ok(llm_env.run("-m", "mlx-stream", "-o", "max_tokens", "3", "default now"))
    assert llm_env.turns()[-1]["resolved_model"] == str(copy)

    assert_ok(llm_env.run("mlxs", "remove", "Other-MoE"))
    assert "Other-MoE" not in llm_env.read_settings()["models"]
    assert "default_model" not in llm_env.read_settings()  # back to the bundled demo
    assert copy.exists()  # files are left alone


@pytest.mark.parametrize("family,found,origin,reasoning", [
    ("gpt_oss", "harmony", "ours", "<|channel|>analysis<|message|>"), ("kimi_k2", "kimi_k2", "ours", None),
    ("deepseek_v32", "deepseek_v32", "ours", "<think>"), ("qwen3", "json_tools", "ours", "<think>"),
    ("seed_oss", "learned", "learned", "<seed:think>")])
def test_add_and_models_say_what_tool_call_format_is_found_in_the_checkpoint(llm_env, tmp_path, family, found,
                                                                            origin, reasoning):
    from fixtures.families import build_family_checkpoint

    path = build_family_checkpoint(tmp_path / family, family)
    added = assert_ok(llm_env.run("mlxs", "add", str(path), "--name", family))
    assert f"tool calls: {found})" in added.stdout
    said = next(line for line in added.stdout.splitlines() if line.startswith("Tool calls:"))
    assert said.startswith(f"Tool calls: {found} (") and "tool_choice required or named can be forced" in said
    assert (f"reasoning {reasoning} ... " in said) if reasoning else "no reasoning markers" in said
    rows = {r["name"]: r for r in json.loads(assert_ok(llm_env.run("mlxs", "models", "--json")).stdout)}
    assert rows[family]["tool_calls"] == found
    report = rows[family]["tool_format"]
    assert report["origin"] == origin and report["forced"] and report["note"] is None
    assert (report["reasoning"] or [None])[0] == reasoning
    # the small model's template renders no calls: none, and learning says why in one line
    assert rows["small"]["tool_calls"] is None
    assert rows["small"]["tool_format"] == {"name": None, "origin": "none", "markup": None,
                                            "reasoning": ["<think>", "</think>"],  # its vocabulary has the tags
                                            "forced": False, "note": "the template renders no tool calls"}
    listing = assert_ok(llm_env.run("mlxs", "models")).stdout
    assert "mlx-stream/small: no tool-call format learned from its template: the template renders no tool calls" in listing


def test_add_rejects_bad_sources(llm_env, tmp_path, monkeypatch):
    assert_one_line_error(llm_env.run("mlxs", "add", str(tmp_path / "missing")), f"No such folder: {tmp_path}/missing")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    for typo in ("models/foo", "./foo", "~/no-such-folder", "a/b/c"):  # a path, not a Hugging Face repo id
        assert assert_one_line_error(llm_env.run("mlxs", "add", typo)) == f"Error: No such folder: {typo}"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert_one_line_error(llm_env.run("mlxs", "add", str(empty)), "no config.json")
    (empty / "config.json").write_text('{"model_type": "qwen3_moe"}')
    assert_one_line_error(llm_env.run("mlxs", "add", str(empty)), "no model*.safetensors")
    assert_one_line_error(
        llm_env.run("mlxs", "add", str(llm_env.checkpoint), "--name", "small"), "already exists"
    )
    assert_one_line_error(
        llm_env.run("mlxs", "add", str(llm_env.checkpoint), "--name", "x", "-a", "sm"), "'sm'"
    )
    assert_one_line_error(llm_env.run("mlxs", "remove", "ghost"), "Unknown model 'ghost'")
    assert_one_line_error(llm_env.run("mlxs", "remove", "tiny-moe"), "cannot be removed")
    assert_one_line_error(llm_env.run("mlxs", "default", "ghost"), "Unknown model 'ghost'")


def test_add_from_hugging_face(llm_env, monkeypatch):
    """A repo id in the local HF cache is added offline; otherwise its size is said, then it is downloaded."""
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError
    from huggingface_hub.file_download import DryRunFileInfo

    calls = []
    cached = {"mlx-community/Tiny-MoE-4bit"}

    def fake_snapshot_download(repo_id, **kwargs):
        calls.append((repo_id, kwargs.get("local_files_only", False), kwargs.get("dry_run", False)))
        if kwargs.get("local_files_only") and repo_id not in cached:
            raise LocalEntryNotFoundError("not cached")
        if kwargs.get("dry_run"):
            return [DryRunFileInfo("abc", size, name, "", False, True)
                    for name, size in (("config.json", 1000), ("model.safetensors", 17_200_000_000))]
        return str(llm_env.checkpoint)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    out = assert_ok(llm_env.run("mlxs", "add", "mlx-community/Tiny-MoE-4bit")).stdout
    assert "mlx-stream/Tiny-MoE-4bit" in out
    assert calls == [("mlx-community/Tiny-MoE-4bit", True, False)]  # no network
    entry = llm_env.read_settings()["models"]["Tiny-MoE-4bit"]
    assert entry["source"] == "mlx-community/Tiny-MoE-4bit"

    calls.clear()
    added = assert_ok(llm_env.run("mlxs", "add", "org/Fresh-MoE", "-a", "fresh"))
    assert calls == [("org/Fresh-MoE", True, False), ("org/Fresh-MoE", False, True), ("org/Fresh-MoE", False, False)]
    assert "Downloading org/Fresh-MoE from Hugging Face: 17.2 GB in 2 files..." in added.stderr


@pytest.mark.parametrize("raised, said", [
    (lambda: OSError("connection refused\n(retry later)"), "Could not download org/x: connection refused (retry later)"),
    (lambda: _hub("GatedRepoError"), "org/x is gated on Hugging Face: accept its terms at https://huggingface.co/org/x, "
                                     "then log in with `hf auth login`"),
    (lambda: _hub("RepositoryNotFoundError"), "No folder org/x here, and no model org/x on Hugging Face"),
    (lambda: _offline(), "No folder org/x here, and Hugging Face cannot be reached to download a model of that name "
                         "([Errno -2] Name or service not known): connect to the network"),
])
def test_a_hugging_face_error_is_one_line_naming_what_to_do(llm_env, monkeypatch, raised, said):
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    def fake_snapshot_download(repo_id, **kwargs):
        if kwargs.get("local_files_only"):
            raise LocalEntryNotFoundError("not cached")
        raise raised()

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    assert_one_line_error(llm_env.run("mlxs", "add", "org/x"), said)


def _hub(kind: str) -> Exception:
    """The error huggingface_hub raises for a repo answered `kind` (with the HTTP response it carries)."""
    import httpx
    from huggingface_hub import errors

    response = httpx.Response(401, request=httpx.Request("GET", "https://huggingface.co/api/models/org/x"))
    return getattr(errors, kind)("the Hub said no", response=response)


def _offline() -> Exception:
    """What a dry run raises without a network: DryRunError, caused by the failed connection."""
    import socket

    from huggingface_hub.errors import DryRunError

    try:
        try:
            raise socket.gaierror(-2, "Name or service not known")
        except OSError as e:
            raise DryRunError("Dry run cannot be performed as the repository cannot be accessed.") from e
    except DryRunError as e:
        return e


def test_stats_after_two_prompts(llm_env, tmp_path):
    assert_one_line_error(llm_env.run("mlxs", "stats"), "No mlx-stream responses")
    assert_one_line_error(llm_env.run("mlxs", "stats", "-d", str(tmp_path / "none.db")),
                          f"No such file: {tmp_path / 'none.db'}")
    assert_ok(llm_env.run("-m", "mlx-stream", "-o", "max_tokens", "5", "first"))
    assert_ok(llm_env.run("-m", "sm", "-o", "max_tokens", "6", "second"))
    table = assert_ok(llm_env.run("mlxs", "stats")).stdout
    assert "Last response  mlx-stream/small" in table
    assert "hit rate" in table and "decode" in table and "Last 2 responses" in table

    data = json.loads(assert_ok(llm_env.run("mlxs", "stats", "--json")).stdout)
    first, second = (t["stats"] for t in llm_env.turns())
    assert data["last"]["stats"] == second
    agg = data["aggregate"]
    assert agg["responses"] == 2
    assert agg["generated_tokens"] == first["generated_tokens"] + second["generated_tokens"] == 11
    assert agg["hits"] == first["hits"] + second["hits"]
    one = json.loads(assert_ok(llm_env.run("mlxs", "stats", "-n", "1", "--json")).stdout)
    assert one["aggregate"]["responses"] == 1


def test_a_capped_max_tokens_or_expert_slots_is_named_once_on_stderr(llm_env):
    capped = assert_ok(llm_env.run("-m", "mlx-stream", "-o", "max_context", "40", "-o", "max_tokens", "1000",
                                   "-o", "expert_slots", "100", "hi"))
    stats = llm_env.turns()[-1]["stats"]
    given = 40 - stats["prompt_tokens"]
    assert stats["capped"] == {"max_tokens": [1000, given], "expert_slots": [100, 8]} and stats["expert_slots"] == 8
    assert capped.stderr.splitlines() == [f"mlx-stream: max_tokens 1000 capped at {given} (the context left after "
                                          "the prompt); expert_slots 100 capped at 8 (the experts of a layer)"]
    plain = assert_ok(llm_env.run("-m", "mlx-stream", "-o", "max_tokens", "3", "-o", "expert_slots", "8", "hi"))
    assert plain.stderr == "" and "capped" not in llm_env.turns()[-1]["stats"]


def test_a_size_without_a_unit_is_refused_with_the_unit_it_meant_everywhere(llm_env):
    said = "12: did you mean 12GB? Bytes are written 12B"
    assert_one_line_error(llm_env.run("mlxs", "config", "memory_budget", "12"), said)
    assert_one_line_error(llm_env.run("mlxs", "config", "conversation_cache_size", "12"), said)
    assert_one_line_error(llm_env.run("mlxs", "config", "max_image_bytes", "12"), "12: did you mean 12MB?")
    assert_one_line_error(llm_env.run("mlxs", "plan", "--budget", "12"), said)
    assert_one_line_error(llm_env.run("mlxs", "plan", "--budgets", "12,12GB"), said)
    assert_one_line_error(llm_env.run("mlxs", "serve", "--hosts", "a,b", "--budgets", "12,12GB"), said)
    option = llm_env.run("-m", "mlx-stream", "-o", "memory_budget", "12", "hi")
    assert option.exit_code == 1 and said in option.stderr and llm_env.turns() == []
    assert_ok(llm_env.run("mlxs", "config", "memory_budget", "12GB"))


def test_llm_mlxs_help_gives_every_command_a_whole_summary(llm_env, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    out = assert_ok(llm_env.run("mlxs", "--help")).stdout
    commands = out.split("Commands:\n", 1)[1].splitlines()
    assert len(commands) >= 14
    assert all(re.match(r"  [a-z][a-z-]* +\S.*\.$", line) and len(line) <= 80 for line in commands), commands
    assert not [line for line in commands if line.endswith("...")]  # none cut mid-phrase, none wrapped
