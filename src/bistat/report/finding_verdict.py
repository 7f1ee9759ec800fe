"""What a finding decides and under which rule: its head, Summary, verdicts and registration.

The title and verdict line (an exploratory analysis says so in both), the head table with the
seal's line, the hypothesis; the ``## Summary`` table that ``bistat index`` collects; each
comparison's verdict with every criterion and the cost rule's outcome; what the other rules
registered for the same declaration conclude from the same data; every run of the registration;
the decision rule as sealed, and its amendments.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bistat.analysis.results import RunSummary, engine_name
from bistat.core.decided import format_decided
from bistat.core.markdown import md_table
from bistat.core.rule import CostRule, Rule, speed_as_evidence_warnings
from bistat.engines.registry import capabilities
from bistat.report.finding_cells import _bullets, _met
from bistat.report.seal import SealEvidence


def _title(s: RunSummary) -> str:
    """The first line: an exploratory analysis says so there."""
    if s.exploratory:
        return f"# Finding: {s.name} — exploratory analysis, not a test of the hypothesis"
    return f"# Finding: {s.name}"


def _verdict_line(s: RunSummary) -> str:
    """Each comparison's label and, with a cost rule, its cost statement (``Verdict.headline``):
    ``**working** — no measurable cost (ratio 0.97, 95 % interval 0.91–1.04) (t vs c)``."""
    parts = []
    for c in s.comparisons:
        v = c.verdict
        cost = "" if v.cost is None else f" — {v.cost.statement}"
        parts.append(f"**{v.label.value}**{cost} ({c.treatment} vs {c.control})")
    return ("Exploratory verdict: " if s.exploratory else "Verdict: ") + ", ".join(parts) + "."


def _exploratory_note(s: RunSummary) -> list[str]:
    """Why the analysis is exploratory, with the times from the seals that prove the order."""
    if not s.exploratory:
        return []
    recorded = (f"`{s.recorded_registration}`" if s.recorded_registration
                else "another registration")
    return [f"**Exploratory.** This rule (`{s.registration_path}`) was sealed at {s.sealed_utc}, "
            f"after this run's first record ({s.created_utc}); the run was recorded under "
            f"{recorded}, sealed before it. A rule chosen after the data can describe them, never "
            "test the hypothesis: the labels below say what the rule finds in data it may have "
            "been chosen for.", ""]


def _head(s: RunSummary, seal: SealEvidence | None) -> list[str]:
    out = [_title(s), "",
           _verdict_line(s), "", *_exploratory_note(s),
           *([] if seal is None else [seal.line(), ""]),
           md_table(("", ""), [
               ("Registration", f"`{s.registration_path or '—'}`"),
               ("Registration SHA-256", f"`{s.registration_sha256}`"),
               ("Registered (UTC)", s.registered_utc),
               ("Last sealed (UTC)", s.sealed_utc),
               ("Registered with bistat", s.registration_bistat_version or "—"),
               ("Run", f"`{s.run_id}`"),
               ("Run created (UTC)", s.created_utc or "—"),
               *([("Runs of its registration", _runs_count(s))] if s.registration_runs else []),
               ("Engine", s.engine_kind or "—"),
               ("Command", f"`{' '.join(s.command)}`" if s.command else "—"),
               ("Response records read", str(s.n_response_records)),
           ]), "",
           "## Hypothesis", "", *[f"> {line}" if line else ">"
                                  for line in s.hypothesis.splitlines()], ""]
    return out


def _verdict(s: RunSummary) -> list[str]:
    out = ["## Verdict", ""]
    for c in s.comparisons:
        v = c.verdict
        out += [f"### {c.treatment} (treatment) vs {c.control} (control): "
                f"**{v.label.value}**", "", v.sentence, "", f"Basis: {v.basis}.", ""]
        rows = []
        for lr in v.labels:
            for cr in lr.criteria:
                rows.append((lr.label, cr.description, cr.observed_text, cr.threshold,
                             _met(cr.met) + (f" ({cr.reason})" if cr.reason else "")))
        out += [md_table(("label", "criterion", "observed", "threshold", "met"), rows), ""]
        label_rows = [(lr.label, "all criteria met" if lr.met else "not met")
                      for lr in v.labels]
        out += [md_table(("label (in rule order)", "outcome"), label_rows), ""]
        if v.untested_reasons:
            out += ["Why untested:", "", _bullets(v.untested_reasons, ""), ""]
        if v.notes:
            out += ["Notes:", "", _bullets(v.notes, ""), ""]
        out += _cost(s, v)
    return out


def _cost_rule(s: RunSummary) -> CostRule | None:
    data = (s.declaration.get("rule") or {}).get("cost")
    return None if data is None else CostRule.model_validate(data)


def _cost(s: RunSummary, v: Any) -> list[str]:
    """The cost rule's verdict for one comparison: its outcome, statement and fixed sentence."""
    cv = v.cost
    rule = _cost_rule(s)
    if cv is None or rule is None:
        return []
    out = [f"Cost (`[rule.cost]`: {rule.describe()}): **{cv.outcome.value}** — {cv.statement}.",
           "", cv.sentence, ""]
    if cv.passes_to_decide is not None:
        out += [f"About {cv.passes_to_decide} counted passes per arm would decide it: "
                f"`bistat.core.design.passes_to_decide` at the observed ratio "
                f"({cv.ratio:.4f}) and pass-to-pass CV ({cv.cv:.3g}), with 80 % probability.", ""]
    if cv.reason:
        out += [f"Why: {cv.reason}.", ""]
    return out


def _summary(s: RunSummary) -> list[str]:
    """The finding at a glance, one row per comparison: what `bistat index` collects into
    findings/README.md (engine version, GPU, model, backend, invariant?, cost, the rule)."""
    envs = dict(s.environments)
    gpus = sorted({g.split(" (")[0] for e in envs.values() for g in e.gpus}) or ["no GPU"]
    model = (s.declaration.get("engine") or {}).get("model", "—")
    kind = "exploratory" if s.exploratory else "confirmatory"
    arms = {a.name: a for a in s.arms}
    rule = _cost_rule(s)
    rows = []
    for c in s.comparisons:
        v, t = c.verdict, arms.get(c.treatment)
        iv = None if t is None else t.match_interval
        matched = "—" if t is None else f"{t.n_matched} / {t.n_units}"
        if v.cost is not None and rule is not None:
            cost = f"{v.cost.outcome.value} ({v.cost.metric})"
            point, civ, bounds = v.cost.ratio, v.cost.interval, (rule.low, rule.high)
        else:
            cost = "— (no cost rule)"
            point, civ, bounds = c.ratio_point, None if c.ratio is None else c.ratio.interval, ()
        rows.append((c.treatment, c.control, _backend(s, c.treatment), f"*{v.label.value}*",
                     matched, "—" if iv is None else f"[{iv.low:.4f}, {iv.high:.4f}]", cost,
                     "—" if point is None else format_decided(point, bounds),
                     "—" if civ is None else f"[{format_decided(civ.low, bounds)}, "
                                             f"{format_decided(civ.high, bounds)}]"))
    cl = f"{s.confidence_level * 100:g} %"
    return ["## Summary", "",
            f"Engine: {_engine_version(s)} · GPU: {', '.join(gpus)} · model: `{model}` · run: "
            f"`{s.run_id}` · rule: `{s.registration_path or '—'}` ({kind})", "",
            md_table(("treatment", "control", "backend", "invariant?", "matched / compared",
                      f"{cl} interval (two-sided Wilson)", "cost", "ratio", "interval"), rows),
            ""]


def _engine_version(s: RunSummary) -> str:
    """The engine the run measured (:func:`bistat.analysis.results.engine_name`)."""
    return engine_name(s)


def _backend(s: RunSummary, arm: str) -> str:
    """The arm's engine kind and what it ran on: the attention backend(s) its engine log named,
    or the embedded engine's GEMM."""
    acts = {a.arm: a for a in s.activation}
    parts = [s.engine_kind or "—"]
    a = acts.get(arm)
    if a is not None and a.attention:
        parts += list(a.attention)
    decl = {x["name"]: x for x in s.declaration.get("arms", [])}
    args = {**((s.declaration.get("engine") or {}).get("args") or {}),
            **(decl.get(arm, {}).get("args") or {})}
    if capabilities(s.engine_kind or "").gemm_modes and "gemm" in args:
        parts.append(f"gemm {args['gemm']}")
    return ", ".join(parts)


def _siblings(s: RunSummary) -> list[str]:
    """What the other rules registered for the same declaration conclude from the same data."""
    if not s.siblings:
        return []
    names = list(dict.fromkeys((v.registration, v.name) for v in s.siblings))
    regs = ", ".join(f"`{path}`" for path, _ in names)
    later = any(v.exploratory for v in s.siblings)
    costs = any(v.verdict.cost is not None for v in s.siblings)
    rows = []
    for v in s.siblings:
        row = [f"`{v.name}`"] + (["exploratory" if v.exploratory else "confirmatory"]
                                 if later else [])
        row += [f"{v.treatment} vs {v.control}", f"**{v.verdict.label.value}**"]
        if costs:
            row.append("—" if v.verdict.cost is None else v.verdict.cost.statement)
        rows.append(tuple(row + [v.verdict.basis]))
    header = (("registration",) + (("analysis",) if later else ()) + ("comparison", "verdict")
              + (("cost",) if costs else ()) + ("basis",))
    note = [] if not later else [
        "A rule sealed after this run's first record (exploratory) describes the data; only a "
        "rule sealed before it (confirmatory) tests the hypothesis.", ""]
    return ["## The same data under the other registered rule" + ("s" if len(names) > 1 else ""),
            "",
            f"{regs} {'was' if len(names) == 1 else 'were'} sealed with this declaration but for "
            "the name and the decision rule, so the same comparisons are classified by "
            f"{'its rule' if len(names) == 1 else 'each rule'} too (each criterion is in "
            f"{'its' if len(names) == 1 else 'their'} own finding):", "", *note,
            md_table(header, rows), ""]


def _runs_count(s: RunSummary) -> str:
    """``1 (this one)`` / ``3 (this one and 2 others: see Runs of this registration)``."""
    n = len(s.registration_runs)
    if n == 1:
        return "1 (this one)"
    return (f"{n} (this one and {n - 1} other{'s' if n > 2 else ''}: see Runs of this "
            "registration)")


def _registration_runs(s: RunSummary) -> list[str]:
    """Every run of the registration this run was recorded under: a study run until its result
    looked good shows every run it took."""
    if not s.registration_runs:
        return []
    reg = s.runs_registration or "its registration"
    ledger = (Path(reg).with_name(f".{Path(reg).stem}.runs").as_posix()
              if s.runs_registration else "its run ledger")
    rows = [(f"`{r.run_id}`", r.created_utc or "—",
             r.recorded, r.verdict, r.found_in) for r in s.registration_runs]
    n = len(rows)
    lead = ("This is the only run of" if n == 1 else f"{n} runs were recorded under")
    if s.runs_ledger_found is False:
        # the run was recorded elsewhere (a lent GPU) and only its data folder came back
        known = (f"{lead} `{reg}` that this run's folder knows. Its run ledger (`{ledger}`, "
                 "written by `bistat run` as each run starts) is not here: the run was recorded "
                 "on another machine, so a run recorded there and not brought back cannot be "
                 "listed.")
    else:
        known = (f"{lead} `{reg}` that its run ledger (`{ledger}`, written by `bistat run` as "
                 "each run starts) and this run's folder know.")
    return ["## Runs of this registration", "",
            known + " Every run of a registration is listed with its verdict under this "
            "finding's rule, so that none can be left out for its result.", "",
            md_table(("run", "created (UTC)", "recorded", "verdict", "found in"), rows), ""]


def _rule(s: RunSummary) -> list[str]:
    rule = s.declaration.get("rule", {})
    out = ["## Decision rule (as registered)", "",
           "The rule exactly as sealed in the registration:", "",
           "```json", json.dumps(rule, indent=2, ensure_ascii=False), "```", "",
           f"Match unit: `{s.match_unit}`; multiple passes: `{s.multi_pass}`.", ""]
    try:
        speed = speed_as_evidence_warnings(Rule.model_validate(rule))
    except ValueError:  # a rule the classifier read is valid; an unreadable one says nothing here
        speed = []
    if speed:
        out += ["How to read it: this rule reads speed as evidence about the mode, so a faster "
                "invariant kernel with the same outputs can get a worse label under it (the "
                "label stands as registered):", "", *(f"- {w}." for w in speed), ""]
    return out


def _amendments(s: RunSummary) -> list[str]:
    out = ["## Amendments", ""]
    if not s.amendments:
        return out + ["None: the registration was not amended.", ""]
    rows = []
    for i, a in enumerate(s.amendments, start=1):
        rows.append((str(i), str(a.get("time_utc", "—")), str(a.get("reason", "—")),
                     f"`{a.get('old_declaration_sha256', '—')}`",
                     f"`{a.get('new_declaration_sha256', '—')}`",
                     f"`{a.get('previous_sha256', '—')}`"))
    return out + [md_table(("#", "time (UTC)", "reason", "declaration before (SHA-256)",
                            "declaration after (SHA-256)", "seal replaced"), rows), ""]
