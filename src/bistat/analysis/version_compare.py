"""One study on two engine releases (or any two runs of it), side by side: what changed, and
what upstream changed.

Any two runs compare, of any engine: each side names the engine its run measured from its
fingerprints (:func:`bistat.analysis.results.engine_name`), each row says which run it is from,
and the upstream table (vLLM's) is looked up only when both runs are on vLLM.

"Benchmarks run on the latest release or they don't count": when a study is re-run on a newer
engine release, its reader needs the two results beside each other -- per arm, the match counts
and intervals, the verdict, the cost statement and the ratio, the mode the engine ran in -- and
which differences the data support. ``compare_versions`` takes the two analysed runs
(``bistat.analysis.summary.RunSummary``, each against the registration it was recorded under) and an arm
mapping, and returns a frozen ``VersionComparison``; ``bistat.report.finding.render_version_comparison``
formats it; ``bistat compare`` runs both.

What counts as a change (fixed, so that the words cannot be chosen after seeing the numbers):

- *match rate*: the Newcombe interval of (later - earlier) match rate, treating the two runs as
  independent samples (``bistat.core.stats.newcombe_difference``), excludes 0. The runs share their
  prompts, but a prompt's outcome in one run says nothing about the other's engine, so the
  independent-samples interval is the conservative choice;
- *verdict*: the label differs, both runs analysed under the same decision rule (with different
  rules a label says as much about the rule as about the release: the comparison then says the
  verdicts are not comparable; analyse the earlier run under a sibling registration with the
  later run's rule, e.g. its ``-exploratory`` one, to compare them);
- *cost*: the two ratio intervals (each from its run's repeat passes) do not overlap;
- *mode*: the compilation / CUDA-graph mode recorded at the arm's engine start differs.

Upstream changes between the two versions come from a data table with provenance
(``bistat/data/vllm_changes.toml``): each entry names the components it touches (``gemm``,
``compile``, ``tuned-shapes``, an attention backend) and whether it changed behaviour or left a known problem as it
was. The comparison lists, per arm, the entries touching what that arm ran; whether they explain
a change is said only as far as the table's words and the data allow: a change with no entry
touching its arm is reported as unexplained, an entry with no change beside it as not borne out
(or, for a problem left open upstream, as consistent with the unchanged result).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from importlib import resources
from typing import Any, Mapping, Sequence

from packaging.version import InvalidVersion, Version

from bistat.analysis.results import DivergenceSpread, engine_name
from bistat.core import stats

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = [
    "UpstreamChange",
    "ArmSide",
    "ArmChange",
    "VersionComparison",
    "VersionCompareError",
    "load_upstream_changes",
    "compare_versions",
    "engine_family",
    "setups",
]


class VersionCompareError(ValueError):
    """Two runs that cannot be set side by side, with what to do."""


@dataclass(frozen=True)
class UpstreamChange:
    """One upstream change between releases (``vllm_changes.toml``)."""

    key: str
    introduced: str          # the first release that has it
    components: tuple[str, ...]
    kind: str                # "changed" | "unchanged" (a known problem left as it was)
    summary: str
    reference: str           # upstream PR / issue
    source: str              # where bistat read it (file and release)


@dataclass(frozen=True)
class ArmSide:
    """One arm in one run."""

    arm: str
    role: str
    engine_version: str | None           # the engine this arm ran, from its fingerprint
    modes: str | None                    # "compilation / CUDA graphs", as recorded
    backend: str                         # the engine kind and attention backend(s) logged
    n_matched: int
    n_units: int
    match_interval: stats.Interval | None
    verdict: str | None                  # treatments: the label
    cost: str | None                     # treatments: the cost outcome, if the rule has one
    ratio: float | None                  # treatments: the throughput (or latency) ratio
    ratio_interval: stats.Interval | None
    #: the prompts that diverged across its counted passes and where their first divergences lie
    spread: DivergenceSpread | None = None


@dataclass(frozen=True)
class ArmChange:
    """One arm on both releases, and what the fixed rules above call a change."""

    earlier: ArmSide
    later: ArmSide
    match_difference: stats.Interval | None   # later - earlier match rate, Newcombe
    match_changed: bool
    verdict_changed: bool | None             # None: the runs' rules differ
    cost_changed: bool
    mode_changed: bool
    upstream: tuple[UpstreamChange, ...]      # the entries touching what this arm ran
    #: both runs are on vLLM, whose upstream changes bistat's table lists
    upstream_known: bool = True
    #: both runs drove one engine (two of its releases, or one release twice); False: two engines
    same_engine: bool = True

    @property
    def changed(self) -> bool:
        return self.match_changed or bool(self.verdict_changed) or self.cost_changed

    def explanation(self) -> str:
        """One fixed sentence on what the upstream table says about this arm's result."""
        if self.later.role == "control":
            return "the control: the mode is off, its divergence is what the mode exists for"
        if not self.same_engine:
            return (("differs" if self.changed else "the same") + " between the engines (two "
                    "engines, not two releases: what each ran is under \"The two setups\")")
        if not self.upstream_known:
            return ("changed" if self.changed else "unchanged") + (
                " (bistat's table of upstream changes is vLLM's; not looked up)")
        behaviour = [u for u in self.upstream if u.kind == "changed"]
        open_ = [u for u in self.upstream if u.kind == "unchanged"]
        if self.changed and behaviour:
            return ("changed; upstream changes touching what it ran: "
                    + ", ".join(u.reference for u in behaviour) + " (a candidate explanation, not "
                    "a tested one)")
        if self.changed:
            return "changed; no upstream change in bistat's table touches what it ran: unexplained"
        if open_:
            return ("unchanged, as the upstream problem left open implies: "
                    + ", ".join(u.reference for u in open_))
        if behaviour:
            return ("unchanged although upstream changed what it ran ("
                    + ", ".join(u.reference for u in behaviour) + "): no visible effect here")
        return "unchanged"


@dataclass(frozen=True)
class VersionComparison:
    """A study on two releases."""

    earlier_run: str
    later_run: str
    earlier_registration: str | None
    later_registration: str | None
    earlier_version: str | None               # vLLM's version (the upstream table is vLLM's)
    later_version: str | None
    earlier_gpus: tuple[str, ...]
    later_gpus: tuple[str, ...]
    confidence_level: float
    arms: tuple[ArmChange, ...]
    only_earlier: tuple[str, ...]             # arms of the earlier run with no counterpart
    only_later: tuple[str, ...]
    same_rule: bool
    earlier_exploratory: bool                 # the earlier run analysed under a rule sealed after it
    upstream: tuple[UpstreamChange, ...]      # every table entry between the two versions
    notes: tuple[str, ...]                    # differences of design the reader must know
    #: the engine each run measured, named from its fingerprints (``vLLM 0.25.0``,
    #: ``embedded 0.1.0``, ``openai → bistat serve 0.1.0``: bistat.analysis.results.engine_name)
    earlier_engine: str = "—"
    later_engine: str = "—"
    #: both runs drove one engine; False: an engine comparison (vLLM against SGLang)
    same_engine: bool = True
    #: what each run set up, row by row (what, earlier, later), for an engine comparison:
    #: :func:`setups`
    setups: tuple[tuple[str, str, str], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready data (``bistat compare --json``)."""
        from dataclasses import asdict

        data = asdict(self)
        data["arms"] = [dict(d, changed=c.changed, explanation=c.explanation())
                        for d, c in zip(data["arms"], self.arms)]
        return data


def load_upstream_changes(text: str | None = None) -> tuple[UpstreamChange, ...]:
    """The upstream-changes table (``bistat/data/vllm_changes.toml``, or ``text``)."""
    if text is None:
        text = resources.files("bistat").joinpath("data/vllm_changes.toml").read_text("utf-8")
    data = tomllib.loads(text)
    out = []
    for i, e in enumerate(data.get("change", [])):
        try:
            out.append(UpstreamChange(str(e["key"]), str(e["introduced"]),
                                      tuple(str(c) for c in e["components"]), str(e["kind"]),
                                      str(e["summary"]), str(e["reference"]), str(e["source"])))
        except KeyError as exc:
            raise VersionCompareError(f"vllm_changes.toml: change[{i}]: missing {exc.args[0]!r}; "
                                      "every entry needs key, introduced, components, kind, "
                                      "summary, reference and source") from None
        if out[-1].kind not in ("changed", "unchanged"):
            raise VersionCompareError(f"vllm_changes.toml: change[{i}].kind: {out[-1].kind!r}; "
                                      "expected 'changed' or 'unchanged'")
    return tuple(out)


def _version(s: Any) -> str | None:
    """The run's vLLM version (None for another engine: the upstream table is vLLM's)."""
    if not (s.engine_kind or "").startswith("vllm"):
        return None
    found = sorted({dict(e.versions).get("vllm") for _, e in s.environments} - {None})
    if len(found) > 1:
        raise VersionCompareError(f"run {s.run_id} recorded several vLLM versions ({found}); "
                                  "a comparison needs one per run")
    return found[0] if found else None


def _between(changes: Sequence[UpstreamChange], earlier: str | None, later: str | None
             ) -> tuple[UpstreamChange, ...]:
    if earlier is None or later is None:
        return ()
    try:
        lo, hi = Version(earlier), Version(later)
        return tuple(u for u in changes if lo < Version(u.introduced) <= hi)
    except InvalidVersion:
        return ()


def _side(s: Any, arm: str, backend: str) -> ArmSide:
    a = s.arm(arm)
    comp = next((c for c in s.comparisons if c.treatment == arm), None)
    modes = None
    ev = getattr(s, "engine_version", None)
    if ev is not None:
        m = next((x.modes for x in ev.arms if x.arm == arm and x.modes is not None), None)
        if m is not None:
            modes = " / ".join(m.describe())
    verdict = cost = None
    ratio = ratio_iv = None
    if comp is not None:
        verdict = comp.verdict.label.value
        if comp.verdict.cost is not None:
            cost = comp.verdict.cost.outcome.value
            ratio, ratio_iv = comp.verdict.cost.ratio, comp.verdict.cost.interval
        else:
            ratio = comp.ratio_point
            ratio_iv = None if comp.ratio is None else comp.ratio.interval
    envs = {n: e for n, e in s.environments}
    version = None
    if arm in envs:
        vllm = dict(envs[arm].versions).get("vllm")
        version = (f"vLLM {vllm}" if vllm is not None and (s.engine_kind or "").startswith("vllm")
                   else envs[arm].engine)
    return ArmSide(arm, a.role, version, modes, backend, a.n_matched,
                   a.n_units, a.match_interval, verdict, cost, ratio, ratio_iv, a.spread)


def engine_family(engine_kind: str | None) -> str:
    """The engine an engine kind drives (``vllm-server`` and ``vllm-offline`` are both vLLM)."""
    return (engine_kind or "—").split("-", 1)[0]


def _gpu_model(gpu: str) -> str:
    """``NVIDIA H100 80GB HBM3`` of ``NVIDIA H100 80GB HBM3 (GPU-…, driver …)``."""
    return gpu.split(" (", 1)[0]


def _flags(args: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(args.items())) or "none"


def _switches(s: Any, arm: str) -> str:
    """What an arm sets beyond its run's control, as the findings index's answers say it
    (:func:`bistat.analysis.activation.arm_setting`: mode switches, then environment variables,
    then engine arguments as flags)."""
    from bistat.analysis.activation import arm_setting
    from bistat.declare.experiment import validate_experiment

    parts, _ = arm_setting(validate_experiment(dict(s.declaration)), arm)
    return ", ".join(f"`{x}`" for x in parts) or "nothing (the control)"


def setups(earlier: Any, later: Any, pairs: Mapping[str, str]) -> tuple[tuple[str, str, str], ...]:
    """Two runs' setups side by side, as recorded and declared: the engine, its declared
    arguments, what each mapped arm switches on, the versions under it, the GPU and the counted
    passes. Each row is (what, earlier, later)."""
    def versions(s: Any, name: str) -> str:
        found = sorted({v for _, e in s.environments for k, v in e.versions if k == name} - {None})
        return ", ".join(found) or "—"

    def gpu(s: Any) -> str:
        units = sorted({g for _, e in s.environments for g in e.gpus})
        return "; ".join(units) or "no GPU"

    def passes(s: Any) -> str:
        counts = sorted({len(a.counted_passes) for a in s.arms})
        return "/".join(str(c) for c in counts) + " per arm"

    rows = [("engine", engine_name(earlier), engine_name(later)),
            ("engine kind", f"`{earlier.engine_kind}`", f"`{later.engine_kind}`"),
            ("declared engine arguments",
             _flags((earlier.declaration.get("engine") or {}).get("args") or {}),
             _flags((later.declaration.get("engine") or {}).get("args") or {}))]
    rows += [(f"arm {e} / {l}: set beyond the control", _switches(earlier, e), _switches(later, l))
             for e, l in pairs.items()]
    rows += [("torch", versions(earlier, "torch"), versions(later, "torch")),
             ("triton", versions(earlier, "triton"), versions(later, "triton")),
             ("GPU", gpu(earlier), gpu(later)),
             ("counted passes", passes(earlier), passes(later))]
    return tuple(rows)


def _touches(u: UpstreamChange, side: ArmSide, env: Mapping[str, str], mode_changed: bool) -> bool:
    """Whether an upstream change touches what an arm ran. Every entry is about batch-invariant
    mode, so only an arm with ``VLLM_BATCH_INVARIANT=1``: ``gemm`` always, ``attention:BACKEND``
    when its engine logged that backend, ``compile`` when its recorded mode changed between the
    runs, ``tuned-shapes`` when it ran breakable CUDA graphs (what vLLM 0.33 does exactly when
    the model's GEMM shapes are in its tuned table)."""
    if env.get("VLLM_BATCH_INVARIANT") != "1":
        return False
    for c in u.components:
        if c.startswith("attention:") and c.split(":", 1)[1] in side.backend:
            return True
        if c == "gemm" or (c == "compile" and mode_changed) or (
                c == "tuned-shapes" and "breakable" in (side.modes or "")):
            return True
    return False


def _backend(s: Any, arm: str) -> str:
    """The arm's engine kind and the attention backend(s) its engine log (or its server) named,
    or the GEMM it declared on an engine with GEMM modes (the embedded engine)."""
    from bistat.engines.registry import capabilities

    act = next((a for a in s.activation if a.arm == arm), None)
    parts = [s.engine_kind or "—", *((act.attention or ()) if act is not None else ())]
    decl = {x["name"]: x for x in s.declaration.get("arms", [])}
    args = {**((s.declaration.get("engine") or {}).get("args") or {}),
            **(decl.get(arm, {}).get("args") or {})}
    if capabilities(s.engine_kind or "").gemm_modes and "gemm" in args:
        parts.append(f"gemm {args['gemm']}")
    return ", ".join(parts)


def compare_versions(earlier: Any, later: Any, arm_map: Mapping[str, str] | None = None,
                     changes: Sequence[UpstreamChange] | None = None) -> VersionComparison:
    """Set two analysed runs of one study side by side (see the module docstring).

    Parameters
    ----------
    earlier, later : bistat.analysis.summary.RunSummary
        The two runs, each analysed against the registration it was recorded under.
    arm_map : mapping, optional
        Earlier arm name -> later arm name; by default the arms both runs have, by name.
    changes : sequence of UpstreamChange, optional
        The upstream table (default: ``load_upstream_changes()``).
    """
    if earlier.match_unit != later.match_unit:
        raise VersionCompareError(f"the runs compare different things ({earlier.match_unit!r} vs "
                                  f"{later.match_unit!r}): set side by side only runs of one match "
                                  "unit")
    e_arms = {a.name for a in earlier.arms}
    l_arms = {a.name for a in later.arms}
    pairs = dict(arm_map) if arm_map else {n: n for n in sorted(e_arms & l_arms)}
    for e, l in pairs.items():
        if e not in e_arms:
            raise VersionCompareError(f"--arm {e}={l}: the earlier run {earlier.run_id} has no arm "
                                      f"{e!r}; its arms: {', '.join(sorted(e_arms))}")
        if l not in l_arms:
            raise VersionCompareError(f"--arm {e}={l}: the later run {later.run_id} has no arm "
                                      f"{l!r}; its arms: {', '.join(sorted(l_arms))}")
    if not pairs:
        raise VersionCompareError(f"runs {earlier.run_id} and {later.run_id} share no arm name; "
                                  "map them with --arm EARLIER=LATER")
    table = load_upstream_changes() if changes is None else tuple(changes)
    same_engine = engine_family(earlier.engine_kind) == engine_family(later.engine_kind)
    same_rule = earlier.declaration.get("rule") == later.declaration.get("rule")
    ev, lv = _version(earlier), _version(later)
    between = _between(table, ev, lv)
    cl = later.confidence_level
    envs_l = {a["name"]: a.get("env") or {} for a in later.declaration.get("arms", [])}
    rows = []
    for e_name, l_name in pairs.items():
        a = _side(earlier, e_name, _backend(earlier, e_name))
        b = _side(later, l_name, _backend(later, l_name))
        diff = None
        if a.n_units and b.n_units:
            diff = stats.newcombe_difference(b.n_matched, b.n_units, a.n_matched, a.n_units, cl)
        match_changed = diff is not None and (diff.low > 0 or diff.high < 0)
        cost_changed = (a.ratio_interval is not None and b.ratio_interval is not None
                        and not stats.intervals_overlap(a.ratio_interval, b.ratio_interval))
        mode_changed = a.modes is not None and b.modes is not None and a.modes != b.modes
        rows.append(ArmChange(
            a, b, diff, match_changed,
            verdict_changed=(None if not same_rule else
                             a.verdict is not None and b.verdict is not None and a.verdict != b.verdict),
            cost_changed=cost_changed,
            mode_changed=mode_changed,
            upstream=tuple(u for u in between
                           if _touches(u, b, envs_l.get(l_name, {}), mode_changed)),
            upstream_known=ev is not None and lv is not None,
            same_engine=same_engine))
    notes = []
    if not same_rule:
        notes.append(f"the runs were analysed under different decision rules "
                     f"({earlier.registration_path}, {later.registration_path}): their verdicts are "
                     "not compared")
    if earlier.exploratory:
        notes.append(f"{earlier.run_id} is analysed under a rule registered after its data "
                     f"({earlier.registration_path}): its verdicts are exploratory")
    w_e, w_l = earlier.declaration.get("workload", {}), later.declaration.get("workload", {})
    for key in ("source", "n_prompts", "max_tokens", "concurrency", "passes", "top_logprobs"):
        if w_e.get(key) != w_l.get(key):
            notes.append(f"workload.{key}: {w_e.get(key)!r} in {earlier.run_id}, {w_l.get(key)!r} "
                         f"in {later.run_id}")
    gpus = [tuple(sorted({g for _, e in s.environments for g in e.gpus})) for s in (earlier, later)]
    if earlier.engine_kind != later.engine_kind:
        notes.append(f"the runs drove different engines ({earlier.engine_kind} in "
                     f"{earlier.run_id}, {later.engine_kind} in {later.run_id})")
    what = "release" if same_engine else "engine"
    models = [sorted({_gpu_model(g) for g in x}) for x in gpus]
    if gpus[0] != gpus[1] and models[0] == models[1] and models[0]:
        notes.append(f"the runs ran on different GPUs of one model ({', '.join(models[0])}; "
                     f"other units): a cost difference between them mixes the {what} with the "
                     "unit (matching is not affected by which GPU ran it)")
    elif gpus[0] != gpus[1]:
        notes.append(f"the runs ran on different GPUs: a cost difference between them mixes the "
                     f"{what} with the machine (matching is not affected by which GPU ran it)")
    return VersionComparison(
        earlier.run_id, later.run_id, earlier.registration_path, later.registration_path, ev, lv,
        gpus[0], gpus[1], cl, tuple(rows),
        tuple(sorted(e_arms - set(pairs))), tuple(sorted(l_arms - set(pairs.values()))),
        same_rule, bool(earlier.exploratory), between, tuple(notes),
        engine_name(earlier), engine_name(later), same_engine,
        () if same_engine else setups(earlier, later, pairs))
