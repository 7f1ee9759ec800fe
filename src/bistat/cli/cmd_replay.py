"""``bistat replay RUN_DIR --prompt ID`` (probes + repro pack) and ``bistat reproduce PACK``.

Thin commands over :func:`bistat.explain.replay.replay_prompt` and :func:`bistat.explain.replay.reproduce_pack`.
``replay`` exits 0 once the pack is written; ``reproduce`` exits 0 when every condition of the
pack reproduced bit for bit, 1 when one did not (a failed check) or the pack cannot be read.
"""

from __future__ import annotations

from pathlib import Path

import click

from bistat.cli.exitcodes import ERROR
from bistat.store.format import RecordsError

__all__ = ["register"]


def register(group: click.Group) -> None:
    """Add ``replay`` and ``reproduce`` to the ``bistat`` group."""
    from bistat.engines.base import EngineError

    @group.command("replay")
    @click.argument("run_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
    @click.option("--prompt", "prompt_id", required=True, help="The prompt id to replay.")
    @click.option("--arm", default=None,
                  help="The arm [default: the arm in which the prompt diverged, else the control].")
    @click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path),
                  default=None, help="Repro pack folder [default: repro/RUN_ID/PROMPT-ARM].")
    @click.option("--max-fillers", type=click.IntRange(min=1), default=128, show_default=True,
                  help="Largest batch of co-batched fillers (sweep 1, 2, 4, ...).")
    @click.option("--top-k", type=click.IntRange(min=1), default=None,
                  help="Logprobs per position [default: workload.top_logprobs, else 5].")
    @click.option("--json", "as_json", is_flag=True, help="Print the probes as JSON.")
    def replay(run_dir: Path, prompt_id: str, arm: str | None, out_dir: Path | None,
               max_fillers: int, top_k: int | None, as_json: bool) -> None:
        """Re-run one prompt of RUN_DIR alone, in a batch-size sweep, prefill vs decode and
        prefix cache cold vs warm, and write a repro pack with the commands to reproduce it."""
        from bistat.explain.replay import ReplayError, replay_prompt

        try:
            rep = replay_prompt(run_dir, prompt_id, arm=arm, out_dir=out_dir,
                                max_fillers=max_fillers, top_k=top_k)
        except (ReplayError, RecordsError, EngineError, ValueError) as exc:
            raise click.ClickException(str(exc)) from exc
        if as_json:
            click.echo((rep.pack_dir / "probes.json").read_text(encoding="utf-8"), nl=False)
        else:
            click.echo("\n".join(rep.summary_lines()))

    @group.command("reproduce")
    @click.argument("pack_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
    def reproduce(pack_dir: Path) -> None:
        """Re-run the conditions of the repro pack PACK_DIR and check the outputs bit for bit."""
        from bistat.explain.replay import ReplayError, reproduce_pack

        try:
            res = reproduce_pack(pack_dir)
        except (ReplayError, EngineError, ValueError) as exc:
            raise click.ClickException(str(exc)) from exc
        click.echo("\n".join(res.summary_lines()))
        if not res.reproduced:
            raise SystemExit(ERROR)
