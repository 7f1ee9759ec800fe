"""``bistat synth-model``: a Hugging Face folder with random weights of a real architecture.

Thin command over :func:`bistat.model.synth.write_synthetic_model`. Library errors reach the user
as ``Error: <message>`` with exit code 1.
"""

from __future__ import annotations

import click

from bistat.model.synth import ARCHITECTURES, SynthModelError, write_synthetic_model


@click.command("synth-model")
@click.option("--arch", required=True, metavar="ARCH",
              help="Architecture whose published configuration is written: "
                   + " | ".join(sorted(ARCHITECTURES)) + ".")
@click.option("--layers", required=True, type=click.IntRange(min=1),
              help="Number of hidden layers (num_hidden_layers).")
@click.option("--init", "init", default="normal", show_default=True, type=click.Choice(["normal"]),
              help="Weight distribution of linear and embedding weights (norm weights are 1.0).")
@click.option("--std", default=0.02, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="Standard deviation of the normal weights.")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(min=0),
              help="Base seed; each tensor's generator is seeded from (seed, tensor index).")
@click.option("--backend", default="auto", show_default=True,
              type=click.Choice(["auto", "torch", "numpy"]),
              help="auto: torch on a CUDA GPU when there is one, else numpy on the CPU.")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False),
              help="Folder to write (config.json, generation_config.json, model.safetensors, "
                   "bistat-synth.json).")
@click.option("--overwrite", is_flag=True, help="Replace the files of an existing folder.")
@click.option("--config-only", is_flag=True,
              help="Write only config.json and generation_config.json (for load_format dummy).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def synth_model(arch: str, layers: int, init: str, std: float, seed: int, backend: str,
                out_dir: str, overwrite: bool, config_only: bool, as_json: bool) -> None:
    """Write a model folder with N(0, STD) weights in bf16 for ARCH with LAYERS layers.

    Serve it with vLLM's skip_tokenizer_init and token-id prompts (no tokenizer is written).
    """
    try:
        result = write_synthetic_model(
            out_dir, arch=arch, layers=layers, init=init, std=std, seed=seed,
            backend=backend, overwrite=overwrite, config_only=config_only,  # type: ignore[arg-type]
            progress=None if as_json else (lambda line: click.echo(line, err=True)))
    except SynthModelError as exc:
        raise click.ClickException(str(exc)) from exc
    if as_json:
        import json

        click.echo(json.dumps({
            "out_dir": str(result.out_dir), "arch": result.arch, "layers": result.layers,
            "backend": result.backend, "device": result.device,
            "n_parameters": result.n_parameters, "bytes": result.n_bytes,
            "sha256": result.sha256, "files": list(result.files)}, indent=2))
        return
    click.echo(f"{result.out_dir}: {result.arch}, {result.layers} layers, "
               f"{result.n_parameters:,} parameters, {result.backend} on {result.device}")
    click.echo(f"model.safetensors sha256 {result.sha256}")


def register(group: click.Group) -> None:
    """Add ``synth-model`` to the ``bistat`` group."""
    group.add_command(synth_model)
