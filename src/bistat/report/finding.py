"""``RunSummary`` + verdicts -> the markdown finding ``findings/NAME.md`` and its PNG plots.

This layer formats finished results and computes no statistic (criterion.rs' ``Report``, STYLE.md
§6). The output is a function of the summary and of the seal's evidence (``seal``, the one line
``Seal: ...`` that :mod:`bistat.report.seal` computes from git and the signature): no clock is
read, no absolute path is printed, numbers have fixed formats and plots are saved
deterministically (``bistat.report.plots``), so regenerating a finding from the same records in
the same repository gives byte-identical files.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from bistat.engines.registry import capabilities
from bistat.analysis.results import RunSummary, engine_name
from bistat.analysis.timing import FRONT_END_BOUND_SHARE, MIN_SAMPLES_FOR_SHARE  # the first re-exported
from bistat.core.classify import format_decided
from bistat.report.index import RELEASE_COMPARISON_TITLE
from bistat.core.rule import CostRule, Rule, speed_as_evidence_warnings
from bistat.declare.release_log import release_log_path
from bistat.report.anatomy import plot_anatomy, render_anatomy_section
from bistat.report.plots import PLOTS, save_plots
from bistat.report.seal import SealEvidence
from bistat.core.markdown import md_cell, md_table
from bistat.analysis.probe_report import filler_line
from bistat.analysis.serial import MIN_PAIRS_CHECKED

#: Suffix of the divergence-anatomy plot (``NAME-anatomy.png``), drawn by ``bistat.report.anatomy``.
ANATOMY_PLOT = "anatomy"

__all__ = ["FindingExistsError", "FindingFiles", "finding_run", "render_markdown", "write_finding",
           "render_version_comparison"]


@dataclass(frozen=True)
class FindingFiles:
    """The files a finding consists of."""

    markdown: Path
    plots: tuple[Path, ...]


# --------------------------------------------------------------------------------------------
# formatting helpers


def _f(x: float | None, digits: int = 4) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def _decided_cell(observed: Any, limit: Any) -> str:
    """A validity check's observed value, rounded once and never across its limit."""
    if isinstance(observed, float) and isinstance(limit, (int, float)) \
            and not isinstance(limit, bool):
        return format_decided(observed, [float(limit)], 4, significant=True)
    return md_cell(observed)


def _int(x: int | None) -> str:
    return "—" if x is None else str(x)


def _met(x: bool | None) -> str:
    return {True: "**met**", False: "not met", None: "not evaluable"}[x]


def _bullets(items: Iterable[str], empty: str) -> str:
    items = list(items)
    return "\n".join(f"- {x}" for x in items) if items else empty


# --------------------------------------------------------------------------------------------
# sections


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


def _environment(s: RunSummary) -> list[str]:
    out = ["## Environment", ""]
    if not s.environments:
        return out + ["No environment fingerprint was recorded.", ""]
    names = [a for a, _ in s.environments]
    envs = dict(s.environments)
    rows = [("engine", *[envs[a].engine for a in names]),
            ("engine starts", *[str(envs[a].n_starts) for a in names]),
            ("GPU", *[", ".join(envs[a].gpus) or "none" for a in names]),
            ("host", *[envs[a].host or "—" for a in names])]
    keys = [k for k, _ in envs[names[0]].versions]
    for k in keys:
        rows.append((k, *[dict(envs[a].versions).get(k) or "not installed" for a in names]))
    rows += _engine_rows(s, names)
    servers = {r.arm: r for r in s.servers}
    if servers:
        rows += [("server (as it declares itself)",
                  *[servers[a].describe() if a in servers else "not recorded" for a in names]),
                 ("server declares", *[servers[a].settings_text() if a in servers else "—"
                                       for a in names])]
    arm_env = {a["name"]: a.get("env") or {} for a in s.declaration.get("arms", [])}
    rows.append(("declared env", *[", ".join(f"`{k}={v}`" for k, v in sorted(
        arm_env.get(a, {}).items())) or "—" for a in names]))
    rows += _gemm_table_rows(s, names)
    return out + [md_table(("", *names), rows), ""]


def _gemm_table_rows(s: RunSummary, names: Sequence[str]) -> list[tuple[str, ...]]:
    """The tuned GEMM's table per arm and which table served how many shapes, as its engine log
    says (bistat.analysis.activation.logged_gemm_tables); no rows where no arm logged one."""
    acts = {a.arm: a for a in s.activation}
    if not any(a.gemm_table for a in acts.values()):
        return []
    return [("tuned GEMM table (engine log)",
             *["; ".join(acts[a].gemm_table) if a in acts and acts[a].gemm_table else "—"
               for a in names]),
            ("tuned GEMM shapes by table (engine log)",
             *[", ".join(f"{src}: {n}" for src, n in acts[a].gemm_shapes)
               if a in acts and acts[a].gemm_shapes else "—" for a in names])]


def _engine_rows(s: RunSummary, names: Sequence[str]) -> list[tuple[str, ...]]:
    """The environment table's rows for the engine's commit and each arm's compilation and
    CUDA-graph modes (vLLM engines; bistat.declare.engine_version)."""
    ev = s.engine_version
    if ev is None or ev.package is None:
        return []
    by_arm = {a.arm: a for a in ev.arms}
    modes = {a: by_arm[a].modes.describe() if a in by_arm and by_arm[a].modes else None
             for a in names}
    return [("engine commit", *[(by_arm[a].commit if a in by_arm else None) or "—" for a in names]),
            ("compilation", *[m[0] if m else "not recorded" for m in modes.values()]),
            ("CUDA graphs", *[m[1] if m else "not recorded" for m in modes.values()])]


def _engine_version_section(s: RunSummary) -> list[str]:
    """How the engine version measured compares with the newest release known and with the
    version the registration requires (vLLM engines; bistat.declare.engine_version)."""
    ev = s.engine_version
    if ev is None or ev.package is None:
        return []
    rows = [(ev.label(where, c), c.newest or "unknown", c.checked_utc, c.index, c.error or "—")
            for where, c in ev.checks]
    out = ["## Engine version", "", *[f"{line}" for line in ev.comparison], ""]
    if rows:
        out += [f"Newest {ev.package} release, as recorded (the comparison uses the latest check "
                "that found one):", "",
                md_table(("checked", "newest release", "time (UTC)", "index", "why unknown"), rows),
                ""]
        if any(where in ("check-release", "amend") for where, _ in ev.checks):
            log = (f"`{release_log_path(s.registration_path).as_posix()}`"
                   if s.registration_path else "`NAME.releases.jsonl` beside it")
            out += [f"Checks made after the registration was sealed come from its release log "
                    f"({log}: `bistat check-release`, `bistat register --amend`), hashed and "
                    "chained; the seal itself records only the check made at registration.", ""]
    out += [f"Required version (`engine.required_version`): `{ev.required}`; "
            + ("every arm ran a version it allows." if not ev.deviations
               else "arms ran versions it excludes (see Deviations).")
            if ev.required else "The registration requires no engine version.", ""]
    return out


def _activation(s: RunSummary) -> list[str]:
    """What each arm asked for and the evidence that it was on (bistat.analysis.activation)."""
    if not s.activation:
        return []
    probe_cmd = "`bistat probe REGISTRATION --output RUN_DIR/probe.json`"
    parts = []
    if len(s.probe_files) > 1:
        controls = [a.arm for a in s.probe.arms if a.role == "negative_control"] if s.probe else []
        power = ("so one part's negative control gives the others their power" if controls else
                 "but no part ran a negative control (`--control`), so an arm's needle staying "
                 "identical confirms nothing, whatever another probed arm showed")
        parts = [f"The probe ran in {len(s.probe_files)} parts ("
                 + ", ".join(f"`{f}`" for f in s.probe_files)
                 + f"): the same needle and settings on different arms, judged together, {power}.",
                 ""]
    if not (s.engine_kind or "").startswith("vllm"):
        served = any(a.server is not None for a in s.activation)
        backends = bool(s.servers) and any(a.attention for a in s.activation)
        rows = [(a.arm, a.role, ", ".join(f"`{r}`" for r in a.requested) or "—",
                 *((a.server or "not recorded",) if served else ()),
                 *((", ".join(a.attention) or "—",) if backends else ()),
                 (a.probe or "not run").replace("_", " "), a.status) for a in s.activation]
        header = ("arm", "role", "requested (vs control)",
                  *(("server (as it declares itself)",) if served else ()),
                  *(("attention backend (server)",) if backends else ()), "probe", "status")
        note = ([] if not s.servers else [
            "What each arm's server declares about itself (`GET /version` and its model list; "
            "SGLang's `/server_info`) is recorded at every engine start and compared with the "
            "control's: a server that declares nothing leaves the arm's settings *unknown*.", ""])
        return ["## Activation", "",
                f"A setting is *requested* until a behavioural probe with a negative control "
                f"confirms it ({probe_cmd}).", "", *note, *parts,
                md_table(header, rows), "", *_probe_detail(s)]
    flag = {True: "yes", False: "no", None: "—"}
    rows = [(a.arm, a.role, ", ".join(f"`{r}`" for r in a.requested) or "—",
             "**no**" if a.bi_requested and a.bi_kernels_logged is False
             else flag[a.bi_kernels_logged],
             flag[a.tuned_gemm_logged], ", ".join(a.attention) or "—",
             (a.probe or "not run").replace("_", " "), a.status)
            for a in s.activation]
    return ["## Activation", "",
            "vLLM prints no line saying that batch-invariant mode is on, so a setting is "
            f"*requested* until a behavioural probe with a negative control confirms it "
            f"({probe_cmd}). The engine's log, kept at every start, gives circumstantial "
            "evidence: the batch-invariant kernels registering, bistat's tuned GEMM installing "
            "itself, the attention backend chosen.", "", *parts,
            md_table(("arm", "role", "requested (vs control)", "batch-invariant kernels in log",
                      "tuned GEMM in log", "attention backend (log)", "probe", "status"), rows), "",
            *_probe_detail(s)]


def _probe_detail(s: RunSummary) -> list[str]:
    """The probe's trials per arm (batch mode: the needle alone twice, then among fillers), and
    where the probe and the study disagree."""
    probe = s.probe
    if probe is None or probe.settings.mode != "batch":
        return []
    st = probe.settings
    rows = []
    for a in probe.arms:
        role = a.role.replace("_", " ")
        if a.error:
            rows.append((a.arm, role, "—", "—", "—", "—", f"could not run: {a.error}"))
            continue
        n = len(a.trials)
        rows.append((a.arm, role,
                     {True: "identical", False: "**different**", None: "—"}[a.alone_repeat_identical],
                     f"{a.n_identical} / {n}",
                     ", ".join(str(t.n_fillers) for t in a.trials), f"{a.n_shared} / {n}",
                     ", ".join(map(str, a.first_divergences)) or "—"))
    pending = (f" Not probed: {', '.join(probe.pending)}." if probe.pending else "")
    fillers = [f"{a.arm}: {filler_line(a)}" for a in probe.arms if a.n_fillers_compared is not None]
    filler_note = [] if not fillers else [
        "The fillers too: each that ran in two or more trials (among other neighbours, at another "
        "place) compared bitwise with its first trial — " + "; ".join(fillers) + ".", ""]
    study = {a.name: a for a in s.arms}
    missed = [(a, study[a.arm]) for a in probe.arms if a.arm in s.probe_missed]
    disagree = [] if not missed else [
        "**The probe and the study disagree** on " + ", ".join(
            f"{pa.arm} (needle {pa.n_needle_tokens} tokens; {sa.n_prompts_diverged} "
            f"of {sa.n_prompts} prompts diverged across the counted passes)" for pa, sa in missed)
        + ": the probe saw no difference there. A needle"
        + (" and its fillers" if any(pa.n_fillers_compared for pa, _ in missed) else "")
        + f" of {st.max_tokens} tokens at most in {st.trials} trial(s) "
        + ("are" if any(pa.n_fillers_compared for pa, _ in missed) else "is")
        + " weaker evidence than every prompt of every pass; the study's match counts decide."
        + (" To aim the probe at what the study saw, `bistat probe --needle-from` with this "
           "run's directory takes as its needle the prompt that diverged first here."
           if probe.needle_source is None else ""), ""]
    src = probe.needle_source
    chosen = ("" if src is None else
              f", chosen from run `{src.run_id}` where it first diverged earliest (token "
              f"{src.position}, arm {src.arm}, pass {src.pass_index})")
    return [f"Probe (needle `{probe.needle_prompt_id}`{chosen}, {st.trials} trial(s) among "
            f"{st.min_fillers}-{st.max_fillers} fillers, {st.max_tokens} tokens, bitwise token ids "
            f"and logprobs): **{probe.outcome.replace('_', ' ')}** — {probe.reason}.{pending}", "",
            md_table(("arm", "role", "needle alone, twice", "identical among fillers",
                      "fillers per trial", "needle shared an engine step",
                      "first divergence (token)"), rows), "", *filler_note, *_probe_needles(s), *disagree]


def _probe_needles(s: RunSummary) -> list[str]:
    """A kv-sweep probe's outcome per needle (``ProbeReport.needle_outcomes``) and what each arm
    showed at it; nothing for the single design (reports written before designs)."""
    probe = s.probe
    if probe is None or not probe.settings.sweep:
        return []
    st = probe.settings
    by_arm = {a.arm: {n.needle: n for n in a.needles} for a in probe.arms if not a.error}
    rows = []
    for v in probe.needle_outcomes:
        cells = []
        for arm in by_arm:
            n = by_arm[arm].get(v.needle)
            if n is None:
                cells.append("—")
                continue
            same = n.n_identical
            where = ("" if n.kv_first_divergence is None
                     else f", first at KV length {n.kv_first_divergence}")
            repeat = "" if n.alone_repeat_identical is not False else "; alone twice **different**"
            cells.append(f"{'identical' if not n.differs else '**different**'} "
                         f"{same} / {len(n.trials)}{where}{repeat}")
        keys = "—" if v.kv_low is None else f"{v.kv_low}-{v.kv_high}"
        rows.append((v.needle, "—" if v.target_tokens is None else str(v.target_tokens),
                     md_cell(v.n_prompt_tokens), keys, *cells,
                     f"**{v.outcome.replace('_', ' ')}** — {v.reason}"))
    left = ("" if not probe.left_out else
            " Left out: " + "; ".join(probe.left_out) + ".")
    return [f"Per needle (the kv-sweep design: the needle prompt and needles of about "
            f"{', '.join(map(str, st.long_needles))} prompt tokens, {st.max_tokens} tokens each, "
            f"among fillers of {st.filler_tokens} tokens arriving while they decode; identical "
            f"in how many trials, bitwise).{left}", "",
            md_table(("needle", "design tokens", "prompt tokens", "keys decoded",
                      *[f"{arm}: in batch" for arm in by_arm], "outcome"), rows), ""]


def _match(s: RunSummary, plot: str) -> list[str]:
    out = ["## Match", ""]
    rows = []
    for a in s.arms:
        iv = a.match_interval
        rows.append((f"{a.name} ({a.role})", ", ".join(str(p) for p in a.counted_passes) or "—",
                     str(a.n_prompts_recorded), str(a.n_prompts), str(a.n_excluded_failed),
                     str(a.n_excluded_missing), str(a.n_excluded_no_logprobs),
                     str(a.n_prompts_matched), f"{a.n_matched} / {a.n_units} {a.unit}s",
                     _f(a.match_rate),
                     "—" if iv is None else f"[{iv.low:.4f}, {iv.high:.4f}]"))
    cl = f"{s.confidence_level * 100:g} %"
    out += [md_table(("arm", "counted passes", "prompts recorded", "prompts compared",
                      "excluded: failed request", "excluded: missing", "excluded: no logprobs",
                      "prompts identical in all passes", "matched units", "match rate",
                      f"{cl} Wilson interval (two-sided)"), rows), ""]
    comp_rows = []
    for c in s.comparisons:
        mc = c.mcnemar
        d = c.difference
        comp_rows.append((f"{c.treatment} vs {c.control}", str(c.n_paired),
                          "—" if mc is None else f"{mc.b} / {mc.c}",
                          "—" if mc is None else f"{mc.pvalue:.4g} ({mc.method})",
                          "—" if d is None else f"[{d.low:+.4f}, {d.high:+.4f}]"))
    out += ["Between arms (paired by prompt; McNemar on prompts identical in all passes; "
            f"Newcombe {cl} interval for treatment − control match rate):", "",
            md_table(("comparison", "paired prompts", "discordant: control only / treatment only",
                      "McNemar p", f"Newcombe {cl} difference"), comp_rows), "",
            f"![Match intervals per arm]({plot})", ""]
    return out


def _throughput(s: RunSummary, plot: str, serial_plot: str | None = None) -> list[str]:
    out = ["## Throughput", ""]
    rows = []
    for p in s.passes:
        rows.append((str(p.seq), p.arm, str(p.pass_index), p.kind, p.status,
                     "yes" if p.counted else "no", _f(p.wall_s, 3),
                     md_cell(p.n_requests), md_cell(p.n_failed), md_cell(p.output_tokens),
                     _f(p.output_tokens_per_s, 2), _f(p.requests_per_s, 3)))
    out += [md_table(("schedule position", "arm", "pass", "kind", "status", "counted", "wall s",
                      "requests", "failed", "output tokens", "output tokens/s", "requests/s"),
                     rows), ""]
    cl = f"{s.confidence_level * 100:g} %"
    ratio_rows = []
    for c in s.comparisons:
        r = c.ratio
        ratio_rows.append((f"{c.treatment} ÷ {c.control}", _f(c.ratio_point),
                           "—" if r is None else f"[{r.interval.low:.4f}, {r.interval.high:.4f}]",
                           "—" if r is None else f"{r.df:.2f}",
                           "—" if r is None else f"{r.n_treatment} / {r.n_control}"))
    out += ["Ratio of per-pass output tokens/s (geometric means; Welch interval on log "
            "throughput):", "",
            md_table(("ratio", "point", f"{cl} interval", "Welch df",
                      "passes (treatment / control)"), ratio_rows), "",
            *_paired_note(s), *_hac_note(s),
            "Wall time and requests/s are whole-pass figures; output tokens/s is what the rule "
            "compares.", "", *_starts_note(s), *_jit_note(s), *_host_note(s), *_gpu_note(s),
            f"![Per-pass throughput]({plot})",
            "", *_serial_note(s, serial_plot)]
    return out


def _paired_note(s: RunSummary) -> list[str]:
    """The cost rule's paired interval beside the Welch one, where the rule pairs the passes
    (``[rule.cost] interval = "paired"``): the interval that decided the cost."""
    rows = []
    for c in s.comparisons:
        cv = c.verdict.cost
        iv = None if cv is None else cv.interval
        if iv is not None and iv.method == "paired-log":
            rows.append((f"{c.treatment} ÷ {c.control}", _f(cv.ratio),
                         f"[{iv.low:.4f}, {iv.high:.4f}]", str(cv.n_pairs)))
    if not rows:
        return []
    cl = f"{s.confidence_level * 100:g} %"
    return ["The cost rule pairs the passes (`interval = \"paired\"`): the treatment's and the "
            "control's counted pass of one round of the schedule, which it ran side by side, and "
            "a paired t interval on the log differences. A drift that moved both arms alike "
            "cancels within a pair. This is the interval that decided the cost:", "",
            md_table(("ratio", "point", f"{cl} paired interval", "pairs"), rows), "",
            *_pairs_lines(s)]


def _hac_note(s: RunSummary) -> list[str]:
    """The cost rule's HAC interval and its make-up (``[rule.cost] interval = "hac"``): the
    interval that decided the cost, its cosine terms and critical value."""
    sp = s.serial
    rows = []
    for c in s.comparisons:
        cv = c.verdict.cost
        iv = None if cv is None else cv.interval
        hac = None if sp is None else next((p.hac for p in sp.pairs if p.treatment == c.treatment
                                            and p.control == c.control), None)
        if iv is not None and iv.method == "hac-cosine-log" and hac is not None:
            rows.append((f"{c.treatment} ÷ {c.control}", _f(cv.ratio),
                         f"[{iv.low:.4f}, {iv.high:.4f}]", str(hac.n_treatment), str(hac.terms),
                         f"{hac.critical_value:.3f}", _f(hac.variance_ratio, 2)))
    if not rows:
        return []
    rule = _cost_rule(s)
    bandwidth = "" if rule is None or rule.hac is None else (
        f", `hac_kernel = \"{rule.hac.kernel}\"`, `hac_bandwidth = "
        + (f'\"{rule.hac.bandwidth}\"`' if isinstance(rule.hac.bandwidth, str)
           else f"{rule.hac.bandwidth}`"))
    cl = f"{s.confidence_level * 100:g} %"
    return [f"The cost rule pairs the passes and allows for their serial correlation (`interval "
            f"= \"hac\"`{bandwidth}): the treatment's and the control's counted pass of one "
            "round of the schedule, and an equal-weighted cosine (EWC) interval on the log "
            "differences in schedule order "
            "(`bistat.core.serial.hac_ratio`): the mean ± t_B · √(Ω / n), Ω the mean square of "
            "the first *B* cosine transforms of the differences, t_B Student's t quantile with *B* "
            "degrees of freedom. This is the interval that decided the cost:", "",
            md_table(("ratio", "point", f"{cl} HAC interval", "pairs", "cosine terms B",
                      "critical value t_B", "long-run ÷ plain variance"), rows), "",
            *_pairs_lines(s)]


def _pairs_lines(s: RunSummary) -> list[str]:
    """Which passes the cost rule's paired or HAC interval paired, comparison by comparison: each
    pair's treatment and control pass (and their schedule positions), and the pairs whose two
    passes ran on different engine starts (``RunSummary.serial``'s pairs)."""
    if s.serial is None:
        return []
    where = {(p.arm, p.pass_index): p for p in s.passes}
    out = []
    for pair in s.serial.pairs:
        if not pair.passes:
            continue
        cells, split = [], []
        for tp, cp in zip(pair.treatment_passes, pair.passes):
            t, c = where.get((pair.treatment, tp)), where.get((pair.control, cp))
            at = "" if t is None or c is None else f" ({t.seq} / {c.seq})"
            cells.append(f"{tp} / {cp}{at}")
            if t is not None and c is not None and t.block != c.block:
                split.append(f"{tp} / {cp} (blocks {t.block} / {c.block})")
        by = {"round": "one per round of the schedule",
              "pass index": "by pass index", "position": "by position"}[pair.paired_by]
        line = (f"{pair.treatment} ÷ {pair.control}: {len(cells)} pair"
                f"{'' if len(cells) == 1 else 's'} of passes, {by} (treatment pass / control "
                f"pass, their schedule positions in parentheses): {', '.join(cells)}.")
        if split and len(split) == len(cells):
            line += (" The two passes of every pair ran on different engine starts (one engine "
                     "up at a time).")
        elif split:
            line += (f" The two passes of {len(split)} pair{'' if len(split) == 1 else 's'} ran "
                     f"on different engine starts (the run was resumed between them): "
                     f"{', '.join(split)}.")
        out += [line, ""]
    return out


_INTERVAL_NAMES = {"welch": "Welch's interval", "paired": "the paired interval",
                   "hac": "the HAC interval"}
_ASSUMES = {"welch": "each arm's passes", "paired": "the pairs of passes"}


def _coverage_cell(check) -> str:
    """What the run's correlation does to the interval's stated coverage, in words."""
    if check.interval == "hac":
        if not check.at_risk:
            return "holds at this estimate"
        more = (f"about {check.pairs_to_hold} pairs would keep it" if check.pairs_to_hold
                is not None else "no number of pairs up to 200 would keep it")
        return f"too few pairs for this correlation: {more}"
    p = "" if check.pvalue is None else f" (Ljung–Box p = {check.pvalue:.3g})"
    if check.contradicted:
        return f"contradicted: significant serial correlation{p} where it assumes none"
    if check.at_risk:
        return (f"at risk: no significant correlation{p}, but at this estimate it covers more "
                f"than {check.tolerance * 100:g} points less than stated")
    return f"holds at this estimate{p}"


def _serial_row(name: str, n: int, c) -> tuple[str, ...]:
    """A series' row: its lag-1 autocorrelation, bias-corrected only from
    :data:`MIN_PAIRS_CHECKED` values on (below, the correction says nothing), and Ljung-Box."""
    if c is None or c.lag1 is None:
        return (name, str(n), "—", "—", "—", "—", "—")
    return (name, str(n), f"{c.lag1:.2f}",
            "—" if c.lag1_corrected is None or n < MIN_PAIRS_CHECKED else
            f"{c.lag1_corrected:.2f}",
            f"{c.statistic:.2f}", str(c.lags), f"{c.pvalue:.3g}")


def _serial_note(s: RunSummary, plot: str | None) -> list[str]:
    """Each arm's passes and each comparison's pairs in pass order: their lag-1 autocorrelation
    and Ljung-Box test, what the correlation does to the stated coverage of the rule's interval,
    and a warning where it is significant (``RunSummary.serial``)."""
    sp = s.serial
    if sp is None:
        return []
    metric = ("log output tokens/s" if sp.metric == "throughput" else
              "log mean request latency")
    rows = [_serial_row(f"{a.arm} ({a.role})", a.n, a.correlation) for a in sp.arms]
    rows += [_serial_row(f"{p.treatment} ÷ {p.control}, pair differences", p.n_pairs,
                         p.differences) for p in sp.pairs]
    out = ["**Serial correlation.** Passes on one engine are not independent of the passes before "
           "them: the allocator, caches, clocks and host state carry over. Each arm's "
           f"{metric} per counted pass in pass order, and the pairs' log differences (the "
           "treatment's and the control's pass of one round of the schedule), with the lag-1 "
           "autocorrelation (and, "
           f"from {MIN_PAIRS_CHECKED} values on, with its small-sample bias removed) and the "
           "Ljung–Box test of no serial correlation (`bistat.core.serial`; significant below "
           f"p = {sp.alpha:g}):", "",
           md_table(("series", "passes", "lag-1 autocorrelation", "bias-corrected",
                     "Ljung–Box Q", "lags", "p"), rows), ""]
    name = _INTERVAL_NAMES[sp.interval]
    pct = f"{sp.confidence_level * 100:g} %"
    if sp.cost_rule:
        whose = f"The cost rule decides on {name} (`interval = \"{sp.interval}\"`)"
    else:
        whose = f"The rule has no cost rule; the throughput ratio above has {name}"
    if sp.interval == "hac":
        assumes = ("it allows for serial correlation of the pairs, up to a correlation that "
                   "depends on the number of pairs (docs/COST-INTERVALS.md)")
    else:
        assumes = f"it takes {_ASSUMES[sp.interval]} as independent"
    checked = [p for p in sp.pairs if p.check is not None]
    if checked:
        at = ("the larger of the two arms' lag-1 autocorrelations" if sp.interval == "welch"
              else "the pairs' lag-1 autocorrelation")
        cov_rows = [(f"{p.treatment} ÷ {p.control}", f"{p.check.rho:.2f}",
                     str(p.check.passes), f"{p.check.coverage * 100:.1f} %",
                     _coverage_cell(p.check)) for p in checked]
        unit = "passes per arm" if sp.interval == "welch" else "pairs"
        out += [f"{whose}: {assumes}. Its coverage at the correlation this run shows ({at}, "
                "bias-corrected, at least 0), by the AR(1) planning model "
                "(`bistat.core.design.interval_coverage`): an estimate from one run, which says "
                "how far the stated coverage may be off, not a correction:", "",
                md_table(("ratio", "lag-1 checked at", unit, f"coverage of its stated {pct}",
                          "its assumption"), cov_rows), ""]
    else:
        out += [f"{whose}: {assumes}. Too few pairs of passes (fewer than "
                f"{MIN_PAIRS_CHECKED}) to put a number on its coverage at this run's correlation: "
                "the lag-1 autocorrelation of so few says next to nothing.", ""]
    significant = sp.significant
    if significant:
        worst = min((p.check for p in checked), key=lambda c: c.coverage, default=None)
        if worst is None:
            effect = (f"With fewer than {MIN_PAIRS_CHECKED} pairs, what it does to the coverage "
                      f"of {name} cannot be put in numbers.")
        elif sp.interval == "hac":
            but = ", but not fully at these pairs" if worst.at_risk else ""
            effect = (f"The HAC interval allows for it{but}: at the correlation this run shows "
                      f"its stated {pct} covers about {worst.coverage * 100:.0f} % (the least of "
                      "the table above).")
        elif worst.at_risk:
            effect = (f"{name[0].upper()}{name[1:]} takes {_ASSUMES[sp.interval]} as independent:"
                      f" at the correlation this run shows its stated {pct} covers about "
                      f"{worst.coverage * 100:.0f} % (the least of the table above), so "
                      + ("the cost verdict rests on an interval narrower than stated"
                         if sp.cost_rule else "the ratio's interval is narrower than stated")
                      + ". `[rule.cost] interval = \"hac\"` allows for serial correlation "
                        "(docs/COST-INTERVALS.md).")
        else:
            effect = (f"{name[0].upper()}{name[1:]} takes {_ASSUMES[sp.interval]} as independent:"
                      f" at the correlation this run shows (bias-corrected, at least 0) its "
                      f"stated {pct} still covers about {worst.coverage * 100:.0f} % (the least "
                      "of the table above).")
        out += [f"**Warning: significant serial correlation** (Ljung–Box p < {sp.alpha:g}) in "
                f"{', '.join(significant)}. {effect}", ""]
    if plot is not None:
        out += [f"![Passes in pass order]({plot})", ""]
    return out


def _starts_note(s: RunSummary) -> list[str]:
    """Where an arm's counted passes ran in more than one start of its engine: whether passes of
    one start were more alike than passes of different starts, and the ratio with each start as
    one observation beside the per-pass one (a sensitivity analysis; the sealed rule decides)."""
    starts = s.engine_starts
    if starts is None:
        return []
    out = ["**Engine starts.** The counted passes ran in more than one start of their arm's "
           "engine (one engine at a time, or a resumed run). The intervals above treat every "
           "pass as independent; passes of one start share that start's speed, so where starts "
           "differ those intervals are too narrow:", "",
           md_table(("arm", "counted passes", "engine starts"),
                    [(arm, str(n), str(k)) for arm, n, k in starts.arms]), ""]
    e = starts.effect
    if e is None:
        out += ["No start held two counted passes of one arm: whether starts differ cannot be "
                "told from the passes' own scatter.", ""]
    else:
        verdict = ("passes of one start were more alike than passes of different starts: the "
                   "starts, not the passes, are the independent units here" if starts.starts_differ
                   else "no sign that passes of one start were more alike than passes of "
                        "different starts")
        out += [f"Starts within each arm, nested F test on log throughput: F({e.df_blocks}, "
                f"{e.df_resid}) = {e.f_stat:.2f}, p = {e.p_value:.3g}: {verdict}.", ""]
    cl = f"{s.confidence_level * 100:g} %"

    def iv(r) -> str:
        return ("—" if r is None else
                f"{r.ratio:.4f} [{r.interval.low:.4f}, {r.interval.high:.4f}]")
    rows = [(f"{t} ÷ {c}", iv(per_pass), iv(per_start),
             "—" if per_start is None else f"{per_start.n_treatment} / {per_start.n_control}")
            for t, c, per_pass, per_start in starts.ratios]
    out += [f"The throughput ratio with each start's geometric mean as one observation (Welch, "
            f"{cl}), beside the per-pass one; a sensitivity analysis, the sealed rule's interval "
            "still decides:", "",
            md_table(("ratio", "per pass", "per engine start", "starts (treatment / control)"),
                     rows), ""]
    return out


def _host_note(s: RunSummary) -> list[str]:
    """How busy the host was over the counted passes, and whether the slow passes were the busy
    ones (nothing for runs recorded before passes carried their host's load)."""
    load = s.host_load
    if load is None:
        return []
    rows = [(arm, str(n), f"{busy:.0%}", f"{steal:.1%}", f"{other:.0%}")
            for arm, n, busy, steal, other in load.arms]
    out = ["**Host load.** The host's CPU time during the counted passes (median per pass; "
           "*other* is CPU time used by processes other than bistat's own, where an engine "
           "running in its own process counts as other, and *stolen* is time the hypervisor "
           "gave to other guests):", "",
           md_table(("arm", "passes", "busy", "stolen", "other"), rows), ""]
    if load.rho is None:
        out += [f"Too few counted passes ({load.n}) or no spread in the load to relate pass "
                "times to it.", ""]
    else:
        verdict = ("the slower passes were the ones with more CPU time taken by other "
                   "processes: part of the pass-to-pass variation came from the host, not the "
                   "engine" if load.slow_when_busy else
                   "no sign that the host's other load set the pass times")
        out += [f"Pass time (within each arm, relative to its mean) against the *other* share, "
                f"Spearman's rho over {load.n} counted passes: {load.rho:.2f} (p = "
                f"{load.p_value:.3g}): {verdict}.", ""]
    return out


def _gpu_note(s: RunSummary) -> list[str]:
    """The GPU's SM clock, temperature and power over the counted passes, and whether the slow
    passes ran at a lower clock (nothing for runs recorded before passes sampled the GPU)."""
    clocks = s.gpu_clocks
    if clocks is None:
        return []

    def num(x: float | None, unit: str) -> str:
        return "—" if x is None else f"{x:,.0f} {unit}"
    rows = [(arm, str(n), num(med, "MHz"), num(low, "MHz"), num(hot, "°C"), num(watts, "W"),
             str(slowed)) for arm, n, med, low, hot, watts, slowed in clocks.arms]
    out = ["**GPU clocks.** The GPU the engine ran on, sampled with `nvidia-smi` during the "
           "counted passes (*SM clock* the median of the passes' means, *lowest* its lowest "
           "sample; *slowed* counts the passes in which the driver named a power or thermal "
           "reason holding the clocks down):", "",
           md_table(("arm", "passes", "SM clock", "lowest", "hottest", "power", "slowed"), rows),
           ""]
    if clocks.rho is None:
        out += [f"Too few counted passes ({clocks.n}) or no spread in the SM clock to relate "
                "pass times to it.", ""]
    else:
        verdict = ("the slower passes ran at lower SM clocks: part of the pass-to-pass variation "
                   "came from the GPU's clock, not the kernels" if clocks.slow_at_lower_clock
                   else "no sign that the SM clock set the pass times")
        out += [f"Pass time (within each arm, relative to its mean) against the pass's mean SM "
                f"clock, Spearman's rho over {clocks.n} counted passes: {clocks.rho:.2f} (p = "
                f"{clocks.p_value:.3g}): {verdict}.", ""]
    return out


def _jit_note(s: RunSummary) -> list[str]:
    """The kernels an engine JIT-compiled while serving, and in which passes (nothing when the
    logs show none): a counted pass that compiled measures the compilation too."""
    if not s.jit_compiles:
        return []
    seq = {(p.arm, p.pass_index): p.seq for p in s.passes}

    def where(j) -> str:
        if not j.passes:
            return "outside every pass of its arm"
        named = [(f"**counted pass {i}**" if kind == "counted" else
                  f"{kind.replace('warmup', 'warm-up')} pass {i}")
                 + (f" (schedule position {seq[(j.arm, i)]})" if (j.arm, i) in seq else "")
                 for i, kind in j.passes]
        return "in " + " or ".join(named)

    items = [f"{j.arm} `{j.kernel}` at {j.time_utc[11:19]} UTC, {where(j)}" for j in s.jit_compiles]
    counted = [j for j in s.jit_compiles if j.in_counted_pass]
    tail = (f" {len(counted)} of them fell in a counted pass, whose time then includes a "
            "compilation, not only the arm's steady state (warm up longer, or compile every "
            "bucket at start-up)." if counted else
            " None fell in a counted pass.")
    return ["Kernels compiled during inference (vLLM's JIT-monitor warnings in the engine logs, "
            "placed by the second they were logged): " + "; ".join(items) + "." + tail, ""]


def _divergence(s: RunSummary, plot: str) -> list[str]:
    out = ["## First divergences", "",
           "For each compared prompt that did not match, every counted pass whose output differs "
           "from the arm's first counted pass gives the token index where they first differ.", ""]
    rows = []
    with_kv = any(a.spread.kv_earliest is not None for a in s.arms)
    for a in s.arms:
        sp = a.spread
        row = [a.name, str(sp.n_prompts), str(sp.n_divergences), _int(sp.earliest),
               _int(sp.median), _int(sp.latest)]
        if with_kv:
            row += [_int(sp.kv_earliest), _int(sp.kv_median)]
        rows.append(tuple(row))
    head = ("arm", "prompts", "diverging passes", "earliest", "median (lower)", "latest")
    if with_kv:
        head += ("KV length at first divergence: earliest", "median (lower)")
        out += ["The KV length is the prompt's tokens plus the index: the keys the first "
                "differing token's attention read.", ""]
    out += [md_table(head, rows), "", *_kv_tile_boundary(s)]
    detail = [(d.arm, d.prompt_id, str(d.reference_pass), str(d.pass_index), str(d.position))
              for a in s.arms for d in a.divergences]
    if detail and len(detail) <= 200:
        out += ["<details><summary>Every divergence</summary>", "",
                md_table(("arm", "prompt", "reference pass", "pass", "first differing index"),
                         detail), "", "</details>", ""]
    elif detail:
        out += [f"{len(detail)} divergences: too many to list here; "
                "`bistat analyze --json` prints them.", ""]
    out += [f"![First-divergence positions]({plot})", ""]
    return out


def _kv_tile_boundary(s: RunSummary) -> list[str]:
    """Arms whose every first divergence lies just past a power-of-two KV length
    (``RunSummary.kv_tiles``): divergences that start exactly at tile + 1 point at the attention
    kernel's KV tile changing with the batch (FlashAttention 3 on Hopper picks its tile from the
    batch's longest query)."""
    out = []
    for kt in s.kv_tiles:
        tile = kt.tile
        which = "; ".join(f"{a.arm} (all {a.n_divergences}, {a.n_at_boundary} exactly at "
                          f"{tile + 1})" for a in kt.arms)
        out += [f"Every first divergence lies at a KV length of {tile + 1} or more in arm(s) "
                f"{which}, although every output began at {kt.min_prompt_tokens}-"
                f"{kt.max_prompt_tokens} keys. {tile} keys is one "
                f"attention tile of {tile}: up to it, any tile width reduces a row in the same "
                f"order; past it, a kernel whose KV tile width changes with the batch does not "
                f"(FlashAttention 3 on Hopper picks 128 or 192 keys per tile at head size 64 "
                f"from the batch's longest query). An attention backend with a fixed tile "
                f"(TRITON_ATTN in batch-invariant mode) is the test.", ""]
    if s.kv_tiles:
        out += _kv_tile_advice(s, [a.arm for kt in s.kv_tiles for a in kt.arms])
    return out


def _kv_tile_advice(s: RunSummary, arms: Sequence[str]) -> list[str]:
    """The attention backend and head size of ``arms`` (whose divergences start past a KV tile)
    and the remedies bistat has measured against it (:mod:`bistat.explain.remedies`)."""
    from bistat.explain.remedies import TABLE_PATH, advice_lines, load_table

    logged = {a.arm: a.attention for a in s.activation}
    model = (s.declaration.get("engine") or {}).get("model")
    lines = advice_lines({arm: logged.get(arm, ()) for arm in arms}, model, load_table())
    return [f"What those arms ran and what bistat has measured against it (`{TABLE_PATH}`):", "",
            *[f"- {x}" for x in lines], ""]


def _batching(s: RunSummary, plot: str) -> list[str]:
    out = ["## Batching", "",
           "From the engine's metrics samples of each pass; *in flight* is what bistat had "
           "submitted and not yet received back (time-weighted, from the responses' times).", ""]
    rows = [(str(p.seq), p.arm, str(p.pass_index), p.kind, str(p.n_metric_samples),
             _f(p.client_in_flight, 2), _f(p.mean_running, 2), _f(p.max_running, 0),
             _f(p.mean_waiting, 2), _f(p.preemptions, 0)) for p in s.passes]
    out += [md_table(("schedule position", "arm", "pass", "kind", "samples", "mean in flight",
                      "mean running", "max running", "mean waiting", "preemptions"), rows), ""]
    share = s.running_share
    if share is not None and not share.compared:
        out += [f"Too few engine metric samples to tell how the engine batched: every counted "
                f"pass has at most {share.most_samples} (at least {MIN_SAMPLES_FOR_SHARE} are needed; the "
                "first and last samples of a pass read the engine's gauges before and after "
                "its work), so the running batch is not compared with the requests in flight.",
                ""]
    # an engine without a front end takes requests straight into its scheduler: the front-end
    # diagnosis does not apply to it
    if share is not None and share.compared and not capabilities(s.engine_kind or "").front_end:
        out += [f"Engine kind {s.engine_kind}: bistat hands requests straight to the engine "
                "(no API server), so no front end stands between the requests in flight and "
                "the running batch; the gauges are read between engine steps and lag them.", ""]
    elif share is not None and share.compared:
        low, high, at = share.low, share.high, share.lowest
        where = f"{at.arm} pass {at.pass_index} (schedule position {at.seq})"
        if share.front_end_bound:
            out += [f"**The front end, not the engine, set the batch:** in counted passes the "
                    f"engine's running batch was {low:.0%}–{high:.0%} of the requests in flight "
                    f"(lowest: {where})"
                    + (", with none waiting in its scheduler, so the others sat in the server's "
                       "front end (API server, tokenization, output processing) or the client."
                       if share.none_waiting else "; the rest waited in its scheduler.")
                    + " The throughput ratios then compare front ends as much as engines.", ""]
        else:
            out += [f"In counted passes the engine's running batch was {low:.0%}–{high:.0%} of "
                    f"the requests in flight (lowest: {where}).", ""]
    out += _beyond_graphs(s)
    out += [f"![Running requests over time]({plot})", ""]
    return out


def _beyond_graphs(s: RunSummary) -> list[str]:
    """Where the running batch outgrew the engine's CUDA graphs (steps beyond the CUDA-graph
    sizes launch every kernel from the host, where a launcher's per-call cost shows)."""
    found = s.beyond_graphs
    if not found:
        return []
    if all(b.seconds_beyond == 0 for b in found):
        sizes = sorted({b.sizes.max_capture_size for b in found})
        return [f"CUDA graphs: no metrics sample of a counted pass had more requests running "
                f"than the engine's largest CUDA-graph size ({' / '.join(map(str, sizes))} "
                "tokens, from its logged configuration), so no decode step outgrew the graphs "
                "(a prefill step can, in tokens).", ""]
    rows = []
    for b in found:
        t, beyond = b.per_pass
        decode = (f"; full decode graphs to {b.sizes.max_decode_requests} requests"
                  if b.sizes.max_decode_requests is not None else "")
        graphs = ("NONE: no step replays a graph" if b.sizes.cudagraph_mode == "NONE" else
                  f"{b.sizes.cudagraph_mode or 'unknown'}, {b.sizes.max_capture_size} "
                  f"tokens{decode}")
        rows.append((b.arm, graphs, str(b.n_passes), _f(t, 3), _f(beyond, 3),
                     f"{b.share:.1%}"))
    out = ["**Steps beyond the CUDA-graph sizes.** A step with more requests running than the "
           "engine's largest CUDA-graph size has more tokens than any captured graph and runs "
           "without one, every kernel launched from the host. Time-weighted from the metrics "
           "samples of the counted passes, so a lower bound (a prefill step outgrows the graphs "
           "with fewer requests) read at the samples' resolution:", "",
           md_table(("arm", "CUDA graphs (logged: mode, largest size)", "counted passes",
                     "seconds per pass", "of them beyond the largest size", "share"), rows), ""]
    by_arm = {b.arm: b for b in found}
    roles = {a.name: a.role for a in s.arms}
    controls = [a for a, r in roles.items() if r == "control" and a in by_arm]
    for arm in (a for a, r in roles.items() if r == "treatment" and a in by_arm):
        for control in controls:
            extra, extra_beyond = by_arm[arm].extra_over(by_arm[control])
            if extra > 0:
                out.append(f"- {arm} took {extra:.3f} s more per counted pass than {control}, "
                           f"{extra_beyond:.3f} s of it with more requests running than the "
                           "largest graph size.")
    if out[-1] != "":
        out.append("")
    return out


def _validity(s: RunSummary) -> list[str]:
    out = ["## Validity checks", ""]
    if s.exploratory:
        out += ["Whether the registration precedes the data is not checked here: this rule was "
                f"sealed at {s.sealed_utc}, after the run's first record ({s.created_utc}), so "
                "the analysis is exploratory (first line).", ""]
    rows = [(v.name, _decided_cell(v.observed, v.limit), md_cell(v.limit),
             {True: "passed", False: "**failed**", None: "not evaluable"}[v.passed], v.detail)
            for v in s.validity]
    out += [md_table(("check", "observed", "limit", "result", "detail"), rows) if rows
            else "No validity check was declared.", ""]
    out += [f"Run status: {'testable' if s.status.testable else 'not testable'}"
            + (f" ({s.status.reason})." if s.status.reason else "."), ""]
    return out


def _failed_requests(s: RunSummary) -> list[str]:
    """The run's failed requests grouped by their error, the first texts quoted: what stopped the
    engine from answering, not only that it did not (a run without failures has no section)."""
    fr = s.failed_requests
    if fr is None or not fr.total:
        return []
    arms = ", ".join(f"{arm} {n}" for arm, n in fr.by_arm if n)
    rows = [(str(g.count), md_cell(g.first[:400] + ("..." if len(g.first) > 400 else "")))
            for g in fr.groups[:5]]
    rest = fr.groups[5:]
    more = ([f"{len(rest)} other error(s), {sum(g.count for g in rest)} request(s), not "
             "shown.", ""] if rest else [])
    return ["## Failed requests", "",
            f"{fr.total} of {fr.n_records} recorded requests failed (every pass, warm-ups "
            f"included; by arm: {arms}). Their errors, grouped where the texts agree but for "
            "numbers (ids, lengths, counts), each with its first text as recorded:", "",
            md_table(("requests", "first error"), rows), "", *more]


def _notes(s: RunSummary) -> list[str]:
    """The operator's ``NOTES.md``, quoted: stated by whoever ran it, not computed."""
    if not s.operator_notes:
        return []
    quoted = "\n".join(("> " + line).rstrip() for line in s.operator_notes.splitlines())
    return ["## Operator's notes", "",
            "Quoted from `NOTES.md` in the run directory: what the person who ran it states "
            "(why something was not run, what happened on the machine). Not computed from the "
            "records.", "", quoted, ""]


def _tail(s: RunSummary) -> list[str]:
    return ["## Deviations", "", _bullets(s.deviations, "None recorded."), "",
            "## Not run", "", _bullets(s.not_run, "Everything declared was run."), "",
            *_notes(s),
            "## Data gaps", "", _bullets(s.gaps, "None: every record line was readable."), "",
            "---", "",
            "Generated by `bistat analyze` from the recorded data; every number above is "
            "recomputed from the records, and regenerating gives the same bytes.", ""]


def _anatomy(s: RunSummary, plot: str | None) -> list[str]:
    if s.anatomy is None:
        return []
    return [render_anatomy_section(s.anatomy, plot)]


def _latency(s: RunSummary) -> list[str]:
    """Batch latency, for workloads of one batch per pass (``n_prompts == concurrency``: the
    published latency workload, as ``vllm bench latency --batch-size`` measures it)."""
    lat = s.batch_latency
    if lat is None:
        return []
    rows = [(a.arm, str(a.n_passes), _f(a.median_s, 4), _f(a.p90_s, 4),
             _f(a.median_ms_per_token, 3)) for a in lat.arms]
    cl = f"{s.confidence_level * 100:g} %"
    ratio_rows = [(f"{r.treatment} ÷ {r.control}", _f(r.point), f"[{r.low:.4f}, {r.high:.4f}]")
                  for r in lat.ratios]
    return ["## Batch latency", "",
            f"One batch of {lat.n_prompts} requests per pass: a pass's wall time is the "
            "batch latency; time per output token is that latency divided by the tokens each "
            "request generated. Counted passes with a failed request are left out (their wall "
            "time is not a batch's latency).", "",
            md_table(("arm", "counted passes", "median latency s", "p90 latency s",
                      "median ms per output token"), rows), "",
            "Latency ratio (the inverse of the throughput ratio and of its interval):", "",
            md_table(("ratio", "point", f"{cl} interval"), ratio_rows), ""]


def render_markdown(summary: RunSummary, plot_files: dict[str, str] | None = None, *,
                    seal: SealEvidence | None = None) -> str:
    """The finding as markdown. ``plot_files`` maps plot suffix -> file name beside it;
    ``seal`` (:func:`bistat.report.seal.seal_evidence`) gives the ``Seal: ...`` line under the
    verdict, which ``bistat analyze`` always writes (without it the line is left out)."""
    suffixes = [suffix for suffix, _, _ in PLOTS] + [ANATOMY_PLOT]
    plots = plot_files or {suffix: f"{summary.name}-{suffix}.png" for suffix in suffixes}
    parts = (_head(summary, seal) + _summary(summary) + _verdict(summary) + _siblings(summary)
             + _registration_runs(summary) + _rule(summary)
             + _amendments(summary)
             + _environment(summary) + _engine_version_section(summary)
             + _activation(summary) + _match(summary, plots["match"])
             + _throughput(summary, plots["throughput"], plots.get("serial"))
             + _latency(summary)
             + _divergence(summary, plots["divergence"])
             + _anatomy(summary, plots.get(ANATOMY_PLOT))
             + _batching(summary, plots["running"]) + _validity(summary)
             + _failed_requests(summary) + _tail(summary))
    return "\n".join(parts).rstrip("\n") + "\n"


class FindingExistsError(ValueError):
    """The finding would replace another run's finding of the same name."""


_RUN_ROW = re.compile(r"^\| Run \| `(?P<run>.+)` \|\s*$", re.MULTILINE)


def finding_run(path: str | Path) -> str | None:
    """The run a finding file was written from (its head table's ``Run`` row); None when the
    file has none (not a finding written by ``bistat analyze``)."""
    try:
        m = _RUN_ROW.search(Path(path).read_text(encoding="utf-8", errors="replace"))
    except OSError:
        return None
    return None if m is None else m["run"]


def write_finding(summary: RunSummary, out_dir: str | Path, *,
                  seal: SealEvidence | None = None, force: bool = False) -> FindingFiles:
    """Write ``out_dir/NAME.md`` and its plots ``out_dir/NAME-*.png``; return the paths.

    The plots are :data:`bistat.report.plots.PLOTS` and, with an anatomy, ``NAME-anatomy.png``
    (``bistat.report.anatomy.plot_anatomy``). ``seal``: as for :func:`render_markdown`.

    Raises
    ------
    FindingExistsError
        ``out_dir/NAME.md`` is the finding of another run (of the same registration), unless
        ``force``: a second run's analysis never silently replaces the first run's finding.
    """
    out = Path(out_dir)
    md = out / f"{summary.name}.md"
    other = finding_run(md) if md.exists() and not force else None
    if other is not None and other != summary.run_id:
        raise FindingExistsError(
            f"{md} is the finding of run {other}; this is run {summary.run_id}, and writing its "
            f"finding there would replace that run's. Write it elsewhere (--out DIR), or replace "
            f"it with --force (both runs stay listed under 'Runs of this registration')")
    out.mkdir(parents=True, exist_ok=True)
    paths = save_plots(summary, out, summary.name)
    if summary.anatomy is not None:
        paths[ANATOMY_PLOT] = plot_anatomy(summary.anatomy,
                                           out / f"{summary.name}-{ANATOMY_PLOT}.png")
    text = render_markdown(summary, {k: p.name for k, p in paths.items()}, seal=seal)
    md.write_bytes(text.encode("utf-8"))
    return FindingFiles(md, tuple(paths.values()))


def render_version_comparison(vc: Any) -> str:
    """Markdown for a ``bistat.analysis.version_compare.VersionComparison``: the two releases side by side."""
    def iv(x):
        return "—" if x is None else f"[{x.low:.4f}, {x.high:.4f}]"

    def num(x):
        return "—" if x is None else f"{x:.4f}"

    def yes(b: bool | None) -> str:
        return "not compared (rules differ)" if b is None else "**yes**" if b else "no"

    cl = f"{vc.confidence_level * 100:g} %"
    e, l = vc.earlier_engine, vc.later_engine
    lines = [f"{RELEASE_COMPARISON_TITLE}{vc.earlier_run} ({e}) → {vc.later_run} ({l})", "",
             "Generated by `bistat compare` from the two runs' recorded data, each analysed "
             "against the registration it was recorded under; the numbers are those of the two "
             "findings. A change is called by fixed rules "
             "(`bistat.analysis.version_compare`): the match rate's"
             f" {cl} Newcombe interval of (later − earlier) excludes 0; the verdict's "
             "label differs; the two cost-ratio intervals do not overlap; the engine's recorded "
             "mode differs.", "",
             md_table(("", vc.earlier_run, vc.later_run), [
                 ("engine", e, l),
                 ("registration", f"`{vc.earlier_registration or '—'}`",
                  f"`{vc.later_registration or '—'}`"),
                 ("GPU", ", ".join(vc.earlier_gpus) or "—", ", ".join(vc.later_gpus) or "—")]),
             "", "## Per arm", "",
             md_table(("arm", "run", "engine", "backend", "mode", "matched / compared",
                       f"{cl} interval", "invariant?", "cost", "ratio", "ratio interval"),
                      [row for c in vc.arms for row in (
                        (c.earlier.arm, f"`{vc.earlier_run}`", c.earlier.engine_version or e,
                         c.earlier.backend, c.earlier.modes or "—",
                         f"{c.earlier.n_matched} / {c.earlier.n_units}",
                         iv(c.earlier.match_interval), f"*{c.earlier.verdict}*"
                         if c.earlier.verdict else "(control)", c.earlier.cost or "—",
                         num(c.earlier.ratio), iv(c.earlier.ratio_interval)),
                        (c.later.arm, f"`{vc.later_run}`", c.later.engine_version or l,
                         c.later.backend, c.later.modes or "—",
                         f"{c.later.n_matched} / {c.later.n_units}",
                         iv(c.later.match_interval), f"*{c.later.verdict}*"
                         if c.later.verdict else "(control)", c.later.cost or "—",
                         num(c.later.ratio), iv(c.later.ratio_interval)))]),
             "", "## What changed", "",
             md_table(("arm", f"match rate, later − earlier ({cl} Newcombe)", "match changed",
                       "verdict changed", "cost changed", "mode changed", "upstream"),
                      [(c.later.arm if c.later.arm == c.earlier.arm
                        else f"{c.earlier.arm} → {c.later.arm}",
                        iv(c.match_difference), yes(c.match_changed), yes(c.verdict_changed),
                        yes(c.cost_changed), yes(c.mode_changed), c.explanation())
                       for c in vc.arms]), ""]
    if vc.only_earlier or vc.only_later:
        lines += [f"Arms in one run only: {', '.join(vc.only_earlier) or 'none'} "
                  f"({vc.earlier_run}); {', '.join(vc.only_later) or 'none'} ({vc.later_run}). "
                  "Their results are in that run's finding.", ""]
    if vc.earlier_version is None or vc.later_version is None:
        upstream = ("Not looked up: `src/bistat/data/vllm_changes.toml` lists vLLM's changes, "
                    "and these runs are not both on vLLM.")
    elif vc.upstream:
        upstream = (f"From `src/bistat/data/vllm_changes.toml` (each read in the released "
                    f"wheels): {len(vc.upstream)} between {e} and {l}.")
    else:
        upstream = f"`src/bistat/data/vllm_changes.toml` holds no change between {e} and {l}."
    lines += ["## Upstream changes between the two releases", "", upstream, ""]
    if vc.upstream:
        lines += [md_table(("change", "kind", "touches", "what", "source"),
                           [(u.reference, u.kind, ", ".join(u.components), u.summary, u.source)
                            for u in vc.upstream]), ""]
    same = ("None: the same workload, on GPUs of the same model." if vc.earlier_gpus
            else "None: the same workload, both runs without a GPU.")
    lines += ["## Differences of design", "", _bullets(vc.notes, same), ""]
    return "\n".join(lines)
