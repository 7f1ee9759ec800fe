"""``bistat serve``: the embedded engine behind an OpenAI-compatible HTTP server."""

from __future__ import annotations

import click

LOOPBACK = ("127.0.0.1", "localhost", "::1")


@click.command("serve")
@click.option("--model", "model_name", default="smollm2-135m", show_default=True,
              help="Model to serve (fetched with `bistat model fetch`).")
@click.option("--gemm", type=click.Choice(["blas", "invariant"]), default="blas",
              show_default=True, help="GEMM mode: numpy's BLAS, or batch-invariant reductions.")
@click.option("--max-batch-size", type=click.IntRange(min=1), default=32, show_default=True,
              help="Most requests decoded together in one engine step.")
@click.option("--max-model-len", type=click.IntRange(min=2), default=2048, show_default=True,
              help="Most tokens (prompt + output) per request.")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind; anything but loopback exposes the server to the network.")
@click.option("--port", type=click.IntRange(min=0, max=65535), default=8000, show_default=True,
              help="TCP port; 0 picks a free one (the port bound is printed).")
@click.option("--max-body-bytes", type=click.IntRange(min=1), default=8 * 2**20, show_default=True,
              help="Largest request body in bytes; a longer one is answered 413.")
@click.option("--max-prompts-per-request", type=click.IntRange(min=1), default=256,
              show_default=True, help="Most prompts in one /v1/completions request; more is 413.")
@click.option("--max-queued-prompts", type=click.IntRange(min=1), default=1024, show_default=True,
              help="Most prompts in flight (waiting or generating) over all requests; a request "
                   "that would exceed it is answered 429 with Retry-After and nothing is queued "
                   "(413 when it alone holds more prompts: it could never fit).")
@click.option("--shutdown-timeout", "shutdown_timeout_s", type=click.FloatRange(min=0),
              default=2.0, show_default=True,
              help="Seconds in-flight requests may finish after SIGTERM/SIGINT before they are "
                   "cancelled.")
@click.option("--log-level", type=click.Choice(["critical", "error", "warning", "info", "debug"]),
              default="warning", show_default=True, help="uvicorn's log level.")
def serve_command(model_name: str, gemm: str, max_batch_size: int, max_model_len: int, host: str,
                  port: int, max_body_bytes: int, max_prompts_per_request: int,
                  max_queued_prompts: int, shutdown_timeout_s: float, log_level: str) -> None:
    """Serve the embedded engine over an OpenAI-compatible API (/v1/completions,
    /v1/chat/completions, /v1/models, /health, /metrics with vLLM's metric names).

    A client that disconnects has its requests cancelled in the engine. SIGTERM stops the
    server within --shutdown-timeout seconds plus one engine step, exit status 0."""
    from bistat.engines.embedded.engine import EmbeddedEngine
    from bistat.model import load_model
    from bistat.model.errors import ModelError
    from bistat.engines.serve.server import Limits, bind, create_app, serve, url_of

    try:
        model = load_model(model_name)
    except ModelError as exc:
        raise click.ClickException(
f"cannot load model {model_name!r}: {exc}") from exc
    engine = EmbeddedEngine(model, gemm=gemm, max_batch_size=max_batch_size,
                            max_model_len=max_model_len)
    app = create_app(engine, model.tokenizer, model_name=model_name, max_model_len=max_model_len,
                     vocab_size=int(model.config.vocab_size),
                     engine_description={"engine": "embedded", "gemm": gemm,
                                         "max_batch_size": max_batch_size},
                     limits=Limits(max_body_bytes=max_body_bytes,
                                   max_prompts_per_request=max_prompts_per_request,
                                   max_queued_prompts=max_queued_prompts))
    if host not in LOOPBACK:
        click.echo(f"Warning: binding {host}: the server is reachable from the network.", err=True)

    def bound(actual_port: int) -> None:
        click.echo(f"bistat serve: {model_name} (gemm={gemm}, max batch {max_batch_size}) on "
                   f"{url_of(host, actual_port)}/v1", err=True)

    try:
        sock = bind(host, port)
    except OSError as exc:
        raise click.ClickException(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    serve(app, sock=sock, log_level=log_level, shutdown_timeout_s=shutdown_timeout_s,
          on_bound=bound)


def register(group: click.Group) -> None:
    group.add_command(serve_command)
