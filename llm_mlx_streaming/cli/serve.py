"""`llm mlxs serve`: keep the engine warm behind the OpenAI (chat completions and Responses), Anthropic and
Ollama APIs (docs/server.md)."""

from __future__ import annotations

import signal
import sys

import click

from .group import mlxs


@mlxs.command(short_help="Serve the models: OpenAI, Anthropic, Ollama APIs.")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on; anything but loopback needs --api-key")
@click.option("--port", default=8080, show_default=True, type=click.IntRange(0, 65535),
              help="Port (0: any free port)")
@click.option("-m", "--model", "models", multiple=True,
              help="Model to load at start and keep loaded (pinned); the first answers by default "
              "(e.g. mlx-stream/qwen3; repeatable)")
@click.option("--max-models", type=click.IntRange(1, 64),
              help="Most models kept loaded at once, sharing memory_budget (default: `llm mlxs config max_models`)")
@click.option("--api-key", help="Bearer token every endpoint but /health requires")
@click.option("--max-queue", default=8, show_default=True, type=click.IntRange(0),
              help="Requests that may wait for the engine; more get 503 with Retry-After")
@click.option("--allow-host", "hosts", multiple=True, metavar="NAME",
              help="A name clients may reach this server by, besides loopback, IP addresses and this "
              "machine's name (repeatable; * any; default: `llm mlxs config server_hosts`)")
@click.option("--allow-origin", "origins", multiple=True, metavar="ORIGIN",
              help="A web origin whose pages may call the API, with CORS (repeatable; * any; "
              "default: `llm mlxs config server_origins`)")
@click.option("--strict", is_flag=True,
              help="Refuse (400) a request field this server does not declare, instead of accepting it and "
              "naming it in the x-mlx-stream-ignored header")
@click.option("--model-alias", "aliases", multiple=True, metavar="NAME=MODEL",
              help="Answer requests for the model NAME (e.g. claude-sonnet-4-5) with MODEL (repeatable)")
@click.option("--any-model", is_flag=True,
              help="Answer a request for any model name this server does not serve with the default model "
              "(the reply names the model that answered)")
@click.option("--hosts", "pipeline", metavar="HOST,HOST,...",
              help="Run the model as a pipeline over these machines (mlx.launch; the first serves HTTP)")
@click.option("--hostfile", type=click.Path(exists=True, dir_okay=False),
              help="mlx.launch's hostfile, in place of --hosts")
@click.option("--backend", type=click.Choice(["ring", "mpi"]), default="ring", show_default=True,
              help="mlx.distributed backend between the --hosts")
@click.option("--budgets", metavar="SIZE,SIZE,...",
              help="With --hosts: each host's memory budget, rank 0's first; they weigh the layer split, "
              "and a model without a slot count gets each rank's own plan (llm mlxs plan --budgets)")
@click.option("--ring-port", type=click.IntRange(1024, 65535),
              help="First TCP port the ring backend listens on, one more per rank (default: mlx.launch's)")
@click.option("--restarts", default=3, show_default=True, type=click.IntRange(0),
              help="With --hosts: how often in a row a failed pipeline is started again (0: never; "
              "the server then exits with the failure)")
@click.option("-q", "--quiet", is_flag=True, help="No line per request on stderr (the loads and where things are "
              "are still said)")
@click.option("--pipeline-rank", is_flag=True, hidden=True)
@click.option("--pipeline-restarts", default=0, type=int, hidden=True)
@click.option("--pipeline-error", hidden=True)
@click.option("--supervisor", hidden=True)  # HOST:PID
@click.pass_context
def serve(ctx, host, port, models, max_models, api_key, max_queue, hosts, origins, strict, aliases, any_model, pipeline, hostfile,
          backend, budgets, ring_port, restarts, quiet, pipeline_rank, pipeline_restarts, pipeline_error, supervisor):
    """Serve the mlx-stream models over HTTP: the OpenAI, Anthropic Messages and Ollama APIs.

    While it runs, `llm -m mlx-stream...`, `llm chat` and `llm -c` in this llm user
    dir send their prompts to it (`llm mlxs config server off`, or -o server off for one prompt: not).
    With --hosts (or --hostfile) it starts one rank per machine through mlx.launch;
    each holds a range of the layers and its own expert pools, and the first serves.
    A rank that fails ends the pipeline; it is started again (--restarts).
    """
    from ..server.process.run import Server

    if not (pipeline or hostfile or pipeline_rank):
        _refuse_pipeline_options(ctx)
    if (pipeline or hostfile) and not pipeline_rank:
        _supervise(ctx, pipeline, hostfile, backend, ring_port)
        return
    engine = None
    if pipeline_rank:
        from ..distributed.group import RankLost
        from ..distributed.launch import join
        from ..errors import MlxStreamError

        try:
            from ..options.settings import load_settings

            engine = join(backend, _budgets(budgets), pipeline_restarts, pipeline_error,
                          max_context=_pipeline_context(load_settings().max_context))
            if engine is None:
                # a following rank, sent home by rank 0 (or left by it), ends as rank 0 does:
                # without the garbage collection of its layers, which takes seconds
                from ..engine import worker

                worker.end_process(0)
        except (RankLost, ValueError) as e:
            raise MlxStreamError(str(e)) from None

    # a pipeline holds one model at a time (max_models 1): one pinned there would refuse every other
    keeper = _keeper(supervisor)
    server = Server(host=host, port=port, model=models[0] if models else None, pinned=() if pipeline_rank else models,
                    max_models=1 if pipeline_rank else max_models, api_key=api_key, max_queue=max_queue,
                    hosts=list(hosts) if hosts else None, origins=list(origins) if origins else None,
                    keeper=keeper, strict=strict, aliases=_aliases(aliases), any_model=any_model,
                    sigterm_handled=engine.ended_elsewhere if engine is not None else None, say=_say,
                    live=sys.stderr.isatty())
    if engine is not None:
        from ..distributed.launch import leave_when_broken, stop_when_orphaned

        leave_when_broken(engine, server.busy, server.forget)
        stop_when_orphaned()
    click.echo(f"mlx-stream: serving on {server.url} (Ctrl-C stops)", err=True)
    _log_requests(quiet)
    # uvicorn shuts down on SIGINT and SIGTERM, then re-raises the signal to the handler
    # it found: let SIGTERM end like Ctrl-C, so `kill` removes the discovery file too
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        server.serve()
    except KeyboardInterrupt:
        pass
    click.echo("mlx-stream: server stopped", err=True)
    from ..engine import worker
    from ..engine.manager import get_manager

    # stopped on purpose: status 0, within seconds (docs/server.md); a pipeline's rank 0
    # sends the others home once its engine rests, or ends without a word (they leave)
    worker.end_process(0, last=get_manager().shutdown if pipeline_rank else None)


def _say(text: str, end: str = "\n") -> None:
    """The server's words on stderr (server/banner.py): a load's progress starts with a
    carriage return and ends without a newline, to be rewritten."""
    back = text.startswith("\r")
    text = text.removeprefix("\r")
    if text and not text.startswith("  "):
        text = "mlx-stream: " + text
    click.echo(("\r" if back else "") + text + end, err=True, nl=False)


def _log_requests(quiet: bool) -> None:
    """One line per request on stderr (server/request_log.py), unless `quiet`."""
    import logging

    from ..server.request_log import log

    if quiet:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("mlx-stream: %(asctime)s %(message)s", "%H:%M:%S"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)


def _supervise(ctx, pipeline, hostfile, backend, ring_port) -> None:
    """Run this command on every host through mlx.launch, each as one rank, and start
    them again when the pipeline fails (server/process/supervisor.py)."""
    from ..errors import MlxStreamError
    from ..server.process.run import check_exposure
    from ..server.process.supervisor import Supervisor

    check_exposure(ctx.params["host"], ctx.params["api_key"])
    passed = []
    sizes = _budgets(ctx.params["budgets"])  # a bad one is refused before any rank starts
    if sizes and pipeline and len(sizes) != len(pipeline.split(",")):
        raise MlxStreamError(f"--budgets gives {len(sizes)} sizes for {len(pipeline.split(','))} hosts")
    for name in ("host", "api_key", "max_queue", "budgets"):  # the supervisor adds the port
        value = ctx.params[name]
        if value is not None:
            passed += [f"--{name.replace('_', '-')}", str(value)]
    for flag, values in (("--allow-host", ctx.params["hosts"]), ("--allow-origin", ctx.params["origins"]),
                         ("--model", ctx.params["models"])):
        for value in values:
            passed += [flag, value]
    for alias in ctx.params["aliases"]:
        passed += ["--model-alias", alias]
    for flag in ("strict", "any_model", "quiet"):
        if ctx.params[flag]:
            passed.append(f"--{flag.replace('_', '-')}")
    hosts = pipeline.split(",") if pipeline else None
    Supervisor([*passed, "--backend", backend, "--pipeline-rank"], hosts=hosts, hostfile=hostfile,
               backend=backend, ring_port=ring_port, host=ctx.params["host"], port=ctx.params["port"],
               api_key=ctx.params["api_key"], restarts=ctx.params["restarts"]).run()


def _refuse_pipeline_options(ctx) -> None:
    """A pipeline's options on a one-machine server would do nothing: say so."""
    from click.core import ParameterSource

    given = [f"--{name.replace('_', '-')}" for name in ("backend", "budgets", "ring_port", "restarts")
             if ctx.get_parameter_source(name) not in (ParameterSource.DEFAULT, None)]
    if given:
        raise click.UsageError(f"{', '.join(given)} only apply with --hosts or --hostfile")


def _keeper(supervisor: str | None) -> int | None:
    """The supervisor's pid when it runs on this machine (it keeps the discovery file)."""
    import socket

    host, _, pid = (supervisor or "").rpartition(":")
    return int(pid) if host == socket.gethostname() and pid.isdigit() else None


def _budgets(budgets: str | None) -> list[int] | None:
    from ..errors import MlxStreamError
    from ..sizes import given_size

    try:
        return [given_size(b.strip()) for b in budgets.split(",")] if budgets else None
    except ValueError as e:
        raise MlxStreamError(f"--budgets {budgets}: {e}") from None


def _aliases(pairs) -> dict[str, str]:
    out = {}
    for pair in pairs:
        name, sep, target = pair.partition("=")
        if not sep or not name or not target:
            raise click.BadParameter(f"{pair!r}: give NAME=MODEL", param_hint="--model-alias")
        out[name] = target
    return out


def _pipeline_context(setting) -> int | None:
    """The context a pipeline's ranks plan for: the setting, or (auto) the planner's default,
    since the ranks plan before they know the model."""
    return setting if isinstance(setting, int) else None


def _interrupt(signum, frame):
    raise KeyboardInterrupt
