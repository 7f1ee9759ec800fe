"""The needle a recorded run chooses for the probe: the prompt whose outputs first diverged earliest.

``bistat probe --needle-from RUN_DIR`` aims the probe (:mod:`bistat.run.probe`) at what a study
saw: a needle that happens to be insensitive misses it. The choice is read from the run's
divergence anatomy (:mod:`bistat.analysis.anatomy`), bitwise as the probe compares, and is kept in
the probe's report as its ``needle_source``
(:class:`~bistat.run.probe_records.NeedleSource`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from bistat.analysis.anatomy import divergence_anatomy
from bistat.run.probe_records import NeedleSource
from bistat.run.workload import Prompt, load_prompts, prompts_sha256
from bistat.store.run_dir import RecordedRun

if TYPE_CHECKING:  # pragma: no cover
    from bistat.declare.experiment import Experiment

__all__ = ["NEEDLE_UNIT", "NeedleError", "needle_from_run"]


class NeedleError(ValueError):
    """A recorded run cannot choose the needle (:func:`needle_from_run`)."""


#: How a recorded run's outputs are compared to choose the needle: bitwise, as the probe compares
#: (token ids, then chosen-token logprobs as float64 bits), whatever the run's match unit.
NEEDLE_UNIT = "token_ids+logprobs"


def _workload_words(workload: Mapping[str, Any] | None) -> dict[str, Any]:
    if not isinstance(workload, Mapping):
        return {}
    return {k: workload.get(k) for k in ("source", "n_prompts", "seed")}


def _check_same_prompts(run: RecordedRun, prompts: Sequence[Prompt], experiment: "Experiment",
                        declaration: str) -> None:
    """Refuse a run recorded with other prompts than ``experiment``'s workload: a prompt index
    would name another prompt in each. ``run.json``'s ``workload_sha256`` decides; a run
    recorded before it was kept is checked by the prompt ids its responses recorded per index."""
    from bistat.store.format import HEADER_FILE
    from bistat.declare.run_registration import run_declaration

    header = run.header
    run_json = run.path / HEADER_FILE
    fix = ("choose the needle from a run of this declaration's workload, or give the needle's "
           "index with --needle INDEX")
    recorded = header.get("workload_sha256")
    if recorded is not None:
        mine = prompts_sha256(prompts)
        if recorded == mine:
            return
        theirs = _workload_words((run_declaration(run) or {}).get("workload"))
        ours = _workload_words(experiment.workload.model_dump())
        what = "; ".join(f"workload.{k} {theirs[k]!r} in the run, {ours[k]!r} in {declaration}"
                         for k in ours if theirs.get(k) is not None and theirs[k] != ours[k])
        if not what:
            what = ("the prompts themselves differ (a prompt file changed?)" if theirs else
                    "the run's registration cannot be read to say which field differs")
        raise NeedleError(
            f"{run_json}: the run was recorded with other prompts than {declaration}'s workload "
            f"({what}; workload_sha256 {str(recorded)[:12]}… in the run, {mine[:12]}… for "
            f"{declaration}): a prompt index names another prompt in each; {fix}")
    frame = run.table("responses", ["prompt_id", "prompt_index"])
    seen: dict[int, str] = {}
    for pid, i in zip(frame["prompt_id"], frame["prompt_index"], strict=True):
        try:
            seen[int(i)] = str(pid)
        except (TypeError, ValueError):   # not recorded (None, NaN)
            continue
    for i, pid in sorted(seen.items()):
        here = prompts[i].prompt_id if i < len(prompts) else None
        if here != pid:
            where = (f"prompt {i} is {here!r} in {declaration}" if here is not None else
                     f"{declaration}'s workload holds {len(prompts)} prompt(s)")
            raise NeedleError(
                f"{run.path}: the run was recorded with other prompts than {declaration}'s "
                f"workload (its responses record prompt {i} as {pid!r}, but {where}; {run_json} has no "
                f"workload_sha256 to compare): a prompt index names another prompt in each; {fix}")


def needle_from_run(run_dir: str | Path | RecordedRun, experiment: "Experiment", *,
                    declaration: str = "the declaration", base_dir: Path | None = None
                    ) -> NeedleSource:
    """The needle a recorded run of the same workload suggests: the prompt that diverged first.

    Every counted pass of every arm is compared with the arm's reference pass (its first counted
    pass), as the divergence anatomy does (:func:`bistat.analysis.anatomy.divergence_anatomy`), bitwise
    as the probe compares (:data:`NEEDLE_UNIT`). The needle is the prompt whose earliest first
    divergence, over all arms and passes, has the smallest token index; ties go to the lowest
    prompt index (then the arm, then the pass, in order, say where).

    Parameters
    ----------
    run_dir : path or RecordedRun
        The recorded run.
    experiment : Experiment
        The probe's declaration; its workload must hold the prompts the run was recorded with.
    declaration : str
        How errors name the declaration (its file).
    base_dir : path, optional
        Where a relative ``file:`` prompt source is resolved (default: the current directory).

    Returns
    -------
    NeedleSource
        Its ``prompt_index`` is the probe's ``ProbeSettings.needle_index``.

    Raises
    ------
    NeedleError
        The run was recorded with other prompts, or no prompt diverged in it.
    bistat.store.format.RecordsError
        The run directory cannot be read.
    """
    run = RecordedRun.of(run_dir)
    run_dir = run.path
    wl = experiment.workload
    prompts = load_prompts(wl.source, wl.n_prompts, wl.seed, base_dir=base_dir)
    _check_same_prompts(run, prompts, experiment, declaration)
    anatomy = divergence_anatomy(run, unit=NEEDLE_UNIT)
    index = {p.prompt_id: p.index for p in prompts}
    found = [d for d in anatomy.divergences if d.prompt_id in index]
    if not found:
        compared = ", ".join(f"{a.arm} {a.n_prompts}" for a in anatomy.arms) or "none"
        raise NeedleError(
            f"{run_dir}: no prompt diverged in the run (prompts compared across the counted passes "
            f"per arm, bitwise: {compared}), so it cannot choose the needle; give the needle's "
            "index with --needle INDEX instead")
    first = min(found, key=lambda d: (d.position, index[d.prompt_id], d.arm, d.other.pass_index))
    return NeedleSource(
        run=str(run_dir), run_id=anatomy.run_id, prompt_id=first.prompt_id,
        prompt_index=index[first.prompt_id], arm=first.arm, pass_index=first.other.pass_index,
        reference_pass=first.reference.pass_index, position=first.position, kind=first.kind,
        n_prompts_diverged=len({d.prompt_id for d in found}))
