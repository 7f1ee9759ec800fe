"""Matching (the analysis's phase 3): each arm's outputs compared over its counted passes by the
match unit, the first divergences of the prompts that differ, and their anatomy.

The match counts are vectorised over prompt codes (:func:`_match_arm`); the outputs themselves
(token ids, logprobs, top-k) are read for the mismatching prompts only, once, for both the first
divergences and the anatomy (:mod:`bistat.analysis.anatomy`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np
import pandas as pd

from bistat.analysis import anatomy as anat
from bistat.analysis.passes import PassSummary
from bistat.analysis.results import AnalysisError, ArmSummary, Divergence
from bistat.core import stats
from bistat.core.divergence import divergence_position
from bistat.declare.experiment import Experiment
from bistat.store.format import OUTPUT_LENGTH
from bistat.store.passes import recorded_again
from bistat.store.readers import optional_float as _opt_float
from bistat.store.readers import optional_int as _opt_int
from bistat.store.readers import optional_str as _opt_str
from bistat.store.run_dir import RecordedRun

__all__ = ["ArmMatch", "Matching", "match_arms"]


@dataclass(frozen=True)
class Matching:
    """Phase 3 (matching): the arms' match counts, their first divergences and anatomy."""

    arms: tuple[ArmSummary, ...]
    matches: Mapping[str, ArmMatch]
    arm_passes: Mapping[str, list[int]]
    anatomy: anat.Anatomy
    last: pd.DataFrame          # the counted passes' responses
    duplicated: np.ndarray      # rows of ``last`` recorded again later (a resumed run)
    # arm -> the pass index of each of its ArmSummary.pass_throughputs
    throughput_passes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    # arm -> the schedule round of each of its ArmSummary.pass_throughputs (a paired cost
    # interval pairs the arms' passes of one round)
    throughput_rounds: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    # (arm, pass index) -> the schedule round of each counted pass (PassSummary.round)
    rounds: Mapping[tuple[str, int], int] = field(default_factory=dict)


def match_arms(run: RecordedRun, exp: Experiment, responses: pd.DataFrame,
               passes: Sequence[PassSummary], deviations: list[str]) -> Matching:
    """Phase 3 (matching): each arm's outputs over its counted passes, compared by the unit."""
    unit, multi = exp.match.unit, exp.match.multi_pass
    cl = exp.rule.confidence_level
    arm_names = [a.name for a in exp.arms]
    roles = {a.name: a.role for a in exp.arms}
    counted_rows = (responses["kind"] == "counted").to_numpy()
    last = responses[counted_rows]
    prompt_codes, prompt_ids = pd.factorize(last["prompt_id"], sort=True)
    arm_codes, arm_uniques = pd.factorize(last["arm"])
    arm_code = {str(a): i for i, a in enumerate(arm_uniques)}
    pass_idx = last["pass_index"].to_numpy(dtype=np.int64)
    dup = recorded_again(last)
    if dup.any():
        deviations.append(f"{int(dup.sum())} response(s) recorded twice for one prompt and pass "
                          "(resumed run); the last recorded counts")
    key_codes, _ = pd.factorize(_match_key(last, unit))
    failed_rows = last["error"].notna().to_numpy()
    prompt_ids = np.asarray(prompt_ids, dtype=object)
    arm_summaries: list[ArmSummary] = []
    matches: dict[str, ArmMatch] = {}
    arm_passes: dict[str, list[int]] = {}
    thr_passes: dict[str, tuple[int, ...]] = {}
    thr_rounds: dict[str, tuple[int, ...]] = {}
    for arm in arm_names:
        cpasses = sorted(p.pass_index for p in passes if p.arm == arm and p.counted)
        sel = (arm_codes == arm_code.get(arm, -2)) & np.isin(pass_idx, cpasses) & ~dup
        matches[arm] = _match_arm(prompt_codes[sel], key_codes[sel], failed_rows[sel],
                                  prompt_ids, len(cpasses), multi)
        arm_passes[arm] = cpasses
    # a trimmed run keeps other passes' outputs only to their first divergence from the
    # reference pass it assumed: refuse another reference or a unit that needs more
    run.check_trim({a: ps[0] if ps else None for a, ps in arm_passes.items()}, unit)
    outputs = _load_outputs(run, {a: m.mismatched for a, m in matches.items()}, unit)
    anatomy = _anatomy(outputs, run.run_id, unit, exp.match.near_tie_epsilon, arm_passes,
                       {a: m.mismatched for a, m in matches.items()},
                       {a: int(m.ok.sum()) for a, m in matches.items()})
    for arm in arm_names:
        m, cpasses = matches[arm], arm_passes[arm]
        divs = _divergences(outputs, arm, m.mismatched, cpasses, unit)
        interval = None
        if m.n_units > 0:
            interval = stats.wilson_interval(m.n_matched, m.n_units, cl, "two-sided")
        timed = [p for p in passes
                 if p.arm == arm and p.counted and p.output_tokens_per_s is not None]
        thr = tuple(float(p.output_tokens_per_s) for p in timed)
        thr_passes[arm] = tuple(int(p.pass_index) for p in timed)
        thr_rounds[arm] = tuple(int(p.round) for p in timed if p.round is not None)
        arm_summaries.append(ArmSummary(
            name=arm, role=roles[arm], counted_passes=tuple(cpasses),
            reference_pass=cpasses[0] if cpasses else None, n_prompts_recorded=m.n_recorded,
            n_prompts=int(m.ok.sum()), n_excluded_failed=m.n_failed_prompts,
            n_excluded_missing=m.n_missing, n_excluded_no_logprobs=m.n_no_logprobs,
            n_prompts_matched=int(m.matched.sum()),
            unit="prompt" if multi == "all" else "prompt pair",
            n_units=m.n_units, n_matched=m.n_matched, match_interval=interval,
            pass_throughputs=thr, n_failed_requests=m.n_failed_requests,
            divergences=tuple(divs)))
    rounds = {(p.arm, p.pass_index): p.round for p in passes if p.round is not None}
    return Matching(tuple(arm_summaries), matches, arm_passes, anatomy, last, dup, thr_passes,
                    thr_rounds, rounds)


def _match_key(resp: pd.DataFrame, unit: str) -> pd.Series:
    if unit == "token_ids":
        return resp["token_sha256"]
    if unit == "text":
        return resp["text"]
    if unit == "token_ids+logprobs":
        tok, lp = resp["token_sha256"], resp["logprob_sha256"]
        both = tok.notna() & lp.notna()
        key = pd.Series(None, index=resp.index, dtype=object)
        key[both] = tok[both].astype(str) + "|" + lp[both].astype(str)
        return key
    raise AnalysisError(f"match unit {unit!r} is not known; expected 'token_ids', 'text' or "
                        "'token_ids+logprobs'")


@dataclass
class ArmMatch:
    """One arm's outputs matched over its counted passes, per prompt code."""

    ok: np.ndarray             # bool per prompt code: compared
    matched: np.ndarray        # bool per prompt code: identical in every counted pass
    mismatched: list[str]      # prompt ids compared and not identical, sorted
    n_recorded: int
    n_failed_prompts: int
    n_missing: int
    n_no_logprobs: int
    n_units: int
    n_matched: int
    n_failed_requests: int


def _match_arm(pid: np.ndarray, key: np.ndarray, failed: np.ndarray, prompt_ids: np.ndarray,
               n_passes: int, multi_pass: str) -> ArmMatch:
    """Count matches of one arm from its counted responses (one row per prompt x pass).

    ``pid`` and ``key`` are integer codes (prompt, match key; ``key < 0``: no key), ``failed``
    marks failed requests, ``prompt_ids`` maps prompt codes back to ids. Vectorised with
    ``np.bincount`` / ``np.unique`` so that 10^6 responses take well under a second.
    """
    n = len(prompt_ids)
    n_rows = np.bincount(pid, minlength=n)
    present = n_rows > 0
    any_failed = np.bincount(pid, weights=failed, minlength=n) > 0
    no_key_row = (key < 0) & ~failed
    any_no_key = np.bincount(pid, weights=no_key_row, minlength=n) > 0
    is_failed = present & any_failed
    is_missing = present & (n_rows < n_passes) & ~is_failed
    is_no_key = present & any_no_key & ~is_failed & ~is_missing
    ok = present & ~is_failed & ~is_missing & ~is_no_key
    rows = ok[pid]
    n_keys = int(key.max()) + 2 if key.size else 1
    pairs = pid[rows].astype(np.int64) * n_keys + (key[rows].astype(np.int64) + 1)
    uniq, counts = np.unique(pairs, return_counts=True)
    n_unique = np.bincount(uniq // n_keys, minlength=n)
    matched = ok & (n_unique == 1)
    mismatched = [str(x) for x in prompt_ids[ok & ~matched]]
    if multi_pass == "all":
        n_units, n_matched = int(ok.sum()), int(matched.sum())
    elif multi_pass == "pairwise":
        n_matched = int((counts * (counts - 1) // 2).sum())
        n_units = int(ok.sum()) * n_passes * (n_passes - 1) // 2
    else:
        raise AnalysisError(f"multi_pass {multi_pass!r} is not known; expected 'all' or 'pairwise'")
    return ArmMatch(
        ok=ok, matched=matched, mismatched=sorted(mismatched), n_recorded=int(present.sum()),
        n_failed_prompts=int(is_failed.sum()), n_missing=int(is_missing.sum()),
        n_no_logprobs=int(is_no_key.sum()), n_units=n_units, n_matched=n_matched,
        n_failed_requests=int(failed.sum()),
    )


#: Columns read for the mismatching prompts: first divergences and their anatomy.
_OUTPUT_COLUMNS = ["arm", "seq", "kind", "pass_index", "prompt_id", "token_ids", "text",
                   "logprobs", "top_logprobs", "finish_reason", "n_prompt_tokens", "t_submit",
                   "t_done", "error", OUTPUT_LENGTH]


def _load_outputs(run: RecordedRun, mismatched: Mapping[str, Sequence[str]], unit: str
                  ) -> pd.DataFrame:
    """Outputs (token ids, logprobs, top-k...) of the mismatching prompts only, in one read."""
    cols = list(_OUTPUT_COLUMNS)
    arms = [a for a, ids in mismatched.items() if ids]
    if not arms:
        return pd.DataFrame({c: [] for c in cols})
    prompts = sorted({p for a in arms for p in mismatched[a]})
    return run.table("responses", cols, filters={"arm": arms, "prompt_id": prompts})


def _divergences(got: pd.DataFrame, arm: str, mismatched: Sequence[str], passes: Sequence[int],
                 unit: str) -> list[Divergence]:
    """First-divergence positions of the mismatching prompts of one arm."""
    if not mismatched:
        return []
    got = got[got["arm"] == arm]
    counted = set(passes)
    outputs: dict[tuple[str, int], tuple[list, list | None, int | None]] = {}
    lps = (got["logprobs"].tolist() if unit == "token_ids+logprobs" and "logprobs" in got
           else [None] * len(got))
    n_prompt = (got["n_prompt_tokens"].tolist() if "n_prompt_tokens" in got
                else [None] * len(got))
    # the last response recorded per (prompt, pass) counts, as in the match count
    for kind, p, pid, ids, lp, npt in zip(got["kind"].tolist(), got["pass_index"].tolist(),
                                          got["prompt_id"].tolist(), got["token_ids"].tolist(),
                                          lps, n_prompt):
        if kind == "counted" and int(p) in counted:
            outputs[(pid, int(p))] = (ids or [], lp, _opt_int(npt))
    ref_pass = min(passes)
    others = sorted(counted - {ref_pass})
    out: list[Divergence] = []
    for pid in mismatched:
        ref = outputs.get((pid, ref_pass))
        if ref is None:
            continue
        for p in others:
            cur = outputs.get((pid, p))
            if cur is None:
                continue
            pos = divergence_position(ref[0], cur[0], ref[1], cur[1], unit)
            if pos is not None:
                out.append(Divergence(arm=arm, prompt_id=str(pid), pass_index=p,
                                      reference_pass=ref_pass, position=pos,
                                      n_prompt_tokens=ref[2]))
    return out


def _pass_outputs(got: pd.DataFrame, arm: str, passes: Sequence[int]
                  ) -> dict[tuple[int, str], anat.PassOutput]:
    """Successful responses of one arm's counted passes by (pass, prompt); the last recorded wins."""
    out: dict[tuple[int, str], anat.PassOutput] = {}
    if got.empty:
        return out
    counted = {int(p) for p in passes}
    rows = got[(got["arm"] == arm) & (got["kind"] == "counted")]
    for row in rows.itertuples(index=False):
        key = (int(row.pass_index), str(row.prompt_id))
        if key[0] not in counted:
            continue
        if _opt_str(row.error) is not None:
            out.pop(key, None)
            continue
        ids = row.token_ids if row.token_ids is not None else ()
        lps, top = row.logprobs, row.top_logprobs
        out[key] = anat.PassOutput(
            arm=arm, pass_index=key[0], seq=_opt_int(row.seq), prompt_id=key[1],
            token_ids=tuple(int(t) for t in ids), text=_opt_str(row.text),
            logprobs=None if lps is None else tuple(_opt_float(x) for x in lps),
            top_logprobs=None if top is None else tuple(
                tuple(sorted(((int(t), _opt_float(lp)) for t, lp in pos),  # as bistat.analysis.anatomy
                             key=lambda e: (math.inf if e[1] is None else -e[1], e[0])))
                for pos in top),
            finish_reason=_opt_str(row.finish_reason), n_prompt_tokens=_opt_int(row.n_prompt_tokens),
            t_submit=_opt_float(row.t_submit), t_done=_opt_float(row.t_done),
            n_output_tokens=_opt_int(getattr(row, OUTPUT_LENGTH)))
    return out


def _anatomy(got: pd.DataFrame, run_id: str, unit: str, epsilon: float,
             arm_passes: Mapping[str, Sequence[int]], mismatched: Mapping[str, Sequence[str]],
             n_compared: Mapping[str, int]) -> anat.Anatomy:
    """The divergence anatomy over the mismatching prompts (what ``bistat.analysis.anatomy`` defines).

    Only mismatching prompts can diverge, so reading their rows alone gives every divergence;
    each counted pass is compared with the arm's reference pass (its first counted pass).
    """
    divs: list[anat.DivergenceAnatomy] = []
    arms: list[anat.ArmAnatomy] = []
    top_k: int | None = None
    for arm, plist in arm_passes.items():
        plist = sorted(plist)
        outputs = _pass_outputs(got, arm, plist) if mismatched.get(arm) else {}
        for o in outputs.values():
            for pos in o.top_logprobs or ():
                top_k = max(top_k or 0, len(pos))
        ref_pass = plist[0] if plist else None
        arm_divs: list[anat.DivergenceAnatomy] = []
        for pid in sorted(mismatched.get(arm, ())):
            ref = outputs.get((ref_pass, pid)) if ref_pass is not None else None
            if ref is None:
                continue
            for p in plist[1:]:
                other = outputs.get((p, pid))
                if other is None:
                    continue
                d = anat.anatomy_of_pair(arm, ref, other, unit, epsilon)
                if d is not None:
                    arm_divs.append(d)
        arms.append(anat.arm_anatomy(arm, ref_pass, plist, int(n_compared.get(arm, 0)),
                                     arm_divs))
        divs.extend(arm_divs)
    return anat.Anatomy(run_id=run_id, unit=unit, epsilon=float(epsilon), top_k=top_k,
                        arms=tuple(arms), divergences=tuple(divs))
