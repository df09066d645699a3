"""`llm mlxs launch claude|codex [MODEL] [-- ARGS]`: a coding agent on this llm user
dir's server, started for it when none runs (docs/server.md, "Coding agents")."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess

import click

from ..errors import MlxStreamError
from ..options import registry
from ..options.settings import load_settings
from .background import serve
from .coding_agents import AGENTS
from .group import mlxs

PASSED = "mlxs.launch.args"


class _PassThrough(click.Command):
    """What follows `--` is the agent's, untouched (click would read its first word as MODEL)."""

    def parse_args(self, ctx, args):
        if "--" in args:
            at = args.index("--")
            args, ctx.meta[PASSED] = args[:at], args[at + 1:]
        return super().parse_args(ctx, args)

    def collect_usage_pieces(self, ctx):
        return [*super().collect_usage_pieces(ctx), "[-- ARGS]..."]


@mlxs.command(cls=_PassThrough, short_help="Run Claude Code or Codex on a model served here.")
@click.argument("agent", type=click.Choice(sorted(AGENTS)))
@click.argument("model", required=False)
@click.option("--wait", default=900, show_default=True, type=click.IntRange(1),
              help="Seconds the model may take to load before launch gives up")
@click.option("--small-model", metavar="NAME",
              help="Claude Code: a second model, loaded beside MODEL, for its fast tier and subagents "
              "(ANTHROPIC_DEFAULT_HAIKU_MODEL)")
@click.pass_context
def launch(ctx, agent, model, wait, small_model):
    """Run Claude Code (claude) or Codex (codex) on MODEL, served by `llm mlxs serve`.

    Uses the server running for this llm user dir, or starts one for MODEL (the default
    model if none is given) and stops it when the agent exits. The agent gets the
    server's address, key and model (Codex through a CODEX_HOME of ours); ARGS after --
    go to it. The exit status is the agent's.

    \b
        llm mlxs launch claude mlx-stream/qwen3
        llm mlxs launch codex -- exec "Explain this repository"
    """
    spec = AGENTS[agent]
    command = shutil.which(spec.command)
    if command is None:
        raise MlxStreamError(f"{spec.command} is not on PATH; install it with: npm install -g {spec.package}")
    served = serve(model, wait, small_model)
    try:
        env = spec.environment(dict(os.environ), served, _context(served.model_id))
        status = _foreground([command, *ctx.meta.get(PASSED, [])], env)
    finally:
        served.close()
    ctx.exit(status)


def _context(model_id: str) -> int:
    """The context the server runs `model_id` with (max_context, planned: auto resolved)."""
    from ..options.run_config import configure
    from ..options.settings import Options

    return configure(registry.name_of(model_id), Options(), load_settings()).max_context


def _foreground(argv: list[str], env: dict) -> int:
    """Run the agent in this terminal until it exits; its status (128 + N for signal N).
    Ctrl-C is the agent's to handle: launch waits through it; a SIGTERM or SIGHUP sent to
    launch goes on to the agent."""
    proc = None

    def forward(signum, frame):
        if proc is not None and signum != signal.SIGINT:
            proc.send_signal(signum)

    # a Python handler, not SIG_IGN: the agent starts with the default one
    handled = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        proc = subprocess.Popen(argv, env=env)
        status = proc.wait()
    except OSError as e:
        raise MlxStreamError(f"Cannot run {argv[0]}: {e.strerror or e}") from None
    finally:
        for s, previous in handled.items():
            signal.signal(s, previous)
    return 128 - status if status < 0 else status
