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
              help="TCP port.")
@click.option("--log-level", type=click.Choice(["critical", "error", "warning", "info", "debug"]),
              default="warning", show_default=True, help="uvicorn's log level.")
def serve_command(model_name: str, gemm: str, max_batch_size: int, max_model_len: int, host: str,
                  port: int, log_level: str) -> None:
    """Serve the embedded engine over an OpenAI-compatible API (/v1/completions,
    /v1/chat/completions, /v1/models, /health, /metrics with vLLM's metric names)."""
    from bistat.engines.embedded.engine import EmbeddedEngine
    from bistat.model import load_model
    from bistat.model.errors import ModelError
    from bistat.engines.serve.server import create_app, serve

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
                                         "max_batch_size": max_batch_size})
    if host not in LOOPBACK:
        click.echo(f"Warning: binding {host}: the server is reachable from the network.", err=True)
    click.echo(f"bistat serve: {model_name} (gemm={gemm}, max batch {max_batch_size}) on "
               f"http://{host}:{port}/v1", err=True)
    serve(app, host=host, port=port, log_level=log_level)


def register(group: click.Group) -> None:
    group.add_command(serve_command)
