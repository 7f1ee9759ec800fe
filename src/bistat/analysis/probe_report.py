"""The probe's decision: its outcome per arm and per needle, its report (``probe.json``), the needle
a recorded run chooses, and reading and merging reports.

The probe has one home per stage. :mod:`bistat.run.probe` runs it and records what it saw
(:class:`~bistat.run.probe_records.ProbeRecord`); this module decides the outcome
(:func:`decide_record`, :func:`decide_report`; :func:`run_probe` records and decides in one call),
is the one reader of a run directory's ``probe*.json`` (:func:`read_probe_reports`, which
``bistat analyze`` uses); :mod:`bistat.analysis.probe_needle` chooses the needle from a recorded
run; ``bistat probe`` is :mod:`bistat.cli.cmd_probe`. The finding formats the report
(:func:`filler_line`, :func:`needle_line`, :attr:`ProbeReport.needle_outcomes`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from bistat.run.probe import record_probe
from bistat.run.probe_records import (   # the recorded types, re-exported with the decision
    CHARS_PER_TOKEN,
    FILLER_TOKENS,
    LONG_NEEDLES,
    NEEDLE_TOKENS,
    PROBE_DESIGNS,
    PROBE_MODES,
    PROBE_SCHEMA,
    ArmProbe,
    BitwiseComparison,
    NeedleProbe,
    NeedleSource,
    ProbeMode,
    ProbeOutcome,
    ProbeRecord,
    ProbeSettings,
    ProbeTrial,
    compare_bitwise,
)
from bistat.store.format import PROBE_FILE, PROBE_GLOB

if TYPE_CHECKING:  # pragma: no cover
    from bistat.declare.experiment import Experiment

__all__ = [
    "ArmProbe",
    "BitwiseComparison",
    "CHARS_PER_TOKEN",
    "FILLER_TOKENS",
    "LONG_NEEDLES",
    "NEEDLE_TOKENS",
    "NeedleProbe",
    "NeedleSource",
    "NeedleVerdict",
    "PROBE_DESIGNS",
    "PROBE_MODES",
    "PROBE_SCHEMA",
    "ProbeMode",
    "ProbeOutcome",
    "ProbeRecord",
    "ProbeReport",
    "ProbeReportError",
    "ProbeSettings",
    "ProbeTrial",
    "compare_bitwise",
    "decide_record",
    "decide_report",
    "filler_line",
    "merge_reports",
    "needle_line",
    "needle_verdicts",
    "probe_report_paths",
    "read_probe_reports",
    "report_from_json",
    "run_probe",
]

#: The settings a ``single``-design report leaves out (reports written before designs existed
#: have none of them and read as ``single``).
_DESIGN_KEYS = ("design", "long_needles", "filler_tokens")


@dataclass(frozen=True)
class ProbeReport:
    """The probe's result: outcome, reason, and every arm's trials."""

    outcome: ProbeOutcome
    reason: str
    settings: ProbeSettings
    needle_prompt_id: str
    arms: tuple[ArmProbe, ...]
    pending: tuple[str, ...] = ()       # arms planned but not (yet) probed: a partial report
    merged_from: tuple[str, ...] = ()   # the reports this one merges (merge_reports)
    # the recorded run that chose the needle (--needle-from); None: --needle, or a report
    # written before it was recorded
    needle_source: NeedleSource | None = None
    # kv-sweep: long needles the engine's max_model_len has no room for, each with the reason
    left_out: tuple[str, ...] = ()

    @cached_property
    def needle_outcomes(self) -> tuple["NeedleVerdict", ...]:
        """The outcome per needle (kv-sweep; empty otherwise): :func:`needle_verdicts`."""
        return needle_verdicts(self.arms)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["schema"] = PROBE_SCHEMA
        if self.needle_source is None:
            del data["needle_source"]
        if self.settings.design == "single":   # written as before designs existed
            for key in _DESIGN_KEYS:
                del data["settings"][key]
        else:
            data["settings"]["long_needles"] = list(self.settings.long_needles)
        for arm, probe in zip(data["arms"], self.arms):
            arm["differs"] = probe.differs
            if probe.n_fillers_compared is None:   # not a batch probe: no filler evidence
                for key in ("n_fillers_compared", "fillers_differing", "filler_first_divergence"):
                    del arm[key]
            else:
                arm["fillers_differing"] = list(probe.fillers_differing)
            if probe.machine is None:
                del arm["machine"]
            if not probe.needles:
                del arm["needles"]
            else:
                for needle, np_ in zip(arm["needles"], probe.needles):
                    needle["differs"] = np_.differs
                    needle["kv_first_divergence"] = np_.kv_first_divergence
        for key in ("pending", "merged_from", "left_out"):
            if not data[key]:
                del data[key]
            else:
                data[key] = list(data[key])
        verdicts = self.needle_outcomes
        if verdicts:
            data["needle_outcomes"] = [asdict(v) for v in verdicts]
        return data

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (``to_json``), for readers that serialise any object by ``to_dict``."""
        return self.to_json()

    def summary_lines(self) -> list[str]:
        """The human summary: one line per arm (and, kv-sweep, per needle), then the outcome and
        its reason (kv-sweep: the outcome per needle first)."""
        st = self.settings
        if st.sweep:
            first = (f"needles {self.needle_prompt_id} and about "
                     f"{', '.join(map(str, st.long_needles)) or 'no other'} prompt tokens, "
                     f"{st.max_tokens} tokens each; {st.trials} trial(s) of "
                     f"{st.min_fillers}-{st.max_fillers} fillers of {st.filler_tokens} tokens "
                     "arriving while they decode")
        elif st.mode == "batch":
            first = (f"needle {self.needle_prompt_id}, {st.trials} trial(s) of "
                     f"{st.min_fillers}-{st.max_fillers} fillers, {st.max_tokens} tokens")
        elif st.mode == "prefill-decode":
            first = (f"needle {self.needle_prompt_id}, prefill vs decode logprobs, "
                     f"{st.max_tokens} tokens")
        else:
            first = (f"needle {self.needle_prompt_id}, prefix cache cold vs warm, {st.trials} "
                     f"trial(s), {st.max_tokens} tokens")
        lines = [first]
        if self.needle_source is not None:
            lines.append(f"needle chosen: {self.needle_source.describe()}")
        for a in self.arms:
            label = "negative control" if a.role == "negative_control" else "probed"
            if a.error is not None:
                lines.append(f"  {a.arm} ({label}): could not run: {a.error}")
                continue
            same = a.n_identical
            repeat = {True: "identical", False: "DIFFERENT", None: "n/a"}[a.alone_repeat_identical]
            firsts = a.first_divergences
            where = f"; first divergence at token {', '.join(map(str, firsts))}" if firsts else ""
            errors = sum(t.error is not None for t in a.trials)
            err = f"; {errors} trial(s) failed" if errors else ""
            if st.mode == "batch":
                what = f"in batch identical in {same}/{len(a.trials)} trial(s)"
                known = [t for t in a.trials if t.shared_step is not None]
                shared = (f"; needle shared a step in {a.n_shared}/{len(a.trials)} trial(s)"
                          if known else "; no batching evidence")
                if a.n_fillers_compared is not None:
                    shared += f"; {filler_line(a)}"
            elif st.mode == "prefill-decode":
                what = ("prefill and decode logprobs bitwise equal" if same == len(a.trials)
                        else "prefill and decode logprobs DIFFER")
                shared = ""
            else:
                what = f"warm identical to cold in {same}/{len(a.trials)} trial(s)"
                shared = ""
            lines.append(f"  {a.arm} ({label}): alone twice {repeat}; {what}{where}{err}{shared}")
            lines += [f"    {needle_line(n)}" for n in a.needles]
        if self.pending:
            lines.append(f"  not probed: {', '.join(self.pending)}")
        lines += [f"  left out: {x}" for x in self.left_out]
        verdicts = self.needle_outcomes
        if verdicts:
            lines.append("per needle:")
            lines += [f"  {v.needle} ({_keys_words(v)}): {v.outcome} — {v.reason}" for v in verdicts]
        lines.append(f"outcome: {self.outcome} — {self.reason}")
        return lines


def needle_line(n: NeedleProbe) -> str:
    """One needle of one arm in words (kv-sweep), for the summary."""
    prompt = "?" if n.n_prompt_tokens is None else str(n.n_prompt_tokens)
    kv = n.kv_range
    keys = "" if kv is None else f", keys {kv[0]}-{kv[1]}"
    repeat = {True: "identical", False: "DIFFERENT", None: "n/a"}[n.alone_repeat_identical]
    done = [t for t in n.trials if t.error is None]
    same = n.n_identical
    first = n.first_divergence
    where = ("" if first is None else f"; first divergence at token {first}"
             + ("" if n.kv_first_divergence is None else f" (KV length {n.kv_first_divergence})"))
    shared = sum(t.shared_step is True for t in n.trials)
    errors = len(n.trials) - len(done)
    err = f"; {errors} trial(s) failed" if errors else ""
    return (f"{n.needle} ({prompt} prompt tokens{keys}): alone twice {repeat}; in batch identical "
            f"in {same}/{len(n.trials)} trial(s){where}; shared a step in {shared}/"
            f"{len(n.trials)}{err}")


def _keys_words(v: "NeedleVerdict") -> str:
    if v.kv_low is None:
        return "prompt tokens not reported"
    return f"{v.n_prompt_tokens} prompt tokens, keys {v.kv_low}-{v.kv_high}"


@dataclass(frozen=True)
class NeedleVerdict:
    """The probe's outcome for one needle of the ``kv-sweep`` design, over every arm."""

    needle: str
    target_tokens: int | None        # the design's length for it (None: the needle prompt)
    n_prompt_tokens: int | None      # as the engine counted them (the first arm that says)
    kv_low: int | None               # keys its first generated token read, alone
    kv_high: int | None              # keys its last generated token read, alone
    outcome: ProbeOutcome
    reason: str
    kv_first_divergence: int | None  # earliest over the probed arms that differed


def needle_verdicts(arms: Sequence[ArmProbe]) -> tuple[NeedleVerdict, ...]:
    """The outcome per needle (kv-sweep design; empty otherwise), decided like the arm outcome
    but on that needle alone: ``untested`` (an arm could not run it), ``violated`` (a probed arm
    gave it different bits), ``vacuous`` (a probed arm never showed it sharing an engine step),
    ``no_power`` (no negative control, or the control's needle stayed identical), else
    ``confirmed``. Fillers are not needles: their differences count for the arm only."""
    order: dict[str, tuple[NeedleProbe, ...]] = {}
    for a in arms:
        for n in a.needles:
            order.setdefault(n.needle, ())
            order[n.needle] += (n,)
    out = []
    for name, runs in order.items():
        def on(role: str) -> list[tuple[ArmProbe, NeedleProbe | None]]:
            return [(a, next((n for n in a.needles if n.needle == name), None))
                    for a in arms if a.role == role]

        probed, controls = on("probed"), on("negative_control")
        known = next((n for n in runs if n.kv_range is not None), runs[0])
        kv = known.kv_range
        failed = [a.arm for a, n in probed
                  if a.error is not None or n is None or any(t.error for t in n.trials)]
        differing = [(a, n) for a, n in probed if n is not None and n.differs]
        kvs = [n.kv_first_divergence for _, n in differing if n.kv_first_divergence is not None]
        alone = [a.arm for a, n in probed if n is not None and not any(
            t.shared_step is True for t in n.trials)]
        if failed:
            outcome, reason = "untested", f"the probe could not run it on {', '.join(failed)}"
        elif not probed:
            outcome, reason = "untested", "no arm has been probed yet, only the negative control"
        elif differing:
            where = f", the earliest at KV length {min(kvs)}" if kvs else ""
            outcome, reason = "violated", (f"bitwise differences on "
                                           f"{', '.join(a.arm for a, _ in differing)}{where}")
        elif alone:
            outcome, reason = "vacuous", (f"{', '.join(alone)}: the engine's batching evidence "
                                          "never shows it sharing an engine step")
        elif not controls:
            outcome, reason = "no_power", "no negative control was run"
        elif any(a.error is not None or n is None for a, n in controls):
            outcome, reason = "untested", "the negative control could not run it"
        elif not any(n is not None and n.differs for _, n in controls):
            outcome, reason = "no_power", "the negative control showed no difference at it either"
        else:
            outcome, reason = "confirmed", ("bitwise identical on every probed arm, and the "
                                            "negative control differs at it")
        out.append(NeedleVerdict(name, known.target_tokens, known.n_prompt_tokens,
                                 None if kv is None else kv[0], None if kv is None else kv[1],
                                 outcome, reason, min(kvs) if kvs else None))
    return tuple(out)


def filler_line(a: ArmProbe) -> str:
    """The filler evidence of a batch probe in words (for reports and findings)."""
    if not a.fillers_differing:
        return f"fillers in two or more trials: {a.n_fillers_compared}, all identical"
    return (f"fillers in two or more trials: {a.n_fillers_compared}, DIFFERENT in "
            f"{len(a.fillers_differing)} (first at token {a.filler_first_divergence})")


def _decide(arms: Sequence[ArmProbe], mode: str = "batch",
            sweep: bool = False) -> tuple[ProbeOutcome, str]:
    probed = [a for a in arms if a.role == "probed"]
    controls = [a for a in arms if a.role == "negative_control"]
    failed = [a for a in probed if a.failed]
    if failed:
        unsupported = [a for a in failed if (a.error or "").startswith("unsupported: ")]
        if unsupported:
            return "untested", f"{unsupported[0].arm}: {unsupported[0].error}"
        return "untested", f"the probe could not run on {', '.join(a.arm for a in failed)}"
    if not probed:
        return "untested", "no arm has been probed yet, only the negative control"
    violated = [a.arm for a in probed if a.differs]
    if violated:
        what = {"batch": "not batch invariant",
                "prefill-decode": "decode and prefill logprobs differ",
                "prefix-cache": "a warm prefix cache changes the output"}[mode]
        return "violated", f"bitwise differences on {', '.join(violated)}: {what}"
    if mode == "batch":
        alone = [a for a in probed if a.n_shared == 0]
        if alone:
            a = alone[0]
            known = [t for t in a.trials if t.shared_step is not None]
            evidence = "; ".join(f"trial {t.trial}: {t.evidence}" for t in a.trials) or "no trials"
            why = ("the engine's batching evidence shows the needle never shared an engine step "
                   "with another request" if known else
                   "the engine gave no batching evidence, so sharing a step cannot be shown")
            return "vacuous", (f"{a.arm}: {why}; the sweep tested nothing -- raise the "
                               f"concurrency or the engine's batch size ({evidence})")
    if not controls:
        return "no_power", "no negative control was run, so the probe's power is unknown"
    if any(a.failed for a in controls):
        return "untested", "the negative control could not run, so the probe's power is unknown"
    if not any(a.differs for a in controls):
        return "no_power", (
            "the negative control showed no difference either: the probe lacks power at this size; "
            "raise --max-tokens, the fillers or --trials"
        )
    fillers_too = all(a.n_fillers_compared for a in probed)
    done = {"batch": ("every needle " if sweep else "") + "bitwise identical alone and in every batch"
                     + (" (the fillers too, across trials)" if fillers_too else ""),
            "prefill-decode": "decode logprobs bitwise equal to prefill logprobs",
            "prefix-cache": "bitwise identical with the prefix cache cold and warm"}[mode]
    return "confirmed", f"{done}, and the negative control differs"


def decide_report(arms: Sequence[ArmProbe], settings: ProbeSettings, needle_prompt_id: str, *,
                  pending: tuple[str, ...] = (), merged_from: tuple[str, ...] = (),
                  needle_source: NeedleSource | None = None,
                  left_out: tuple[str, ...] = ()) -> ProbeReport:
    """The report over ``arms``; with ``pending`` arms it is partial, and says so in its reason."""
    outcome, reason = _decide(arms, settings.mode, settings.sweep)
    if pending:
        reason = f"partial: {', '.join(pending)} not probed yet; {reason}"
    return ProbeReport(outcome=outcome, reason=reason, settings=settings,
                       needle_prompt_id=needle_prompt_id, arms=tuple(arms), pending=pending,
                       merged_from=merged_from, needle_source=needle_source, left_out=left_out)


def decide_record(record: ProbeRecord, *, merged_from: tuple[str, ...] = ()) -> ProbeReport:
    """The report of what :func:`bistat.run.probe.record_probe` recorded, its outcome decided."""
    return decide_report(record.arms, record.settings, record.needle_prompt_id,
                         pending=record.pending, merged_from=merged_from,
                         needle_source=record.needle_source, left_out=record.left_out)


def run_probe(experiment: "Experiment", *,
              on_report: Callable[[ProbeReport], None] | None = None,
              **options: Any) -> ProbeReport:
    """Run the probe and decide its outcome: :func:`bistat.run.probe.record_probe` with
    ``options`` (``arms``, ``control``, ``settings``, ``engine_factory``, ``on_arm``,
    ``needle_source``), then :func:`decide_record`.

    ``on_report`` receives the report so far after every arm (its ``pending`` names the arms
    still to run), so that a caller can keep it on disk: an interrupted probe loses only the arm
    it was on; the last call is the report returned.
    """
    def partial(record: ProbeRecord) -> None:
        if on_report is not None:
            on_report(decide_record(record))

    report = decide_record(record_probe(experiment, on_record=partial, **options))
    if on_report is not None:
        on_report(report)
    return report


def _needle_source_from_json(data: Any) -> NeedleSource | None:
    """The ``needle_source`` of a report's JSON (absent in reports written before it was kept);
    fields a later writer adds are ignored."""
    if data is None:
        return None
    known = {f.name for f in fields(NeedleSource)}
    return NeedleSource(**{k: v for k, v in dict(data).items() if k in known})


def _needle_from_json(data: Mapping[str, Any]) -> NeedleProbe:
    """One kv-sweep needle of an arm from its JSON (derived fields are recomputed)."""
    return NeedleProbe(needle=str(data["needle"]), target_tokens=data.get("target_tokens"),
                       n_prompt_tokens=data.get("n_prompt_tokens"), n_tokens=data.get("n_tokens"),
                       alone_repeat_identical=data.get("alone_repeat_identical"),
                       trials=tuple(ProbeTrial(**t) for t in data.get("trials") or ()))


def report_from_json(data: Mapping[str, Any], source: str = "probe report") -> ProbeReport:
    """A :class:`ProbeReport` from its JSON (``bistat probe --output``); ``source`` names it in
    errors."""
    if not isinstance(data, Mapping) or data.get("schema") != PROBE_SCHEMA:
        got = data.get("schema") if isinstance(data, Mapping) else type(data).__name__
        raise ValueError(f"{source}: field 'schema' is {got!r}, expected {PROBE_SCHEMA!r}; write "
                         "it with `bistat probe REGISTRATION --output FILE`")
    try:
        known = {f.name for f in fields(ProbeSettings)}
        settings = ProbeSettings(**{"design": "single",    # a report written before designs
                                    **{k: v for k, v in dict(data["settings"]).items()
                                       if k in known}})
        arms = tuple(
            ArmProbe(arm=str(a["arm"]), role=str(a["role"]),
                     alone_repeat_identical=a.get("alone_repeat_identical"),
                     trials=tuple(ProbeTrial(**t) for t in a.get("trials") or ()),
                     n_needle_tokens=a.get("n_needle_tokens"), error=a.get("error"),
                     n_fillers_compared=a.get("n_fillers_compared"),
                     fillers_differing=tuple(a.get("fillers_differing") or ()),
                     filler_first_divergence=a.get("filler_first_divergence"),
                     needles=tuple(_needle_from_json(n) for n in a.get("needles") or ()),
                     machine=a.get("machine") if isinstance(a.get("machine"), Mapping) else None)
            for a in data["arms"])
        return ProbeReport(outcome=data["outcome"], reason=str(data["reason"]), settings=settings,
                           needle_prompt_id=str(data["needle_prompt_id"]), arms=arms,
                           pending=tuple(data.get("pending") or ()),
                           merged_from=tuple(data.get("merged_from") or ()),
                           needle_source=_needle_source_from_json(data.get("needle_source")),
                           left_out=tuple(data.get("left_out") or ()))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{source}: not a complete {PROBE_SCHEMA} report ({exc!r}); write it "
                         "with `bistat probe REGISTRATION --output FILE`") from None


class ProbeReportError(ValueError):
    """A run directory's probe report cannot be read, or its parts do not merge."""


def probe_report_paths(run_dir: Path) -> list[Path]:
    """``run_dir/probe*.json``: ``probe.json`` first, then the other parts by name."""
    return sorted(run_dir.glob(PROBE_GLOB), key=lambda p: (p.name != PROBE_FILE, p.name))


def read_probe_reports(run_dir: str | Path) -> tuple[ProbeReport | None, tuple[str, ...]]:
    """The probe report of a run directory (``bistat probe --output RUN_DIR/probe.json``) and
    the files it was read from: ``probe.json``, or several runs of the same probe on different
    arms (``probe.json`` beside e.g. ``probe-ARM.json``) merged into one report, decided again
    over all their arms (:func:`merge_reports`). ``(None, ())`` when there is none.

    Raises
    ------
    ProbeReportError
        A file is not a ``bistat.probe/1`` report, or the parts are not runs of one probe.
    """
    run_dir = Path(run_dir)
    paths = probe_report_paths(run_dir)
    if not paths:
        return None, ()
    reports = []
    for path in paths:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            reports.append((path.name, report_from_json(data, str(path))))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ProbeReportError(
                f"{path}: not a probe report ({exc}); write it with "
                "`bistat probe REGISTRATION --output RUN_DIR/probe.json`") from None
        except ValueError as exc:
            raise ProbeReportError(str(exc)) from None
    try:
        return merge_reports(reports), tuple(name for name, _ in reports)
    except ValueError as exc:
        raise ProbeReportError(f"{run_dir}: {exc}") from None


def merge_reports(reports: Sequence[tuple[str, ProbeReport]]) -> ProbeReport:
    """One report from several runs of the same probe (same needle and settings) on different
    arms, e.g. a treatment arm probed after the session that ran the negative control: the
    outcome is decided again over every arm, so one report's control gives the others power.

    ``reports`` pairs each report with the name it is known by (its file). An arm probed in two
    reports, or reports with different needles or settings, are refused: they are not the same
    probe.
    """
    if not reports:
        raise ValueError("no probe reports to merge")
    if len(reports) == 1:
        return reports[0][1]
    (first_src, first), *rest = reports
    seen = {a.arm: first_src for a in first.arms}
    arms = list(first.arms)
    for src, rep in rest:
        if rep.settings != first.settings or rep.needle_prompt_id != first.needle_prompt_id:
            raise ValueError(
                f"{src}: a different probe from {first_src} (needle {rep.needle_prompt_id!r}, "
                f"{rep.settings} vs needle {first.needle_prompt_id!r}, {first.settings}); only "
                "runs of the same probe (same needle and settings) merge -- move the other "
                "report out of the run directory")
        for a in rep.arms:
            if a.arm in seen:
                raise ValueError(f"{src}: arm {a.arm!r} was probed in {seen[a.arm]} too; keep one "
                                 "of the two reports in the run directory")
            seen[a.arm] = src
            arms.append(a)
    pending = tuple(dict.fromkeys(p for _, r in reports for p in r.pending if p not in seen))
    source = next((r.needle_source for _, r in reports if r.needle_source is not None), None)
    return decide_report(arms, first.settings, first.needle_prompt_id, pending=pending,
                         merged_from=tuple(src for src, _ in reports), needle_source=source,
                         left_out=first.left_out)
