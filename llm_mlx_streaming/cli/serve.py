"""`llm mlxs serve`: keep the engine warm behind the OpenAI, Anthropic and Ollama APIs (docs/server.md)."""

from __future__ import annotations

import signal

import click

from .group import mlxs


@mlxs.command()
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on; anything but loopback needs --api-key")
@click.option("--port", default=8080, show_default=True, type=click.IntRange(0, 65535),
              help="Port (0: any free port)")
@click.option("-m", "--model", "model", help="Model to load at start and answer by default (e.g. mlx-stream/qwen3)")
@click.option("--api-key", help="Bearer token every endpoint but /health requires")
@click.option("--max-queue", default=8, show_default=True, type=click.IntRange(0),
              help="Requests that may wait for the engine; more get 503 with Retry-After")
@click.option("--allow-host", "hosts", multiple=True, metavar="NAME",
              help="A name clients may reach this server by, besides loopback, IP addresses and this "
              "machine's name (repeatable; * any; default: `llm mlxs config server_hosts`)")
@click.option("--allow-origin", "origins", multiple=True, metavar="ORIGIN",
              help="A web origin whose pages may call the API, with CORS (repeatable; * any; "
              "default: `llm mlxs config server_origins`)")
def serve(host, port, model, api_key, max_queue, hosts, origins):
    """Serve the mlx-stream models over HTTP: the OpenAI, Anthropic Messages and Ollama APIs.

    While it runs, `llm -m mlx-stream...`, `llm chat` and `llm -c` in this llm user
    dir send their prompts to it (`llm mlxs config server off` or -o no_server 1: not).
    """
    from ..server.run import Server

    server = Server(host=host, port=port, model=model, api_key=api_key, max_queue=max_queue,
                    hosts=list(hosts) if hosts else None, origins=list(origins) if origins else None)
    click.echo(f"mlx-stream: serving on {server.url} (Ctrl-C stops)", err=True)
    # uvicorn shuts down on SIGINT and SIGTERM, then re-raises the signal to the handler
    # it found: let SIGTERM end like Ctrl-C, so `kill` removes the discovery file too
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        server.serve()
    except KeyboardInterrupt:
        pass
    click.echo("mlx-stream: server stopped", err=True)


def _interrupt(signum, frame):
    raise KeyboardInterrupt
