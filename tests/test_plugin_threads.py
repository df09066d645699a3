"""Several threads prompting two models at once through llm's Python API."""

import threading
import time

import llm


def test_threads_prompting_two_models_each_get_their_own_checkpoint(llm_env, build, monkeypatch):
    from llm_mlx_streaming.reply import build as prompting  # where the reply core calls render_prompt

    other = build("qwen3_moe", seed=7)
    llm_env.write_settings(
        default_model="small",
        models={
            "small": {"path": str(llm_env.checkpoint), "expert_slots": 4},
            "other": {"path": str(other), "expert_slots": 4},
        },
    )
    paths = {"small": str(llm_env.checkpoint), "other": str(other)}
    alone = {name: llm.get_model(f"mlx-stream/{name}").prompt("hello there", max_tokens=6).text()
             for name in paths}
    assert alone["small"] != alone["other"]

    real_render = prompting.render_prompt

    def slow_render(tokenizer, prompt, **options):
        time.sleep(0.05)  # a window in which another thread could swap the model
        return real_render(tokenizer, prompt, **options)

    monkeypatch.setattr(prompting, "render_prompt", slow_render)
    results, errors = [], []

    def ask(name):
        try:
            response = llm.get_model(f"mlx-stream/{name}").prompt("hello there", max_tokens=6)
            results.append((name, response.text(), response.response_json["checkpoint"]))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=ask, args=(name,)) for name in ["small", "other"] * 3]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and len(results) == 6
    for name, text, checkpoint in results:
        assert checkpoint == paths[name]
        assert text == alone[name]
