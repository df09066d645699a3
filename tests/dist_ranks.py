"""One rank of a local pipeline, started by tests/test_distributed.py through mlx.launch.

argv[1] is a JSON job: the checkpoint, the pool sizes, the prompts, and where to write.
Rank 0 runs the prompts at each pool size on a PipelineEngine and writes the tokens,
figures and errors to `out`; the other ranks follow it. `die_at` makes rank `die_rank`
end its process at its `die_at`-th decode token (a rank lost mid-generation);
`cancel_after` closes a first generation after that many tokens;
`other_checkpoint` makes rank 1 fingerprint another checkpoint than the one named.
mlx.launch ends every rank once one fails: rank 0 ignores that, to write its results.
"""

import json
import os
import signal
import sys
import threading

from llm_mlx_streaming.distributed.engine import PipelineEngine, follow
from llm_mlx_streaming.distributed.group import init
from llm_mlx_streaming.engine.generation import Cancelled
from llm_mlx_streaming.engine.request import LoadSpec, Request


def main(job: dict) -> None:
    group = init("ring")
    if group.rank == job.get("die_rank"):
        _die_at(job["die_at"])
    if group.rank == 1 and job.get("other_checkpoint"):
        _fingerprint_of(job["other_checkpoint"])
    if group.rank != 0:
        follow(group)
        return
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    engine = PipelineEngine(group)
    results = []
    for slots in job["slots"]:
        try:
            list(engine.queue_load(LoadSpec(job["checkpoint"], expert_slots=slots)))
        except Exception as e:
            results.append({"error": str(e)})
            continue
        if job.get("cancel_after"):
            _cancelled(engine, job["prompts"][0], job["cancel_after"], job["max_tokens"])
        for prompt in job["prompts"]:
            try:
                generation = engine.run(None, Request(prompt, max_tokens=job["max_tokens"]))
                tokens = [r.token for r in generation]
                results.append({"tokens": tokens, "stats": generation.stats})
            except Exception as e:
                results.append({"error": str(e)})
    with open(job["out"], "w") as fh:
        json.dump(results, fh)
    engine.shutdown()


def _cancelled(engine, prompt, after: int, max_tokens: int) -> None:
    """A generation cancelled from inside its `after`-th step, so the cancel lands
    mid-generation whatever the timing."""
    handle, ready, calls = {}, threading.Event(), []

    def processor(tokens, logits):
        calls.append(1)
        if len(calls) == after:
            ready.wait(30)
            handle["g"].cancel()
        return logits

    handle["g"] = engine.run(None, Request(prompt, max_tokens=max_tokens, logits_processors=[processor]))
    ready.set()
    try:
        list(handle["g"])
    except Cancelled:
        pass


def _fingerprint_of(other: str) -> None:
    from llm_mlx_streaming.distributed import engine, split

    engine.content_fingerprint = lambda path: split.content_fingerprint(other)


def _die_at(n: int) -> None:
    """End this process in the middle of its n-th generated token's forward."""
    from llm_mlx_streaming.experts import switch

    calls = {"decode": 0}
    original = switch.StreamingExperts.__call__

    def call(self, x, indices, *args, **kwargs):
        if indices.shape[-2] == 1 and self.ordinal == 0:
            calls["decode"] += 1
            if calls["decode"] >= n:
                os._exit(7)
        return original(self, x, indices, *args, **kwargs)

    switch.StreamingExperts.__call__ = call


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
