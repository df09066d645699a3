"""One rank of a local pipeline, started by tests/test_distributed.py through mlx.launch.

argv[1] is a JSON job: `runs` (each a checkpoint, a pool size, request fields, and
`cancel_after`: first a generation its caller cancels after that many tokens), the
prompts, and where rank 0 writes its results: per run, the tokens and figures of each
prompt, or the one-line error. The other ranks follow rank 0. `die_at` makes rank
`die_rank` end its process at its `die_at`-th decode token (a rank lost mid-generation),
or with `hang` stop answering there; `timeouts` sets each rank's step timeout;
`differs` names a checkpoint whose fingerprint rank 1 takes from another (`as`);
`budgets` and `plan_options` are the PipelineEngine's. A run's `cancel_in_prefill`
(a prompt, a prefill step and a chunk count) is first a generation rank 0 cancels
inside that prefill chunk; each rank then writes the sizes of the prompt chunks its
layers ran to `out`.rankN.
mlx.launch ends every rank once one fails: rank 0 ignores that, to write its results.
"""

import json
import os
import signal
import sys
import threading
import time

from llm_mlx_streaming.distributed.engine import PipelineEngine, follow
from llm_mlx_streaming.distributed.group import init
from llm_mlx_streaming.engine.generation import Cancelled
from llm_mlx_streaming.engine.kv import KVSpec
from llm_mlx_streaming.engine.request import LoadSpec, Request, Sampling


def main(job: dict) -> None:
    group = init("ring")
    if group.rank == job.get("die_rank"):
        _die_at(job["die_at"], job.get("hang", False))
    if job.get("timeouts"):  # seconds without word, per rank
        from llm_mlx_streaming.distributed import watch

        watch.TIMEOUTS["step"] = job["timeouts"][group.rank]
    if group.rank == 1 and job.get("differs"):
        _fingerprint_of(**job["differs"])
    chunks = _count_chunks(group.rank)
    if group.rank != 0:
        follow(group)
        _write(f"{job['out']}.rank{group.rank}", chunks)
        return
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    engine = PipelineEngine(group, job.get("budgets"), **job.get("plan_options", {}))
    results = [_run(engine, run, job) for run in job["runs"]]
    _write(job["out"], results)
    engine.shutdown()
    _write(f"{job['out']}.rank0", chunks)


def _write(path: str, value) -> None:
    with open(path, "w") as fh:
        json.dump(value, fh)


def _run(engine, run: dict, job: dict) -> list[dict] | dict:
    try:
        list(engine.queue_load(LoadSpec(run["checkpoint"], expert_slots=run.get("slots"))))
    except Exception as e:
        return {"error": str(e)}
    fields = {"max_tokens": job["max_tokens"], "k": run.get("k", 0), "stop": run.get("stop", ()),
              "sampling": Sampling(**run.get("sampling", {}))}
    if run.get("kv_bits"):
        fields["kv"] = KVSpec(run["kv_bits"], 32)
    if run.get("cancel_after"):
        _cancelled(engine, run["prompts"][0], run["cancel_after"], fields)
    if run.get("cancel_in_prefill"):
        _cancelled_in_prefill(engine, **run["cancel_in_prefill"], fields=fields)
    out = []
    for prompt in run["prompts"]:
        try:
            generation = engine.run(None, Request(prompt, **fields))
            out.append({"tokens": [r.token for r in generation], "stats": generation.stats})
        except Exception as e:
            out.append({"error": str(e)})
    return out


def _cancelled(engine, prompt, after: int, fields: dict) -> None:
    """A generation cancelled from inside its `after`-th step, so the cancel lands
    mid-generation whatever the timing."""
    handle, ready, calls = {}, threading.Event(), []

    def processor(tokens, logits):
        calls.append(1)
        if len(calls) == after:
            ready.wait(30)
            handle["g"].cancel()
        return logits

    handle["g"] = engine.run(None, Request(prompt, logits_processors=[processor], **fields))
    ready.set()
    try:
        list(handle["g"])
    except Cancelled:
        pass


CANCEL = {}  # rank 0: the generation to cancel inside its `at`-th prompt chunk of `size`


def _count_chunks(rank: int) -> list[int]:
    """The size of each prompt chunk this rank's layers run (at its first MoE layer);
    on rank 0, cancels CANCEL's generation when its chunk comes."""
    from llm_mlx_streaming.experts import switch

    chunks, first = [], []
    original = switch.StreamingExperts.__call__

    def call(self, x, indices, *args, **kwargs):
        first[:] = first or [self.ordinal]
        size = indices.shape[-2]
        if size > 1 and self.ordinal == first[0]:
            chunks.append(size)
            if rank == 0 and CANCEL and chunks.count(CANCEL["size"]) == CANCEL["at"]:
                CANCEL["ready"].wait(30)
                CANCEL.pop("generation").cancel()
                CANCEL.clear()
        return original(self, x, indices, *args, **kwargs)

    switch.StreamingExperts.__call__ = call
    return chunks


def _cancelled_in_prefill(engine, prompt: list[int], step: int, at: int, fields: dict) -> None:
    """A generation cancelled from inside its `at`-th prefill chunk of `step` tokens."""
    ready = threading.Event()
    CANCEL.update(size=step, at=at, ready=ready)
    CANCEL["generation"] = generation = engine.run(None, Request(prompt, prefill_step=step, **fields))
    ready.set()
    try:
        list(generation)
    except Cancelled:
        pass


def _fingerprint_of(path: str, as_: str) -> None:
    from llm_mlx_streaming.distributed import engine, split

    def fingerprint(given):
        return split.content_fingerprint(as_ if str(given) == path else given)

    engine.content_fingerprint = fingerprint


def _die_at(n: int, hang: bool) -> None:
    """End this process (or, with `hang`, stop it answering) in the middle of its n-th
    generated token's forward."""
    from llm_mlx_streaming.experts import switch

    calls = {"decode": 0}
    original = switch.StreamingExperts.__call__

    def call(self, x, indices, *args, **kwargs):
        if indices.shape[-2] == 1 and self.ordinal == 0:
            calls["decode"] += 1
            if calls["decode"] >= n:
                if hang:
                    time.sleep(600)
                os._exit(7)
        return original(self, x, indices, *args, **kwargs)

    switch.StreamingExperts.__call__ = call


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
