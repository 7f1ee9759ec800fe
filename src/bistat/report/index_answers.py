"""The index's answers: does batch invariance hold, what does it cost, and what does one set?

One table per engine release and GPU, one row per model, head size, attention backend, setting and
workload (:class:`Answer`), under the newest confirmatory rule registered for each run
(:func:`answers`, :func:`render_answers`). The numbers are the findings' Summary rows; the setting
(:func:`arm_setting`), the workload (:func:`workload_words`) and the model's weights come from the
run's sealed registration, and the model's name and head size from :data:`MODELS`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from bistat.analysis.activation import MODE_SWITCHES, arm_setting  # noqa: F401 - read here too
from bistat.core.markdown import md_row
from bistat.report.index_findings import IndexedFinding, SummaryRow
from bistat.report.index_releases import NewestRelease, _table_order, release_words

if TYPE_CHECKING:
    from bistat.declare.experiment import Experiment
    from bistat.declare.registration import Registration


@dataclass(frozen=True)
class ModelName:
    """How the index names a model the studies served: its name, its attention head size, its
    depth where it is not the published model's, and its weights where its folder holds weights
    of its own that are not the published ones."""

    name: str
    head_size: int
    layers: int | None = None
    weights: str | None = None


#: The models bistat's studies served, keyed by the last component of the engine's ``model``
#: argument as their registrations give it. The runs record only that argument, a folder the
#: device scripts write (``/tmp/model/qwen3-8b-config``), which tells a reader nothing; what each
#: folder holds is fixed by the command that writes it: scripts/device/install.sh
#: (``bistat model export smollm2-135m``: the published SmolLM2-135M-Instruct) and
#: scripts/device/prepare.sh (``bistat synth-model --arch qwen3-8b --layers 8 --std 0.02 --seed 0``;
#: ``--arch qwen3-8b --layers 36 --config-only``; ``--arch qwen3-1.7b --layers 28 --config-only``,
#: configurations without weights, which a study serves with ``load_format = "dummy"``, as its
#: registration states: :func:`model_words` reads it there). ``smollm2-135m`` is the embedded
#: engine's name for SmolLM2. The head sizes agree with src/bistat/data/attention_remedies.toml
#: (tests/test_findings_index.py checks it).
MODELS: dict[str, ModelName] = {
    "smollm2": ModelName("SmolLM2-135M-Instruct", 64),
    "smollm2-135m": ModelName("SmolLM2-135M-Instruct", 64),
    "qwen3-8b-synth-l8": ModelName("Qwen3-8B shape", 128, 8, "N(0, 0.02)"),
    "qwen3-8b-config": ModelName("Qwen3-8B shape", 128, 36),
    "qwen3-1.7b-config": ModelName("Qwen3-1.7B shape", 128, 28),
}


def model_words(model: str, engine_args: Mapping[str, Any]) -> tuple[str, int | None]:
    """The model's name as the index shows it, ``Qwen3-8B shape (36 layers, dummy weights)``,
    and its head size (None: not in :data:`MODELS`, then the folder's own name stands in for the
    name, never the whole path)."""
    folder = PurePosixPath(model.rstrip("/")).name or model
    m = MODELS.get(folder)
    if m is None:
        return f"`{folder}`", None
    weights = "dummy weights" if engine_args.get("load_format") == "dummy" else m.weights
    detail = ", ".join(x for x in (m.layers and f"{m.layers} layers", weights) if x)
    return (f"{m.name} ({detail})" if detail else m.name), m.head_size


def workload_words(exp: Experiment) -> str:
    """The load in a few words: ``541 prompts, 64 at a time, ≤ 256 tokens`` or ``one batch of
    8, 128 tokens`` (exact when EOS is ignored)."""
    w = exp.workload
    if w.ignore_eos:
        tokens = f"{w.max_tokens_min}–{w.max_tokens}" if w.max_tokens_min else f"{w.max_tokens}"
    else:
        tokens = f"≤ {w.max_tokens}"
    if w.concurrency >= w.n_prompts:
        return f"one batch of {w.n_prompts}, {tokens} tokens"
    return f"{w.n_prompts} prompts, {w.concurrency} at a time, {tokens} tokens"


@dataclass(frozen=True)
class Answer:
    """One row of the answers: an arm of a run, under the newest confirmatory rule registered
    for the run, as its finding's Summary gives it."""

    engine: str             # "vLLM 0.33.0"
    gpu: str
    model: str              # :func:`model_words`
    head_size: int | None
    backend: str            # the attention backend(s) its engine log named; "—" if none
    setting: tuple[str, ...]
    mode_on: bool           # the setting switches a batch-invariant mode on
    workload: str
    under_load: bool        # more prompts than run at once: batches change while one decodes
    load: tuple[int, int, int]   # concurrency, prompts, tokens: the order of workloads
    row: SummaryRow
    finding: IndexedFinding

    @property
    def compared(self) -> int:
        """Prompts compared (the second number of ``matched / compared``; 0 when none)."""
        m = re.fullmatch(r"\s*\d+\s*/\s*(\d+)\s*", self.row.matched)
        return int(m[1]) if m else 0

    def key(self) -> tuple:
        return (self.engine, self.gpu, self.model, self.head_size, self.backend, self.setting,
                self.workload)


def probe_words(a: Answer) -> str:
    """``; probe: confirmed`` where a behavioural probe with its negative control ran on the
    answer's arm (what its finding's Activation table says), nothing where none ran."""
    found = dict(a.finding.probes).get(a.row.treatment)
    return "" if found in (None, "", "—", "not run") else f"; probe: {found}"


def findings_per_run(findings: Sequence[IndexedFinding], registrations: Mapping[str, Registration]
                     ) -> dict[str, tuple[IndexedFinding, Registration]]:
    """Run -> the finding of the newest confirmatory rule registered for it, with that
    registration (a finding whose registration is not in ``registrations`` is left out)."""
    by_run: dict[str, list[tuple[IndexedFinding, Registration]]] = {}
    for f in findings:
        if f.summary is None or f.summary.analysis != "confirmatory":
            continue
        reg = registrations.get(f.name)
        if reg is not None:
            by_run.setdefault(f.summary.run, []).append((f, reg))
    return {run: max(c, key=lambda x: (x[1].registered_utc, x[0].name))
            for run, c in by_run.items()}


def answers(findings: Sequence[IndexedFinding], registrations: Mapping[str, Registration]
            ) -> list[Answer]:
    """The answers' rows: for each run, the finding of the newest confirmatory rule registered
    for it (a finding whose registration is not in ``registrations`` is left out: a worked
    example's, say), one row per comparison of its Summary; where two runs give the same row
    (engine, GPU, model, head size, attention backend, setting, workload), the newer run's."""
    best: dict[tuple, tuple[str, Answer]] = {}
    for _, (f, reg) in sorted(findings_per_run(findings, registrations).items()):
        sm, exp = f.summary, reg.experiment()
        model, head = model_words(exp.engine.model, exp.engine.args)
        load = (exp.workload.concurrency, exp.workload.n_prompts, exp.workload.max_tokens)
        declared = {a.name for a in exp.arms}
        for r in sm.rows:
            if r.treatment not in declared:
                raise ValueError(f"{f.path}: arm {r.treatment!r} of its Summary is not declared "
                                 f"in {reg.path}; regenerate the finding with `bistat analyze` "
                                 "against that registration")
            parts = r.backend.split(", ")[1:]
            backend = ", ".join(p for p in parts if not p.startswith("gemm ")) or "—"
            setting, on = arm_setting(exp, r.treatment)
            a = Answer(sm.engine, sm.gpu, model, head, backend, setting, on, workload_words(exp),
                       exp.workload.n_prompts > exp.workload.concurrency, load, r, f)
            created = f.run_created or ""
            if a.key() not in best or best[a.key()][0] < created:
                best[a.key()] = (created, a)
    return [a for _, a in best.values()]


def _ratio_cell(r: SummaryRow) -> str:
    return "—" if r.ratio == "—" else f"{r.ratio} {r.cost_interval}"


def _setting_cell(a: Answer) -> str:
    return " + ".join(f"`{s}`" for s in a.setting) or "— (as the control)"


def render_answers(rows: Sequence[Answer], base: Path, newest: Mapping[str, NewestRelease],
                   registrations_dir: str) -> list[str]:
    """The answers as markdown: one table per engine release and GPU, newest release first."""
    lines = ["## Answers", "",
             "Does batch invariance hold, what does it cost, and what does one set? One table per "
             "engine release and GPU, newest release first; one row per model, head size, "
             "attention backend, setting and workload, from the finding of the newest "
             "confirmatory rule registered for its run (where two runs give the same row, the "
             "newer run's; the older stays in the listing below). *setting*: what the arm sets "
             "beyond its control, as one sets it (environment variables; engine arguments as "
             "command-line flags), with the batch-invariant switch named whenever it is on. "
             "*attention*: the backend the engine's log named. *invariant?*: the rule's verdict, "
             "and the prompts identical in every counted pass of those compared. *cost*: the "
             "cost rule's verdict and the ratio treatment ÷ control with its 95 % interval "
             "(throughput: below 1 is slower; latency: above 1 is slower; a rule without a cost "
             "rule: the throughput ratio). Exploratory analyses and findings whose registration "
             f"is not in `{registrations_dir}` (a worked example's) are only in the listing "
             "below.", ""]
    groups: dict[tuple[str, str], list[Answer]] = {}
    for a in rows:
        groups.setdefault((a.engine, a.gpu), []).append(a)
    for engine, gpu in sorted(groups, key=lambda g: _table_order(*g)):
        lines += [f"### {engine} on {gpu}", ""]
        said = release_words(engine, newest)
        if said:
            lines += [said, ""]
        lines += ["| model | head size | attention | setting | workload | invariant? | "
                  "matched / compared | cost | ratio [95 % interval] | finding |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        order = sorted(groups[(engine, gpu)], key=lambda a: (
            a.model, a.head_size or 0, a.load, a.finding.name,
            a.finding.summary.rows.index(a.row)))
        for a in order:
            rel = a.finding.path.relative_to(base).as_posix()
            lines.append(md_row((a.model, a.head_size, a.backend, _setting_cell(a), a.workload,
                                 a.row.verdict + probe_words(a), a.row.matched, a.row.cost,
                                 _ratio_cell(a.row),
                                 f"[{a.finding.name}]({rel})")))
        lines.append("")
    return lines
