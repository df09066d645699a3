"""A test that serves a pipeline and waits, for test_distributed.py to end its pytest run
mid-test (SIGTERM, SIGINT) and see nothing left running. Not collected on its own (its
name is not test_*.py); its llm user dir is the LLM_USER_PATH it is started with, where it
writes `serving` once rank 0 listens."""

import os
import time
from pathlib import Path

from plugin_support import LlmEnv
from test_distributed import _serve, _stop


def test_a_pipeline_is_served_until_the_run_is_ended(plugin_checkpoint):
    user_dir = Path(os.environ["LLM_USER_PATH"])
    env = LlmEnv(user_dir, plugin_checkpoint)
    env.write_settings(default_model="small", models={"small": {"path": str(plugin_checkpoint), "expert_slots": 4}})
    server, info = _serve(env, user_dir / "serve.log", "--hosts", "127.0.0.1,127.0.0.1")
    try:
        (user_dir / "serving").write_text(info.url)
        time.sleep(300)
    finally:
        _stop(server, env)
