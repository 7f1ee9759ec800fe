"""The findings index: one table per engine version and GPU answering the user's question.

For each finding's comparisons: the model, the backend, the arm against its control -> is it
batch-invariant (the verdict, prompts matched / compared, the Wilson interval) and what does it
cost (the cost rule's statement, ratio and interval), with the registered rule named in each row
and whether its analysis is *confirmatory* (the rule sealed before the data) or *exploratory*
(sealed after: it describes the data and tests nothing). The rows of one run are adjacent, so a
study's confirmatory verdicts and its exploratory one stand side by side.

The index is generated from the findings themselves -- each finding's ``## Summary`` section
(``bistat.report.finding``), and its ``### TREATMENT (treatment) vs CONTROL (control): **LABEL**``
headings -- so it cannot drift from them, and regenerating it from the same findings gives the
same bytes. A finding written before the Summary section existed is listed by its headings in a
last table. Given the registrations folder it also lists every sealed registration that has no
finding yet, with the reason stated for it in a TOML file (``[not_run]`` table: ``NAME = "why"``),
so that what was not run is said plainly.

Above that listing, given the registrations, the index opens with the answers (:func:`answers`):
one table per engine release and GPU, one row per model, head size, attention backend, setting and
workload, under the newest confirmatory rule registered for each run. The numbers are the
findings' Summary rows; the setting, the workload and the model's weights come from the run's
sealed registration, and the model's name and head size from :data:`MODELS`. The README's results
at a glance (:func:`glance`, :func:`readme_with_glance`) are a selection of those rows, written between
two markers, so the README's numbers are the findings' own.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from packaging.version import InvalidVersion, Version

from bistat.core.markdown import md_row

if TYPE_CHECKING:
    from bistat.declare.experiment import Experiment
    from bistat.declare.prereg import Registration

try:
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib

_VERDICT = re.compile(r"^### (?P<treatment>.+?) \(treatment\) vs (?P<control>.+?) \(control\): "
                      r"\*\*(?P<label>[^*]+)\*\*\s*$")
_TITLE = re.compile(r"^# Finding: (?P<name>.+?)(?: — exploratory analysis.*)?\s*$")
_HYPOTHESIS = re.compile(r"^> (?P<text>.+)$")
_SUMMARY_LINE = re.compile(r"^Engine: (?P<engine>.+?) · GPU: (?P<gpu>.+?) · model: `(?P<model>.*)` · "
                           r"run: `(?P<run>.*)` · rule: `(?P<rule>.*)` \((?P<analysis>confirmatory|"
                           r"exploratory)\)\s*$")
_RUN_CREATED = re.compile(r"^\| Run created \(UTC\) \| (?P<utc>[^|]+?) \|\s*$")
_RUNS = re.compile(r"^\| Runs of its registration \| (?P<n>\d+)\b")


@dataclass(frozen=True)
class SummaryRow:
    """One comparison as a finding's Summary table states it."""

    treatment: str
    control: str
    backend: str
    verdict: str          # as shown, e.g. "*working*"
    matched: str          # "541 / 541"
    interval: str         # the treatment's Wilson interval
    cost: str
    ratio: str
    cost_interval: str


@dataclass(frozen=True)
class FindingSummary:
    """A finding's Summary section: where it ran, under which rule, and its rows."""

    engine: str
    gpu: str
    model: str
    run: str
    rule: str
    analysis: str         # "confirmatory" | "exploratory"
    rows: tuple[SummaryRow, ...]


@dataclass(frozen=True)
class IndexedFinding:
    path: Path
    name: str
    verdicts: tuple[tuple[str, str, str], ...]  # (treatment, control, label)
    hypothesis: str
    summary: FindingSummary | None = None
    run_created: str | None = None    # the header's "Run created (UTC)"
    #: the header's "Runs of its registration" (None in findings written before it existed)
    registration_runs: int | None = None


def _cells(line: str) -> list[str]:
    """A markdown table row's cells (``\\|`` is a literal bar)."""
    inner = line.strip()[1:-1]
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", inner)]


def read_finding(path: Path) -> IndexedFinding:
    """Read a finding's name, verdict headings, the first line of its hypothesis and its
    Summary section (when it has one)."""
    name, hypothesis = path.stem, ""
    verdicts: list[tuple[str, str, str]] = []
    in_hypothesis = in_summary = False
    head: dict[str, str] | None = None
    rows: list[SummaryRow] = []
    run_created = None
    n_runs = None
    for line in path.read_text(encoding="utf-8").splitlines():
        if (m := _TITLE.match(line)) and name == path.stem:
            name = m["name"]
        elif run_created is None and (m := _RUN_CREATED.match(line)):
            run_created = m["utc"]
        elif n_runs is None and (m := _RUNS.match(line)):
            n_runs = int(m["n"])
        elif line.strip() == "## Hypothesis":
            in_hypothesis = True
        elif in_hypothesis and (m := _HYPOTHESIS.match(line)):
            hypothesis, in_hypothesis = m["text"], False
        elif line.strip() == "## Summary":
            in_summary = True
        elif in_summary and line.startswith("## "):
            in_summary = False
        elif in_summary and (m := _SUMMARY_LINE.match(line)):
            head = m.groupdict()
        elif in_summary and line.startswith("| ") and not line.startswith("| treatment |"):
            cells = _cells(line)
            if len(cells) == 9:
                rows.append(SummaryRow(*cells))
        elif m := _VERDICT.match(line):
            verdicts.append((m["treatment"], m["control"], m["label"]))
    if not verdicts:
        raise ValueError(f"{path}: no verdict heading found; is it a finding written by "
                         "`bistat analyze`?")
    summary = None if head is None else FindingSummary(rows=tuple(rows), **head)
    return IndexedFinding(path, name, tuple(verdicts), hypothesis, summary, run_created, n_runs)


@dataclass(frozen=True)
class UnrunRegistration:
    """A sealed registration without a finding, and why (None: no reason stated)."""

    name: str
    path: Path
    registered_utc: str | None
    reason: str | None


def read_reasons(path: str | Path) -> dict[str, str]:
    """The ``[not_run]`` table of a reasons file: registration name -> why it has no finding."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"{path}: not a readable TOML file ({exc})") from None
    table = data.get("not_run")
    if not isinstance(table, dict) or set(data) != {"not_run"}:
        raise ValueError(f"{path}: expected one table [not_run] of NAME = \"reason\" lines, got "
                         f"{', '.join(sorted(data)) or 'nothing'}")
    for name, why in table.items():
        if not isinstance(why, str) or not why.strip():
            raise ValueError(f"{path}: field not_run.{name} must be a non-empty string (why "
                             "registration NAME has no finding)")
    return {str(k): v.strip() for k, v in table.items()}


def load_registrations(registrations_dir: str | Path) -> dict[str, Registration]:
    """Every registration in ``registrations_dir`` by its declared name, each seal checked (a
    broken one is a ``ValueError`` naming the file)."""
    from bistat.declare.prereg import RegistrationError, load_registration

    out = {}
    for path in sorted(Path(registrations_dir).glob("*.json")):
        try:
            reg = load_registration(path)
        except RegistrationError as exc:
            raise ValueError(str(exc)) from None
        out[reg.experiment().name] = reg
    return out


def unrun_registrations(findings: list[IndexedFinding], registrations_dir: str | Path,
                        reasons: dict[str, str], reasons_source: str = "the reasons file",
                        registrations: Mapping[str, Registration] | None = None
                        ) -> list[UnrunRegistration]:
    """Registrations in ``registrations_dir`` (already loaded: ``registrations``) with no finding
    named after them; ``reasons`` must name only such registrations."""
    if registrations is None:
        registrations = load_registrations(registrations_dir)
    have = {f.name for f in findings}
    out, names = [], set()
    for name, reg in registrations.items():
        names.add(name)
        if name in have:
            if name in reasons:
                raise ValueError(f"{reasons_source}: not_run.{name} is stated, but {name} has a "
                                 "finding; remove the line")
            continue
        out.append(UnrunRegistration(name, reg.path, reg.registered_utc, reasons.get(name)))
    unknown = sorted(set(reasons) - names)
    if unknown:
        raise ValueError(f"{reasons_source}: not_run.{unknown[0]} names no registration in "
                         f"{registrations_dir}; fix the name or remove the line")
    return out


# --------------------------------------------------------------------------------------------
# the answers: does it hold, what does it cost, what does one set


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

#: Settings that switch a batch-invariant mode on (environment variable or engine argument, and
#: its value). An arm's setting names them even where its control has them too (a study of two
#: attention backends, both in batch-invariant mode), since without them nothing holds.
MODE_SWITCHES = frozenset({("VLLM_BATCH_INVARIANT", "1"), ("gemm", "invariant"),
                           ("enable_deterministic_inference", "True")})


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


def _flag(key: str, value: Any) -> str:
    """An engine argument as on a command line: ``--attention-backend TRITON_ATTN``."""
    flag = "--" + key.replace("_", "-")
    if isinstance(value, bool):
        return flag if value else "--no-" + key.replace("_", "-")
    return f"{flag} {value}"


def arm_setting(exp: Experiment, arm: str) -> tuple[tuple[str, ...], bool]:
    """What ``arm`` sets, as a user sets it, and whether that switches a batch-invariant mode on.

    The setting is every environment variable and engine argument in which the arm differs from
    the control, plus the mode switches it has on (:data:`MODE_SWITCHES`): the mode switches
    first, then environment variables (``BISTAT_FA3_PIN=1``), then engine arguments as
    command-line flags (``--attention-backend TRITON_ATTN``). Arguments that configure bistat's
    handling of the engine (its log file, timeouts) are not settings.
    """
    from bistat.analysis.activation import HANDLING_KEYS

    arms = {a.name: a for a in exp.arms}
    control = next(a for a in exp.arms if a.role == "control")
    a = arms[arm]
    items = [(k, str(v), f"{k}={v}", 1) for k, v in sorted(a.env.items())
             if control.env.get(k) != v or (k, str(v)) in MODE_SWITCHES]
    items += [(k, str(v), _flag(k, v), 2) for k, v in sorted(a.args.items())
              if k not in HANDLING_KEYS and (control.args.get(k) != v
                                             or (k, str(v)) in MODE_SWITCHES)]
    items.sort(key=lambda i: ((i[0], i[1]) not in MODE_SWITCHES, i[3], i[0]))
    return (tuple(i[2] for i in items),
            any((i[0], i[1]) in MODE_SWITCHES for i in items))


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


def answers(findings: Sequence[IndexedFinding], registrations: Mapping[str, Registration]
            ) -> list[Answer]:
    """The answers' rows: for each run, the finding of the newest confirmatory rule registered
    for it (a finding whose registration is not in ``registrations`` is left out: a worked
    example's, say), one row per comparison of its Summary; where two runs give the same row
    (engine, GPU, model, head size, attention backend, setting, workload), the newer run's."""
    by_run: dict[str, list[tuple[IndexedFinding, Registration]]] = {}
    for f in findings:
        if f.summary is None or f.summary.analysis != "confirmatory":
            continue
        reg = registrations.get(f.name)
        if reg is not None:
            by_run.setdefault(f.summary.run, []).append((f, reg))
    best: dict[tuple, tuple[str, Answer]] = {}
    for run in sorted(by_run):
        f, reg = max(by_run[run], key=lambda c: (c[1].registered_utc, c[0].name))
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


def _engine_release(engine: str) -> tuple[str, Version | None]:
    """``vLLM 0.33.0`` -> ("vLLM", Version("0.33.0")); a version that does not parse -> None."""
    name, _, version = engine.rpartition(" ")
    try:
        return name or engine, Version(version)
    except InvalidVersion:
        return engine, None


def _table_order(engine: str, gpu: str) -> tuple:
    """Tables with a GPU first, then by engine, newest release first."""
    name, version = _engine_release(engine)
    return (gpu == "no GPU", name.lower(), -(version.major if version else 0),
            -(version.minor if version else 0), -(version.micro if version else 0), gpu)


@dataclass(frozen=True)
class NewestRelease:
    """The newest release of an engine's package that the registrations' checks recorded."""

    package: str
    version: str
    checked_utc: str
    index: str
    where: str              # "the registration of NAME" or "`bistat check-release` on NAME"


def newest_releases(registrations: Mapping[str, Registration]) -> dict[str, NewestRelease]:
    """Per package (``vllm``), the newest release found by the latest recorded check: each
    registration's check at registration and its release log (``bistat check-release``)."""
    from bistat.declare.prereg import RegistrationError, release_log_checks

    found: dict[str, NewestRelease] = {}

    def consider(check: Mapping[str, Any], where: str) -> None:
        if not check or not check.get("newest"):
            return
        n = NewestRelease(str(check["package"]), str(check["newest"]), str(check["checked_utc"]),
                          str(check.get("index", "")), where)
        if n.package not in found or found[n.package].checked_utc < n.checked_utc:
            found[n.package] = n

    for name, reg in registrations.items():
        consider(reg.sealed.get("engine_release") or {}, f"the registration of {name}")
        try:
            logged = release_log_checks(reg)
        except RegistrationError as exc:
            raise ValueError(str(exc)) from None
        for c in logged:
            consider(c.check.to_dict(), f"`bistat check-release` on {name}")
    return found


def _behind(engine: str, newest: Mapping[str, NewestRelease]) -> tuple[str, NewestRelease] | None:
    """How far an engine release is from the newest release recorded for its package:
    ("the newest release" | "1 minor version older" | ..., that record); None without one."""
    name, version = _engine_release(engine)
    n = newest.get(name.lower())
    if n is None or version is None:
        return None
    latest = Version(n.version)
    if version == latest:
        return "the newest release", n
    if version > latest:
        return f"newer than {n.version}, the newest release recorded", n
    if version.major != latest.major:
        return f"older than {n.version}", n
    k = latest.minor - version.minor
    return (f"{k} minor version{'s' if k != 1 else ''} older than {n.version}" if k
            else f"a patch release before {n.version}"), n


def _source(n: NewestRelease) -> str:
    host = n.index.split("//")[-1].split("/")[0] or n.index
    return f"{host}, checked {n.checked_utc} at {n.where}"


def release_words(engine: str, newest: Mapping[str, NewestRelease]) -> str | None:
    """One sentence on how far an engine release is from the newest release recorded: ``vLLM
    0.33.0 is 1 minor version older than 0.34.0, the newest release (…).``; None for an engine
    whose package no registration checked (the embedded engine)."""
    behind = _behind(engine, newest)
    if behind is None:
        return None
    gap, n = behind
    if gap == "the newest release":
        return f"{engine} is the newest release ({_source(n)})."
    return f"{engine} is {gap}, the newest release ({_source(n)})."


def releases_sentence(engines: Sequence[str], newest: Mapping[str, NewestRelease]) -> str:
    """Which releases of each engine the rows ran on (in the order given) and how far each is
    from the newest release recorded: ``vLLM rows ran on 0.34.0 (the newest release), 0.33.0 (1
    minor version older) and 0.25.0 (9 minor versions older); …``."""
    by_name: dict[str, list[str]] = {}
    for e in dict.fromkeys(engines):
        by_name.setdefault(_engine_release(e)[0], []).append(e)
    out = []
    for name, releases in by_name.items():
        parts, record = [], None
        for e in releases:
            version = e.rpartition(" ")[2]
            behind = _behind(e, newest)
            if behind is None:
                parts.append(version)
                continue
            gap, record = behind
            parts.append(f"{version} ({gap.replace(f' than {record.version}', '')})")
        listed = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
        if record is not None:
            out.append(f"{name} rows ran on {listed}; the newest release is {record.version} "
                       f"({_source(record)}).")
        elif name == "embedded":
            out.append(f"The embedded engine is bistat's own ({listed}, this checkout).")
        else:
            out.append(f"{name} rows ran on {listed} (no newest-release check recorded).")
    return " ".join(out)


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
                                 a.row.verdict, a.row.matched, a.row.cost, _ratio_cell(a.row),
                                 f"[{a.finding.name}]({rel})")))
        lines.append("")
    return lines


@dataclass(frozen=True)
class IntervalReading:
    """A finding whose rule is another finding's rule of the same run with its cost interval
    replaced (``scripts/hac_declarations.py``: ``interval = "hac"``, applied after the data): the
    rule it varies (``base``, that finding's name) and the two intervals."""

    base: str
    base_interval: str
    interval: str


#: How the index names a cost interval.
INTERVAL_WORDS = {"welch": "Welch", "paired": "paired", "hac": "HAC"}


def _without_interval(rule: Any) -> Any:
    """The rule with its cost interval and the interval's parameters at their defaults."""
    cost = rule.cost.model_copy(update={"interval": "welch", "hac_kernel": None,
                                        "hac_bandwidth": None})
    return rule.model_copy(update={"cost": cost})


def interval_readings(findings: Sequence[IndexedFinding],
                      registrations: Mapping[str, Registration]
                      ) -> dict[str, IntervalReading]:
    """Finding name -> the rule it varies, for each exploratory finding whose rule decides the
    cost on the HAC interval and is otherwise the rule of another finding of the same run, one
    with another interval (the HAC reading of a study's cost: ``NAME-hac``). Findings whose
    registration is not in ``registrations`` are left out."""
    rules: dict[str, tuple[str, Any]] = {}
    for f in findings:
        reg = registrations.get(f.name)
        if f.summary is not None and reg is not None:
            rule = reg.experiment().rule
            if rule.cost is not None:
                rules[f.name] = (f.summary.run, rule)
    out: dict[str, IntervalReading] = {}
    for f in findings:
        if f.name not in rules or f.summary.analysis != "exploratory":
            continue
        run, rule = rules[f.name]
        if rule.cost.interval != "hac":
            continue
        bases = sorted(
            name for name, (other_run, other) in rules.items()
            if other_run == run and other.cost.interval != "hac"
            and _without_interval(other) == _without_interval(rule))
        if bases:
            base = bases[0]
            out[f.name] = IntervalReading(base, rules[base][1].cost.interval, rule.cost.interval)
    return out


def _outcome(cost: str) -> str:
    """A Summary row's cost cell without its metric: ``undecidable (throughput)`` ->
    ``undecidable``."""
    return cost.rsplit(" (", 1)[0]


#: The README's results at a glance: at most this many rows (room for each engine's newest release).
GLANCE_ROWS = 10
README_BEGIN = ("<!-- results at a glance: written by `bistat index --readme`, from the findings; "
                "do not edit by hand -->")
README_END = "<!-- end of the results at a glance -->"


def glance(rows: Sequence[Answer], limit: int = GLANCE_ROWS) -> tuple[list[Answer], int]:
    """The README's rows, and how many were left out for room.

    Only settings that switch batch invariance on count, and only tested ones: a row whose verdict
    is *untested* (a run that could not test the hypothesis: an engine that refused the setting,
    too few passes, a toy run stopped early) never enters. For each engine, head size, attention
    backend and setting, the row from the newest release that has it (in that release: a verdict
    under changing batches before one batch, more prompts compared, the newer run). Each engine's newest release comes first; then older releases, newest first,
    preferring a head size and attention backend the table does not show yet, then fewer
    settings.
    """
    best: dict[tuple, Answer] = {}
    for a in rows:
        if not a.mode_on or "untested" in a.row.verdict:   # an untested run answers nothing
            continue
        k = (_engine_release(a.engine)[0], a.head_size, a.backend, a.setting)
        if k not in best or _glance_rank(best[k]) < _glance_rank(a):
            best[k] = a
    newest_of: dict[str, Version] = {}
    for a in best.values():
        name, version = _engine_release(a.engine)
        newest_of[name] = max(newest_of.get(name, Version("0")), version or Version("0"))
    left, chosen, shown = list(best.values()), [], set()

    def priority(a: Answer) -> tuple:
        name, version = _engine_release(a.engine)
        version = version or Version("0")
        return (version != newest_of[name], [-x for x in version.release],
                (a.head_size, a.backend) in shown, len(a.setting), a.head_size or 0, a.backend,
                a.setting, a.engine)

    while left and len(chosen) < limit:
        a = min(left, key=priority)
        left.remove(a)
        chosen.append(a)
        shown.add((a.head_size, a.backend))
    chosen.sort(key=lambda a: (_table_order(a.engine, a.gpu), a.head_size or 0, a.backend,
                               len(a.setting), a.setting))
    return chosen, len(left)


def _glance_rank(a: Answer) -> tuple:
    _, version = _engine_release(a.engine)
    return (version or Version("0"), a.under_load, a.compared, a.finding.run_created or "")


def render_glance(rows: Sequence[Answer], left_out: int, readme_dir: Path, index_path: Path,
                  newest: Mapping[str, NewestRelease]) -> list[str]:
    """The README's results at a glance (between :data:`README_BEGIN` and :data:`README_END`)."""
    index = Path(os.path.relpath(index_path, readme_dir)).as_posix()
    lines = [README_BEGIN, ""]
    lines += [releases_sentence([a.engine for a in rows], newest), ""]
    lines += ["| engine | GPU | model | head size, attention | workload | setting | invariant? "
              "| cost: ratio [95 % interval] |", "|---|---|---|---|---|---|---|---|"]
    for a in rows:
        rel = Path(os.path.relpath(a.finding.path, readme_dir)).as_posix()
        if a.row.ratio == "—":
            cost = a.row.cost
        elif a.row.cost.startswith("—"):
            cost = f"no cost rule; throughput {_ratio_cell(a.row)}"
        else:
            cost = f"{a.row.cost}: {_ratio_cell(a.row)}"
        lines.append(md_row((a.engine, a.gpu, a.model, f"{a.head_size or '—'}, {a.backend}",
                             a.workload, _setting_cell(a),
                             f"[{a.row.verdict}, {a.row.matched}]({rel})", cost)))
    more = (f" {left_out} more combination{'s' if left_out != 1 else ''} of head size, backend "
            "and setting, and every other run," if left_out else " Every other run is")
    lines += ["", f"One row per head size, attention backend and setting that switches batch "
                  f"invariance on, from the newest release that measured it (each verdict links "
                  f"its finding; ratio: treatment ÷ control, throughput below 1 or latency above "
                  f"1 is slower).{more} in [{index}]({index}).", "", README_END]
    return lines


def readme_with_glance(readme: str | Path, rows: Sequence[Answer], index_path: Path,
                       newest: Mapping[str, NewestRelease]) -> str:
    """``readme``'s text with its results at a glance (the lines from :data:`README_BEGIN` to
    :data:`README_END`) made current: :func:`glance` of ``rows``, linked from the README's
    folder."""
    readme = Path(readme)
    lines = readme.read_text(encoding="utf-8").split("\n")
    if lines.count(README_BEGIN) != 1 or lines.count(README_END) != 1 or \
            lines.index(README_BEGIN) > lines.index(README_END):
        raise ValueError(f"{readme}: needs one line {README_BEGIN!r} and, below it, one line "
                         f"{README_END!r}, where the results at a glance go; add them")
    chosen, left_out = glance(rows)
    block = render_glance(chosen, left_out, readme.resolve().parent, Path(index_path).resolve(),
                          newest)
    return "\n".join(lines[:lines.index(README_BEGIN)] + block
                     + lines[lines.index(README_END) + 1:])


#: the first line of a release comparison (``bistat compare``), which the index lists apart
RELEASE_COMPARISON_TITLE = "# Release comparison: "


def render_index(findings: list[IndexedFinding], base: Path,
                 unrun: list[UnrunRegistration] | None = None,
                 reasons_source: str | None = None,
                 comparisons: list[tuple[Path, str]] | None = None,
                 answers_lines: Sequence[str] = (),
                 readings: Mapping[str, IntervalReading] | None = None,
                 options: Mapping[str, str | None] | None = None) -> str:
    """The index as markdown: the answers (``answers_lines``, :func:`render_answers`), then one
    table per engine version and GPU (findings with a Summary), rows grouped by run, a reading
    of a rule under another cost interval (``readings``, :func:`interval_readings`) named as
    such, its cost verdict marked where it differs from the rule's; then findings without a
    Summary; then the registrations without a finding when ``unrun`` is given. ``options``: the
    line recording what it was written from (:data:`OPTIONS_LINE`; paths from ``base``)."""
    readings = readings or {}
    by_name = {f.name: f for f in findings}
    lines = ["# Findings", "",
             "Generated by `bistat index` from the findings in this folder; each finding is "
             "regenerated from its recorded data by `bistat analyze`.", ""]
    if options is not None:
        lines += ["<!-- bistat index options: " + json.dumps(dict(options), sort_keys=True)
                  + " -->", ""]
    lines += list(answers_lines)
    if answers_lines:
        lines += ["## Every run under every rule", ""]
    lines += ["One table per engine version and GPU. Each row is one arm against its control under "
             "one registered rule: is it batch-invariant (the verdict, prompts matched / compared "
             "across the counted passes, the Wilson interval) and what does it cost (the cost "
             "rule's statement; its ratio and interval, or the throughput ratio and its interval "
             "where the rule has no cost rule). *Confirmatory*: the rule was sealed before the "
             "run's data, a test of the hypothesis. *Exploratory*: sealed after them (the default "
             "rule applied to runs recorded before it existed), a description that tests nothing. "
             "*HAC reading of R*: R's rule with the cost interval that allows for serial "
             "correlation of the passes (`interval = \"hac\"`, docs/COST-INTERVALS.md), sealed "
             "after the data; where its cost verdict differs from R's, the row says so in bold. "
             "The rows of one run are adjacent; a run whose registration was run more than once "
             "says so (each finding lists every run of its registration).", ""]
    summarised = [f for f in findings if f.summary is not None]
    groups: dict[tuple[str, str], list[IndexedFinding]] = {}
    for f in summarised:
        groups.setdefault((f.summary.engine, f.summary.gpu), []).append(f)
    for (engine, gpu) in sorted(groups):
        lines += [f"## {engine} on {gpu}", "",
                  "| run | model | arm vs control | backend | invariant? | matched / compared | "
                  "interval | cost | ratio | interval | rule |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        entries = []
        for f in groups[(engine, gpu)]:
            sm = f.summary
            rel = f.path.relative_to(base).as_posix()
            runs = ("" if not f.registration_runs or f.registration_runs < 2 else
                    f" (one of {f.registration_runs} runs of its registration)")
            reading = readings.get(f.name)
            kind = sm.analysis
            if reading is not None and reading.base in by_name:
                base_rel = by_name[reading.base].path.relative_to(base).as_posix()
                kind += (f"; {INTERVAL_WORDS.get(reading.interval, reading.interval)} reading of "
                         f"[{reading.base}]({base_rel})")
            for r in sm.rows:
                key = (sm.run, r.treatment, r.control, sm.analysis != "confirmatory", f.name)
                cost = r.cost
                if reading is not None and reading.base in by_name:
                    was = next((b.cost for b in by_name[reading.base].summary.rows
                                if (b.treatment, b.control) == (r.treatment, r.control)), None)
                    if was is not None and _outcome(was) != _outcome(cost):
                        other = INTERVAL_WORDS.get(reading.base_interval, reading.base_interval)
                        cost = (f"{cost}: **changes** (was {_outcome(was)} with the {other} "
                                "interval)")
                entries.append((key, sm, dataclasses.replace(r, cost=cost),
                                f"[{f.name}]({rel}) ({kind})", runs))
        previous = None
        for key, sm, r, rule, runs in sorted(entries, key=lambda e: e[0]):
            run = f"`{sm.run}`{runs}" if sm.run != previous else ""
            previous = sm.run
            lines.append(md_row((
                run, f"`{sm.model}`", f"{r.treatment} vs {r.control}", r.backend, r.verdict,
                r.matched, r.interval, r.cost, r.ratio, r.cost_interval, rule)))
        lines.append("")
    rest = [f for f in findings if f.summary is None]
    if rest:
        lines += ["## Findings without a summary", "",
                  "Written before findings carried a Summary section; their verdicts as headed.",
                  "", "| finding | treatment vs control | verdict |", "|---|---|---|"]
        for f in sorted(rest, key=lambda f: f.path.as_posix()):
            rel = f.path.relative_to(base).as_posix()
            for i, (treatment, control, label) in enumerate(f.verdicts):
                cell = f"[{f.name}]({rel})" if i == 0 else ""
                lines.append(f"| {cell} | {treatment} vs {control} | *{label}* |")
        lines.append("")
    if comparisons:
        lines += ["## One study on two releases", "",
                  "Written by `bistat compare` from the two runs' data: per arm, both releases' "
                  "match counts, verdicts and cost, what changed by fixed rules, and the upstream "
                  "changes between the releases.", ""]
        lines += [f"- [{title}]({path.relative_to(base).as_posix()})"
                  for path, title in sorted(comparisons)]
        lines.append("")
    if unrun is not None:
        source = f" (`{reasons_source}`)" if reasons_source else ""
        lines += ["## Registered, no finding yet", "",
                  f"Sealed before any data and not run (or not analysed) so far; the reason as "
                  f"stated by the people running the studies{source}.", ""]
        if not unrun:
            lines.append("None: every registration has its finding.")
        else:
            lines += ["| registration | registered (UTC) | why no finding |", "|---|---|---|"]
            for u in unrun:
                rel = Path(os.path.relpath(u.path, base)).as_posix()
                lines.append(f"| [{u.name}]({rel}) | {u.registered_utc or '—'} | "
                             f"{u.reason or '*no reason stated*'} |")
        lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n"


#: The folder below the findings where a machine's own runs write theirs (``bash scripts/main.sh``
#: writes ``findings/local/quickstart-r2.md``; git ignores it): not the project's findings, so
#: never indexed, and a checkout's index and README stay what its committed findings say.
LOCAL_FINDINGS = "local"


def read_findings(findings_dir: str | Path
                  ) -> tuple[list[IndexedFinding], list[tuple[Path, str]]]:
    """Every ``*.md`` below ``findings_dir`` but its README and :data:`LOCAL_FINDINGS`: the
    findings, and the release comparisons (path, title) apart."""
    comparisons, findings = [], []
    for p in sorted(Path(findings_dir).rglob("*.md")):
        if p.name == "README.md" or p.relative_to(findings_dir).parts[0] == LOCAL_FINDINGS:
            continue
        first = p.read_text(encoding="utf-8").split("\n", 1)[0]
        if first.startswith(RELEASE_COMPARISON_TITLE):
            comparisons.append((p, first.removeprefix(RELEASE_COMPARISON_TITLE)))
        else:
            findings.append(read_finding(p))
    return findings, comparisons


#: The line of the index that records the options it was written with (paths from the findings
#: folder), so that ``bistat index`` without options writes it whole again (:func:`index_options`).
OPTIONS_LINE = re.compile(r"^<!-- bistat index options: (?P<json>\{.*\}) -->$", re.M)
#: Sections only the registrations give the index (lost by an index written without them).
REGISTRATION_SECTIONS = ("## Answers", "## Registered, no finding yet")


@dataclass(frozen=True)
class IndexOptions:
    """What an index is written from besides its findings: the registrations folder, the file of
    reasons why a registration has no finding, the README whose results at a glance it writes."""

    registrations_dir: str | None = None
    reasons_path: str | None = None
    readme: str | None = None

    def flags(self) -> str:
        """The options on a ``bistat index`` command line (``""`` without any)."""
        pairs = (("--registrations", self.registrations_dir), ("--reasons", self.reasons_path),
                 ("--readme", self.readme))
        return " ".join(f"{flag} {value}" for flag, value in pairs if value is not None)


def _named(path: str | Path, findings_dir: Path) -> str:
    """``path`` as the index names it: from the folder above the findings, however it was given,
    so that the index's bytes do not depend on the directory it was written from."""
    # abspath, not resolve: a registrations folder that is a link keeps its own name
    return Path(os.path.relpath(os.path.abspath(path),
                                os.path.dirname(os.path.abspath(findings_dir)))).as_posix()


def _from_folder(path: str | Path | None, folder: Path) -> str | None:
    return None if path is None else Path(os.path.relpath(os.path.abspath(path),
                                                          os.path.abspath(folder))).as_posix()


def index_options(findings_dir: str | Path) -> IndexOptions | None:
    """The options ``findings_dir/README.md`` was written with (paths as from the current
    directory), or None when there is no index or it records none.

    Raises
    ------
    ValueError
        The index has the answers or the registrations without a finding (written with
        ``--registrations``) but no options line: written by an older bistat, it cannot be
        written whole again without them being given.
    """
    base = Path(findings_dir)
    path = base / "README.md"
    if not path.is_file():
        return None
    text = path.read_text(encoding="utf-8")
    m = OPTIONS_LINE.search(text)
    if m is None:
        lost = [s for s in REGISTRATION_SECTIONS if f"\n{s}\n" in f"\n{text}"]
        if lost:
            raise ValueError(f"{path}: written with --registrations (it has "
                             f"{' and '.join(repr(s[3:]) for s in lost)}) but records no options; "
                             "without them `bistat index` would delete those sections: give "
                             "them, e.g. bistat index " + f"{base.as_posix()} --registrations "
                             "preregistrations --reasons findings/not-run.toml --readme README.md")
        return None
    try:
        recorded = json.loads(m["json"])
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: its options line is not valid JSON ({exc}); give the options "
                         "on the command line") from exc
    here = {k: None if recorded.get(k) is None else
            Path(os.path.relpath(base / recorded[k])).as_posix()
            for k in ("registrations_dir", "reasons_path", "readme")}
    for key, value in here.items():
        if value is not None and not Path(value).exists():
            raise ValueError(f"{path}: written with {key.split('_')[0]} {value}, which is not "
                             "there; give the options on the command line")
    return IndexOptions(**here)


def write_index(findings_dir: str | Path, registrations_dir: str | Path | None = None,
                reasons_path: str | Path | None = None, readme: str | Path | None = None
                ) -> Path:
    """Write ``findings_dir/README.md`` listing every ``*.md`` finding below it, and, given
    ``registrations_dir``, the answers above that listing and the registrations that have no
    finding (why: ``reasons_path``); given ``readme`` too, its results at a glance
    (:func:`readme_with_glance`). The index records these options (:func:`index_options`)."""
    base = Path(findings_dir)
    findings, comparisons = read_findings(base)
    unrun = source = None
    rows: list[Answer] = []
    newest: dict[str, NewestRelease] = {}
    answers_lines: list[str] = []
    readings: dict[str, IntervalReading] = {}
    if reasons_path is not None and registrations_dir is None:
        raise ValueError("a reasons file needs the registrations folder (--registrations)")
    if readme is not None and registrations_dir is None:
        raise ValueError("the README's results at a glance need the registrations folder "
                         "(--registrations)")
    if registrations_dir is not None:
        registrations = load_registrations(registrations_dir)
        source = None if reasons_path is None else _named(reasons_path, base)
        reasons = {} if reasons_path is None else read_reasons(reasons_path)
        unrun = unrun_registrations(findings, registrations_dir, reasons,   # errors: as given
                                    "the reasons file" if reasons_path is None
                                    else Path(reasons_path).as_posix(), registrations)
        rows, newest = answers(findings, registrations), newest_releases(registrations)
        answers_lines = render_answers(rows, base, newest, _named(registrations_dir, base))
        readings = interval_readings(findings, registrations)
    out = base / "README.md"
    options = {"registrations_dir": _from_folder(registrations_dir, base),
               "reasons_path": _from_folder(reasons_path, base),
               "readme": _from_folder(readme, base)}
    out.write_text(render_index(findings, base, unrun, source, comparisons, answers_lines,
                                readings, options), encoding="utf-8")
    if readme is not None:
        text = readme_with_glance(readme, rows, out, newest)
        Path(readme).write_text(text, encoding="utf-8")
    return out
