"""``bistat diagnose``: rank the likely causes of a run's divergences, with the evidence for each.

Every cause is weighed from the recorded data alone (``docs/CONTRACTS.md``, run directory) and
gets a strength -- *strong*, *moderate*, *weak*, *none* (looked for and absent, or contradicted)
or *not assessable* (the records cannot tell) -- and the evidence lines that decided it. Causes
are ranked by strength, ties in the fixed order of :data:`CAUSES`.

The causes
----------
``refused``
    an engine refused the setting or failed to start (``events.jsonl``).
``environment``
    the environment fingerprints (versions, GPU UUIDs and drivers, CPU, git commit, the
    engine's log findings such as the BLAS in use) differ between engine starts of one arm
    (strong: passes of one arm are then not comparable) or between arms (weak).
``batch_shape``
    divergences concentrate where the batch a request was computed in had a different size:
    for every response, the engine's batch sizes over its lifetime (``t_submit`` .. ``t_done``)
    are read from ``metrics.jsonl`` -- the exact per-step ``step_batch_size`` lines when the
    engine wrote them, else the per-second ``num_requests_running`` samples -- and each
    compared pass pair of a prompt gets the absolute difference of the two mean batch sizes.
    Evidence: whether every diverging pair saw different batch sizes, a one-sided Mann-Whitney
    U test [1]_ that diverging pairs differ more than matching ones, and the contrast with an
    arm whose passes saw different batch sizes as often and never diverged. Diverging pairs
    that saw *identical* per-step batch sizes argue against it (run-to-run nondeterminism).
``near_tie``
    the divergence anatomy (:mod:`bistat.analysis.anatomy`): near-tie flips are what rounding noise
    from a different reduction order causes; large drifts are not. At most *moderate*: a
    near-tie explains why noise became a token flip, not where the noise came from.
``setting_ineffective``
    the setting did not take effect: a treatment arm (which asked for invariance) diverges, as
    often as the control; a probe report (``bistat probe --output``) whose outcome is not
    ``confirmed``; no log line confirming the mode.
``prefix_cache``
    prefix caching on in an arm (engine arguments) -- cached prefixes change the shapes a
    prompt's tokens are computed in; none for engines without a prefix cache.
``tokenization``
    the same prompt tokenized to a different number of tokens in different passes, or text
    outputs that differ while token ids agree (a text / token-id round trip that is not
    stable).

References
----------
.. [1] H. B. Mann and D. R. Whitney, On a test of whether one of two random variables is
       stochastically larger than the other, Annals of Mathematical Statistics 18(1),
       pp 50-60 (1947).
"""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from bistat.core.lazy import lazy_module

sps = lazy_module("scipy.stats")

from bistat.store.format import RecordsError
from bistat.declare.run_registration import run_declaration
from bistat.store.run_dir import RecordedRun
from bistat.analysis.activation import log_markers
from bistat.analysis.probe_report import probe_report_paths
from bistat.analysis.anatomy import (
    JITTER,
    LARGE_DRIFT,
    NEAR_TIE,
    UNDETERMINED,
    Anatomy,
    PassOutput,
    divergence_anatomy,
    first_divergence,
    kv_tile_boundary,
    load_pass_outputs,
    read_unit_and_epsilon,
)
from bistat.engines.registry import capabilities
from bistat.explain.remedies import advice_lines, load_table, model_shape

__all__ = ["CAUSES", "DIAGNOSIS_SCHEMA", "Cause", "Diagnosis", "diagnose_run", "render_diagnosis"]

DIAGNOSIS_SCHEMA = "bistat.diagnosis/1"

#: Cause keys and titles, in the order that breaks ties between equally strong causes.
CAUSES: tuple[tuple[str, str], ...] = (
    ("refused", "the engine refused the setting"),
    ("environment", "environment or version differences"),
    ("batch_shape", "batch-shape dependence"),
    ("setting_ineffective", "the setting not taking effect"),
    ("near_tie", "near-tie instability"),
    ("prefix_cache", "prefix-cache state"),
    ("tokenization", "tokenization (text / token-id round trip)"),
    ("attention_kv_tile", "the attention kernel's KV tile changing with the batch"),
)
_TITLES = dict(CAUSES)
_ORDER = [k for k, _ in CAUSES]
STRENGTHS = {"strong": 3, "moderate": 2, "weak": 1, "none": 0, "not assessable": -1}
#: A one-sided p-value below this counts as evidence in the batch-shape test.
ALPHA = 0.05


@dataclass(frozen=True)
class Cause:
    """One candidate cause, weighed."""

    key: str
    title: str
    strength: str           # strong | moderate | weak | none | not assessable
    summary: str            # one sentence
    evidence: tuple[str, ...]

    @property
    def score(self) -> int:
        return STRENGTHS[self.strength]


@dataclass(frozen=True)
class Diagnosis:
    """The ranked causes of a run's divergences (``bistat.diagnosis/1``)."""

    run_id: str
    n_divergences: int
    nothing_to_diagnose: bool
    message: str
    causes: tuple[Cause, ...]          # ranked, most likely first
    anatomy: Anatomy

    def to_dict(self) -> dict[str, Any]:
        return {"schema": DIAGNOSIS_SCHEMA, "run_id": self.run_id,
                "n_divergences": self.n_divergences,
                "nothing_to_diagnose": self.nothing_to_diagnose, "message": self.message,
                "causes": [{"rank": i + 1, "key": c.key, "title": c.title,
                            "strength": c.strength, "summary": c.summary,
                            "evidence": list(c.evidence)} for i, c in enumerate(self.causes)],
                "anatomy": self.anatomy.to_dict()}


def _cause(key: str, strength: str, summary: str, evidence: Iterable[str]) -> Cause:
    return Cause(key, _TITLES[key], strength, summary, tuple(evidence))


# --------------------------------------------------------------------------------------------
# environment
# --------------------------------------------------------------------------------------------


def _env_key(row: Mapping[str, Any]) -> dict[str, str]:
    """The comparable parts of one environment line, flattened to ``{field: value}``."""
    fp = row.get("fingerprint") if isinstance(row.get("fingerprint"), Mapping) else {}
    out: dict[str, str] = {}
    for k, v in sorted((fp.get("versions") or {}).items()):
        out[f"versions.{k}"] = str(v)
    for i, g in enumerate(fp.get("gpus") or []):
        for k in ("name", "uuid", "driver"):
            out[f"gpus[{i}].{k}"] = str(g.get(k))
    out["cpu.model"] = str((fp.get("cpu") or {}).get("model"))
    out["git.commit"] = str((fp.get("git") or {}).get("commit"))
    out["host"] = str(fp.get("host"))
    engine = row.get("engine") if isinstance(row.get("engine"), Mapping) else {}
    out["engine.version"] = str(engine.get("version"))
    out["engine.commit"] = str(engine.get("commit"))
    findings = row.get("log_findings") or []
    out["log_findings"] = "\n".join(_stable_log_line(str(x)) for x in findings)
    return out


#: What changes in an engine-log line from one start of the same engine to the next: process ids,
#: log timestamps, ports, temporary paths. Left in, every restart would look like an environment
#: change.
_VOLATILE_LOG = (
    (re.compile(r"\((\w+) pid=\d+\)"), r"(\1)"),
    (re.compile(r"\b(DEBUG|INFO|WARNING|ERROR)\s+\d\d-\d\d \d\d:\d\d:\d\d(\.\d+)?"), r"\1"),
    (re.compile(r"\bpid[= ]\d+"), "pid=N"),
    (re.compile(r"('port': |'--port', '|--port[= ]|port=)\d+"), r"\1N"),
    (re.compile(r"/tmp/[\w.+-]+"), "/tmp/*"),
)


def _stable_log_line(line: str) -> str:
    for pattern, repl in _VOLATILE_LOG:
        line = pattern.sub(repl, line)
    return line


def _diff(a: Mapping[str, str], b: Mapping[str, str]) -> list[str]:
    out = []
    for k in sorted(set(a) | set(b)):
        if a.get(k) == b.get(k):
            continue
        if k == "log_findings":   # the lines only one side logged, shortened
            la, lb = (set((x.get(k) or "").splitlines()) for x in (a, b))
            only = [f"only in one: {_short(x)}" for x in sorted(la ^ lb)[:2]]
            out.append(f"{k}: {len(la ^ lb)} line(s) differ ({'; '.join(only)})")
        else:
            out.append(f"{k}: {a.get(k)!s} / {b.get(k)!s}")
    return out


def _short(text: str, width: int = 160) -> str:
    return text if len(text) <= width else text[:width - 1] + "…"


def _environment(env_rows: list[dict[str, Any]], div_blocks: Mapping[str, set[int]]) -> Cause:
    if not env_rows:
        return _cause("environment", "not assessable", "no environment line was recorded",
                      ["environment.jsonl is empty or missing"])
    by_arm: dict[str, list[tuple[int, dict[str, str]]]] = defaultdict(list)
    for r in env_rows:
        by_arm[str(r.get("arm"))].append((int(r.get("block") or 0), _env_key(r)))
    within: list[str] = []
    for arm, starts in sorted(by_arm.items()):
        first_block, first = starts[0]
        for block, key in starts[1:]:
            d = _diff(first, key)
            if d:
                within.append(f"arm {arm}: engine start (block {block}) differs from block "
                              f"{first_block}: " + "; ".join(d))
    arms = sorted(by_arm)
    between: list[str] = []
    for other in arms[1:]:
        d = _diff(by_arm[arms[0]][0][1], by_arm[other][0][1])
        d = [x for x in d if not x.startswith("log_findings")]
        if d:
            between.append(f"arms {arms[0]} and {other} differ: " + "; ".join(d))
    n = len(env_rows)
    if within:
        spans = [a for a, blocks in div_blocks.items() if len(blocks) > 1]
        strength = "strong" if spans else "moderate"
        return _cause("environment", strength,
                      "the environment changed between engine starts of one arm, so its passes "
                      "did not all run the same software or hardware", within + between)
    if between:
        return _cause("environment", "weak",
                      "the arms ran in different environments; this does not explain divergences "
                      "within an arm, but it undermines the comparison between arms", between)
    return _cause("environment", "none",
                  f"all {n} engine start(s) recorded identical versions, devices and log findings",
                  [f"{n} environment line(s) compared field by field (versions, GPU name/UUID/"
                   "driver, CPU model, git commit, engine version, log findings)"])


# --------------------------------------------------------------------------------------------
# batch shape
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Series:
    t: np.ndarray
    size: np.ndarray
    per_step: bool


def _batch_series(metrics: Any) -> dict[tuple[str, int], _Series]:
    out: dict[tuple[str, int], _Series] = {}
    if metrics.empty:
        return out
    for (arm, seq), grp in metrics.groupby(["arm", "seq"], sort=True):
        steps = grp[grp["step_batch_size"].notna()]
        if len(steps):
            steps = steps.sort_values("t", kind="stable")
            out[(str(arm), int(seq))] = _Series(steps["t"].to_numpy(float),
                                                steps["step_batch_size"].to_numpy(float), True)
            continue
        secs = grp[grp["num_requests_running"].notna() & grp["step_batch_size"].isna()]
        if len(secs):
            secs = secs.sort_values("t", kind="stable")
            out[(str(arm), int(seq))] = _Series(secs["t"].to_numpy(float),
                                                secs["num_requests_running"].to_numpy(float),
                                                False)
    return out


def _profile(series: _Series | None, out: PassOutput) -> tuple[float, ...] | None:
    """Batch sizes over a response's lifetime (the nearest sample when none falls inside)."""
    if series is None or out.t_submit is None or out.t_done is None or not len(series.t):
        return None
    inside = (series.t >= out.t_submit) & (series.t <= out.t_done)
    if inside.any():
        return tuple(float(x) for x in series.size[inside])
    mid = 0.5 * (out.t_submit + out.t_done)
    return (float(series.size[int(np.argmin(np.abs(series.t - mid)))]),)


@dataclass(frozen=True)
class _Pair:
    arm: str
    prompt_id: str
    diverged: bool
    delta: float | None          # |mean batch size - reference's|
    same_profile: bool | None    # identical per-step sizes (None: per-second data only)


def _pairs(outputs: Mapping[tuple[str, int, str], PassOutput],
           passes: Mapping[str, Sequence[int]], series: Mapping[tuple[str, int], _Series],
           unit: str) -> list[_Pair]:
    with_lps = unit == "token_ids+logprobs"
    pairs: list[_Pair] = []
    for arm, plist in passes.items():
        if len(plist) < 2:
            continue
        ref_pass = plist[0]
        for (a, p, pid), ref in sorted(outputs.items()):
            if a != arm or p != ref_pass:
                continue
            pr = _profile(series.get((arm, ref.seq if ref.seq is not None else -1)), ref)
            for q in plist[1:]:
                oth = outputs.get((arm, q, pid))
                if oth is None:
                    continue
                diverged = first_divergence(ref.token_ids, oth.token_ids,
                                            ref.logprobs if with_lps else None,
                                            oth.logprobs if with_lps else None) is not None
                if unit == "text":
                    diverged = ref.text != oth.text
                s = series.get((arm, oth.seq if oth.seq is not None else -1))
                po = _profile(s, oth)
                delta = None if pr is None or po is None else abs(float(np.mean(pr)) -
                                                                  float(np.mean(po)))
                same = None
                if pr is not None and po is not None and s is not None and s.per_step:
                    same = pr == po
                pairs.append(_Pair(arm, pid, diverged, delta, same))
    return pairs


def _settings(args: Mapping[str, Any]) -> dict[str, str]:
    """An engine's arguments that configure the engine: not the command line it was started with
    (ports, paths: it repeats the arguments) nor bistat's handling of it (where its log goes)."""
    from bistat.analysis.activation import HANDLING_KEYS

    return {k: str(v) for k, v in args.items() if k != "argv" and k not in HANDLING_KEYS}


def _batch_shape(pairs: Sequence[_Pair], arm_args: Mapping[str, Mapping[str, Any]],
                 per_step: bool) -> Cause:
    div = [p for p in pairs if p.diverged]
    if not div:
        return _cause("batch_shape", "none", "no pass pair diverged", [])
    measured = [p for p in pairs if p.delta is not None]
    if not measured:
        return _cause("batch_shape", "not assessable",
                      "no batch sizes were recorded for the diverging responses",
                      ["metrics.jsonl has no step_batch_size or num_requests_running samples in "
                       "the responses' lifetimes; re-run with an engine that reports them, or "
                       "use `bistat replay` to sweep batch sizes"])
    source = ("per-step batch sizes (step_batch_size)" if per_step else
              "per-second running-request counts (num_requests_running)")
    ev = [f"batch sizes from {source}, over each response's lifetime"]
    div_m = [p for p in div if p.delta is not None]
    match_m = [p for p in measured if not p.diverged]
    differing_div = [p for p in div_m if p.delta > 0 or p.same_profile is False]
    ev.append(f"{len(differing_div)} of {len(div_m)} diverging pass pair(s) saw a different "
              f"batch-size profile than the reference pass (mean |Δ batch size| "
              f"{_mean([p.delta for p in div_m]):.3g})")
    same_div = [p for p in div if p.same_profile is True]
    if same_div:
        ev.append(f"{len(same_div)} diverging pair(s) saw identical per-step batch sizes "
                  f"(e.g. prompt {same_div[0].prompt_id} in arm {same_div[0].arm}): batch shape "
                  "cannot explain those (run-to-run nondeterminism?)")
    pvalue = None
    if div_m and match_m:
        res = sps.mannwhitneyu([p.delta for p in div_m], [p.delta for p in match_m],
                               alternative="greater", method="auto")
        pvalue = float(res.pvalue)
        ev.append(f"Mann-Whitney U (diverging pairs' |Δ batch size| greater than matching "
                  f"pairs'): U = {float(res.statistic):.1f}, one-sided p = {pvalue:.3g}, "
                  f"n = {len(div_m)} vs {len(match_m)}")
    # contrast: arms whose pairs saw batch-size changes as often but never diverged
    div_arms = sorted({p.arm for p in div})
    contrast: list[str] = []
    for arm in sorted({p.arm for p in measured} - set(div_arms)):
        arm_pairs = [p for p in measured if p.arm == arm]
        changed = [p for p in arm_pairs if p.delta > 0 or p.same_profile is False]
        if changed:
            contrast.append(arm)
            ev.append(f"arm {arm}: 0 of {len(arm_pairs)} pass pairs diverged although "
                      f"{len(changed)} saw different batch sizes")
    for arm in div_arms:
        for other in contrast:
            d = _diff(_settings(arm_args.get(arm, {})), _settings(arm_args.get(other, {})))
            if d:
                ev.append(f"engine arguments of {arm} vs {other}: " + "; ".join(d))
    share = len(differing_div) / len(div_m) if div_m else 0.0
    if same_div and len(same_div) >= len(div) / 2:
        strength = "weak" if differing_div else "none"
        summary = "divergences also occur under identical batch sizes"
    elif share == 1.0 and ((pvalue is not None and pvalue < ALPHA) or contrast):
        strength = "strong"
        summary = ("every divergence came with a different batch-size profile, and "
                   + ("diverging pairs saw larger batch-size changes than matching ones"
                      if pvalue is not None and pvalue < ALPHA else
                      "an arm with the same batch-size changes never diverged"))
    elif share >= 0.5:
        strength = "moderate"
        summary = "most divergences came with a different batch-size profile"
    else:
        strength = "weak"
        summary = "few divergences came with a different batch-size profile"
    return _cause("batch_shape", strength, summary, ev)


def _mean(xs: Sequence[float | None]) -> float:
    vals = [x for x in xs if x is not None]
    return float(np.mean(vals)) if vals else float("nan")


# --------------------------------------------------------------------------------------------
# the others
# --------------------------------------------------------------------------------------------


def _near_tie(anatomy: Anatomy) -> Cause:
    n = anatomy.n_divergences
    if not n:
        return _cause("near_tie", "none", "no divergence", [])
    counts = {lab: sum(d.label == lab for d in anatomy.divergences)
              for lab in (NEAR_TIE, LARGE_DRIFT, JITTER, UNDETERMINED)}
    ev = [f"{counts[NEAR_TIE]} near-tie flip(s), {counts[LARGE_DRIFT]} large drift(s), "
          f"{counts[JITTER]} logprob jitter, {counts[UNDETERMINED]} undetermined, of {n} "
          f"divergence(s) (ε = {anatomy.epsilon:g} nats, top-k = {anatomy.top_k})"]
    margins = sorted(d.margin for d in anatomy.divergences if d.margin is not None
                     and not d.margin_is_bound and math.isfinite(d.margin))
    if margins:
        ev.append(f"margins at first divergence: min {margins[0]:.3g}, median "
                  f"{margins[(len(margins) - 1) // 2]:.3g}, max {margins[-1]:.3g} nats")
    large = [d for d in anatomy.divergences if d.label == LARGE_DRIFT]
    if large:
        d = large[0]
        ev.append(f"large drift e.g. arm {d.arm} prompt {d.prompt_id} at token {d.position}: "
                  f"margin {'≥ ' if d.margin_is_bound else ''}{d.margin:.3g} nats -- more than a "
                  "reduction order explains; worth a bug report (`bistat replay`)")
    small = counts[NEAR_TIE] + counts[JITTER]
    if small == 0:
        if counts[UNDETERMINED] == n:
            return _cause("near_tie", "not assessable",
                          "the records hold no top-k logprobs that could show the margins", ev)
        return _cause("near_tie", "none", "no divergence was a near-tie flip", ev)
    share = small / n
    strength = "moderate" if share >= 0.5 else "weak"
    # a jitter moved logprobs without flipping a token: rounding noise, but no near-tie flip
    kinds = [f"{counts[label]} {words}" for label, words in (
        (NEAR_TIE, "near-tie flip(s) that rounding noise tipped"),
        (JITTER, "logprob jitter (rounding noise in the logprobs, no token flipped)"))
        if counts[label]]
    return _cause("near_tie", strength,
                  f"{100 * share:.0f} % of divergences are rounding noise: {' and '.join(kinds)}",
                  ev)


def _setting(anatomy: Anatomy, roles: Mapping[str, str], probes: Sequence[tuple[str, dict]],
             findings: Mapping[str, str]) -> Cause:
    ev: list[str] = []
    rates = {a.arm: (a.n_diverging_prompts, a.n_prompts) for a in anatomy.arms}
    control = [a for a, r in roles.items() if r == "control"]
    treat = [a for a, r in roles.items() if r == "treatment"]
    strength = "none"
    for t in treat:
        nd, n = rates.get(t, (0, 0))
        if not nd:
            continue
        ev.append(f"treatment arm {t}: {nd} of {n} prompt(s) diverged between its passes")
        c_nd, c_n = rates.get(control[0], (0, 0)) if control else (0, 0)
        if c_n and n and nd / n >= c_nd / c_n:
            ev.append(f"as often as or more than the control arm {control[0]} ({c_nd} of {c_n})")
            strength = "strong"
        elif strength != "strong":
            strength = "moderate"
    for path, rep in probes:
        outcome = rep.get("outcome")
        ev.append(f"probe report {path}: outcome {outcome!r} ({rep.get('reason')})")
        if outcome == "violated":
            strength = "strong"
        elif outcome in ("no_power", "untested") and strength == "none":
            strength = "weak"
    for t in treat:
        text = findings.get(t, "")
        if t in findings and "invarian" not in text.lower():
            ev.append(f"arm {t}: no engine log line mentions batch invariance"
                      + (f" (findings: {text})" if text else ""))
    if not treat:
        return _cause("setting_ineffective", "not assessable", "the run declares no treatment arm",
                      ev)
    if strength == "none":
        return _cause("setting_ineffective", "none",
                      "no treatment arm diverged" + (" and no probe contradicts it" if probes
                                                     else ""), ev)
    return _cause("setting_ineffective", strength,
                  "a treatment arm that asked for invariance still diverged", ev)


def _truthy(v: Any) -> bool:
    return v is True or (isinstance(v, str) and v.lower() in ("1", "true", "yes", "on"))


def _prefix_cache(engine_kind: str | None, arm_args: Mapping[str, Mapping[str, Any]]) -> Cause:
    on = sorted(a for a, args in arm_args.items()
                if any(_truthy(v) for k, v in args.items()
                       if k.replace("-", "_").lstrip("_") == "enable_prefix_caching"))
    if engine_kind and capabilities(engine_kind).recomputes_prompts:
        return _cause("prefix_cache", "none", f"the {engine_kind} engine has no prefix cache",
                      [f"engine kind {engine_kind!r} recomputes every prompt"])
    if on:
        return _cause("prefix_cache", "moderate",
                      f"prefix caching was on in arm(s) {', '.join(on)}: a cached prefix changes "
                      "the shapes a prompt is computed in",
                      [f"arm {a}: enable_prefix_caching on" for a in on]
                      + ["`bistat replay` runs the prompt cold and warm to test it"])
    declared = [a for a, args in arm_args.items()
                if any(k.replace("-", "_").lstrip("_") == "enable_prefix_caching" for k in args)]
    if declared:
        return _cause("prefix_cache", "none", "prefix caching was off in every arm",
                      [f"arm {a}: enable_prefix_caching off" for a in sorted(declared)])
    return _cause("prefix_cache", "not assessable",
                  "the recorded engine arguments do not say whether prefix caching was on",
                  [f"engine kind {engine_kind!r}; no enable_prefix_caching argument recorded"])


def _attention_kv_tile(outputs: Mapping[tuple[str, int, str], PassOutput],
                       anatomy: Anatomy, log_lines: Mapping[str, Sequence[str]] | None = None,
                       model: str | None = None) -> Cause:
    """Do an arm's first divergences all start one key past a power-of-two KV length? Then the
    attention backend (engine log) and head size of those arms, and what bistat has measured
    against it (:mod:`bistat.explain.remedies`), go into the evidence."""
    kv: dict[str, list[int]] = defaultdict(list)
    starts: dict[str, list[int]] = defaultdict(list)
    for d in anatomy.divergences:
        o = outputs.get((d.arm, d.reference.pass_index, d.prompt_id))
        if o is not None and o.n_prompt_tokens is not None:
            kv[d.arm].append(o.n_prompt_tokens + d.position)
            starts[d.arm].append(o.n_prompt_tokens)
    if not kv:
        return _cause("attention_kv_tile", "not assessable",
                      "no prompt token counts were recorded for the diverging responses", [])
    ev, covered, tiled = [], 0, []
    for arm in sorted(kv):
        lengths, tile = sorted(kv[arm]), kv_tile_boundary(kv[arm])
        if tile is not None:
            tiled.append(arm)
        ev.append(f"arm {arm}: {len(lengths)} first divergence(s) at KV lengths (prompt tokens + "
                  f"index) {lengths[0]}-{lengths[-1]}, median {lengths[(len(lengths) - 1) // 2]}; "
                  f"outputs began at {min(starts[arm])}-{max(starts[arm])} keys"
                  + (f"; none at {tile} or fewer, {lengths.count(tile + 1)} exactly at {tile + 1}"
                     if tile is not None else ""))
        covered += len(lengths) if tile is not None else 0
    total = sum(len(v) for v in kv.values())
    if not covered:
        return _cause("attention_kv_tile", "none",
                      "no arm's divergences start just past a power-of-two KV length", ev)
    ev.append("up to one KV tile any tile width reduces a row in the same order; FlashAttention 3 "
              "on Hopper picks 128 or 192 keys per tile at head size 64 from the batch's longest "
              "query, and batch-invariant mode does not pin it: run an arm with "
              "attention_backend = TRITON_ATTN (a fixed tile), or keep prompt + output within "
              "one tile, to test it")
    strength = "strong" if covered == total else "moderate" if covered >= total / 2 else "weak"
    summary = (f"{covered} of {total} first divergence(s) start one key past a power-of-two KV "
               "length, never before it")
    if log_lines is not None:
        table = load_table()
        backends = {arm: log_markers(log_lines[arm])["attention"] if arm in log_lines else ()
                    for arm in tiled}
        ev += advice_lines(backends, model, table)
        named = sorted({", ".join(b) for b in backends.values() if b})
        shape = model_shape(model, table)
        if named:
            summary += (f" ({'; '.join(named)}"
                        + ("" if shape is None else f", head size {shape.head_size}") + ")")
    return _cause("attention_kv_tile", strength, summary, ev)


def _engine_model(env_rows: Sequence[Mapping[str, Any]]) -> str | None:
    """The engine's ``model`` argument as the environment lines recorded it (the first one)."""
    for r in env_rows:
        engine = r.get("engine") if isinstance(r.get("engine"), Mapping) else {}
        fp = r.get("fingerprint") if isinstance(r.get("fingerprint"), Mapping) else {}
        model = (engine.get("args") or {}).get("model") or (fp.get("engine_reported") or {}).get("model")
        if model:
            return str(model)
    return None


def _tokenization(outputs: Mapping[tuple[str, int, str], PassOutput], anatomy: Anatomy) -> Cause:
    lengths: dict[tuple[str, str], set[int]] = defaultdict(set)
    for (arm, _, pid), o in outputs.items():
        if o.n_prompt_tokens is not None:
            lengths[(arm, pid)].add(o.n_prompt_tokens)
    unstable = sorted(k for k, v in lengths.items() if len(v) > 1)
    div_prompts = {(d.arm, d.prompt_id) for d in anatomy.divergences}
    text_only = [d for d in anatomy.divergences if d.kind == "text"]
    ev = []
    if unstable:
        arm, pid = unstable[0]
        ev.append(f"{len(unstable)} prompt(s) were tokenized to different lengths in different "
                  f"passes, e.g. arm {arm} prompt {pid}: {sorted(lengths[(arm, pid)])} tokens")
    if text_only:
        ev.append(f"{len(text_only)} divergence(s) in text with identical token ids "
                  "(detokenization is not stable)")
    if not lengths:
        return _cause("tokenization", "not assessable", "no prompt token counts were recorded",
                      ev)
    if unstable and div_prompts & set(unstable) or text_only:
        return _cause("tokenization", "strong",
                      "the text / token-id round trip differs between passes", ev)
    if unstable:
        return _cause("tokenization", "weak",
                      "some prompts' token counts vary, but not the diverging ones", ev)
    return _cause("tokenization", "none",
                  f"every prompt had one token count in all passes ({len(lengths)} "
                  "arm-prompt(s) checked)", ev)


def _refused(events: list[dict[str, Any]]) -> Cause:
    bad = [e for e in events if e.get("event") in ("refused", "start_failed")]
    if not events:
        return _cause("refused", "not assessable", "no engine events were recorded", [])
    if not bad:
        return _cause("refused", "none", "every engine start succeeded", [
            f"{sum(e.get('event') == 'started' for e in events)} 'started' event(s)"])
    return _cause("refused", "strong", "an engine refused the setting or failed to start",
                  [f"arm {e.get('arm')}: {e.get('event')} ({e.get('detail')})" for e in bad])


# --------------------------------------------------------------------------------------------
# the diagnosis
# --------------------------------------------------------------------------------------------


def _probe_reports(run_dir: Path, extra: Sequence[Path]) -> list[tuple[str, dict]]:
    out = []
    for p in probe_report_paths(run_dir) + list(extra):
        try:
            data = json.loads(Path(p).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise RecordsError(f"{p}: not a readable probe report ({exc})") from exc
        if not isinstance(data, dict) or data.get("schema") != "bistat.probe/1":
            raise RecordsError(f"{p}: field 'schema' is {data.get('schema')!r} "
                               "(expected 'bistat.probe/1'); pass a `bistat probe "
                               "--output` file")
        out.append((str(p), data))
    return out


def _roles(run: RecordedRun, arms: Iterable[str]) -> dict[str, str]:
    decl = run_declaration(run) or {}
    try:
        roles = {str(a["name"]): str(a["role"]) for a in decl.get("arms", [])}
    except (KeyError, TypeError):
        roles = {}
    return roles or {a: "unknown" for a in arms}


def diagnose_run(run_dir: str | Path | RecordedRun, *, probe_reports: Sequence[str | Path] = (),
                 epsilon: float | None = None) -> Diagnosis:
    """Rank the likely causes of a recorded run's divergences.

    Parameters
    ----------
    run_dir : path or RecordedRun
        The run directory, or the run opened.
    probe_reports : paths
        ``bistat probe --output`` files to weigh (``RUN_DIR/probe*.json`` are read too).
    epsilon : float, optional
        ε of the near-tie label (default: the registration's, else the anatomy default).

    Returns
    -------
    Diagnosis
        ``nothing_to_diagnose`` when no counted pass differs from its reference and no engine
        refused the setting.
    """
    run = RecordedRun.of(run_dir)
    run_dir, header, run_id = run.path, run.header, run.run_id
    unit, _ = read_unit_and_epsilon(run)
    anatomy = divergence_anatomy(run, epsilon=epsilon)
    events = run.table("events").to_dict("records")
    refused = _refused(events)
    if anatomy.n_divergences == 0 and refused.strength != "strong":
        n_pairs = sum(max(len(a.counted_passes) - 1, 0) * a.n_prompts for a in anatomy.arms)
        return Diagnosis(run_id, 0, True,
                         f"Nothing to diagnose: no counted pass differs from its arm's reference "
                         f"pass ({n_pairs} pass pair(s) of {sum(a.n_prompts for a in anatomy.arms)}"
                         f" prompt(s) compared by {unit}).", (), anatomy)
    passes = run.counted_passes
    outputs = load_pass_outputs(run, passes)
    env_rows = run.table("environment").to_dict("records")
    arm_args: dict[str, dict[str, Any]] = {}
    findings: dict[str, str] = {}
    log_lines: dict[str, list[str]] = defaultdict(list)
    for r in env_rows:
        engine = r.get("engine") if isinstance(r.get("engine"), Mapping) else {}
        arm_args[str(r.get("arm"))] = dict(engine.get("args") or {})
        findings[str(r.get("arm"))] = " | ".join(str(x) for x in (r.get("log_findings") or []))
        log_lines[str(r.get("arm"))] += [str(x) for x in (r.get("log_findings") or [])]
    # blocks of the diverging passes, per arm (does a divergence span engine starts?)
    sched = run.table("schedule", ["event", "arm", "pass_index", "block"])
    block_of = {(str(a), int(p)): int(b) for e, a, p, b in sched.itertuples(index=False)
                if e == "start" and b is not None and not (isinstance(b, float) and math.isnan(b))}
    div_blocks: dict[str, set[int]] = defaultdict(set)
    for d in anatomy.divergences:
        for p in (d.reference.pass_index, d.other.pass_index):
            if (d.arm, p) in block_of:
                div_blocks[d.arm].add(block_of[(d.arm, p)])
    metrics = run.table("metrics", ["arm", "seq", "t", "num_requests_running", "step_batch_size"])
    series = _batch_series(metrics)
    per_step = any(s.per_step for s in series.values())
    pairs = _pairs(outputs, passes, series, unit)
    roles = _roles(run, passes)
    causes = [
        refused,
        _environment(env_rows, div_blocks),
        _batch_shape(pairs, arm_args, per_step),
        _setting(anatomy, roles, _probe_reports(run_dir, [Path(p) for p in probe_reports]),
                 findings),
        _near_tie(anatomy),
        _prefix_cache(header.get("engine_kind"), arm_args),
        _tokenization(outputs, anatomy),
        _attention_kv_tile(outputs, anatomy, log_lines, _engine_model(env_rows)),
    ]
    ranked = tuple(sorted(causes, key=lambda c: (-c.score, _ORDER.index(c.key))))
    top = ranked[0]
    message = (f"{anatomy.n_divergences} divergence(s) in {len({(d.arm, d.prompt_id) for d in anatomy.divergences})} "
               f"prompt(s); most likely cause: {top.title} ({top.strength}).")
    return Diagnosis(run_id, anatomy.n_divergences, False, message, ranked, anatomy)


def render_diagnosis(diagnosis: Diagnosis) -> str:
    """The diagnosis as plain text: the message, then each cause ranked with its evidence."""
    lines = [f"run {diagnosis.run_id}", diagnosis.message]
    if diagnosis.nothing_to_diagnose:
        return "\n".join(lines) + "\n"
    for i, c in enumerate(diagnosis.causes, start=1):
        lines.append(f"{i}. {c.title} [{c.strength}]: {c.summary}")
        lines += [f"   - {e}" for e in c.evidence]
    return "\n".join(lines) + "\n"
