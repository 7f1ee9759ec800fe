"""Divergence anatomy: where two passes of a prompt first differ, and how close a call it was there.

For every prompt whose counted passes differ, each counted pass that differs from the arm's
reference pass (its first counted pass, as in :mod:`bistat.analysis.summary`) gives one
:class:`DivergenceAnatomy`: the first differing token index, both tokens, both passes' top-k
logprobs there (the records' ``top_logprobs``), the top-1/top-2 margin of each pass, and a label:

*near-tie flip*
    the two passes chose different tokens and, in each pass, the two tokens were within the
    declared ε (``match.near_tie_epsilon``, in nats) of each other -- the flip that float
    rounding noise from a different reduction order causes at a near-tie;
*large drift*
    the tokens differ and at least one pass preferred its token by more than ε: more than a
    reduction order explains, worth a bug report (a rule may cap their count with the
    ``large_drifts_at_most`` criterion);
*logprob jitter*
    the token ids agree but a chosen-token logprob differs (unit ``token_ids+logprobs``) by at
    most ε; a larger difference is a *large drift*;
*undetermined*
    the records cannot tell: no top-k logprobs, the other pass's token is outside this pass's
    top-k while the bound this gives is within ε, or one output simply ended first.

The margin of a token divergence at position ``i`` -- reference pass chose ``a``, the other pass
``b`` -- is ``max(lp_ref(a) - lp_ref(b), lp_oth(b) - lp_oth(a))``: how far apart the two
candidates were in the pass that separated them most. For greedy decoding, where each pass's
choice is its top-1 and a near-tie's rival is its top-2, this is the larger of the two passes'
top-1/top-2 margins. When a rival is not in a pass's top-k, its logprob is at most the k-th
logprob, which bounds the margin from below (``margin_is_bound``).

Notes
-----
The default ε, :data:`DEFAULT_NEAR_TIE_EPSILON` = 0.125 nats, is one unit in the last place of a
bfloat16 logit of magnitude 16 to 32 (bfloat16 keeps 8 significant bits: ulp = 2**(e - 7)), the
range the top logits of served LLMs fall in. vLLM's lm_head runs in the model's dtype, so its
logits -- and every logprob difference between two tokens, a difference of two such logits -- come
in steps of that size: a flip that one rounding step causes shows a margin of 0 or 0.125. A
float32 engine (bistat's embedded one) rounds about 65,000 times finer; a declaration about
float32 can tighten ε to 1e-3 (a reduction over K = 2048 terms of magnitude 10 moves a logit by at
most about K * 2**-24 * 10 ~ 1e-3). See Goldberg (1991) for the error bound of a summation.

References
----------
.. [1] David Goldberg, What every computer scientist should know about floating-point
       arithmetic, ACM Computing Surveys 23(1), pp 5-48 (1991).
.. [2] Horace He and Thinking Machines Lab, Defeating Nondeterminism in LLM Inference,
       Thinking Machines Lab: Connectionism (2025).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from bistat.store.format import OUTPUT_LENGTH
from bistat.declare.run_registration import run_declaration
from bistat.store.readers import optional_float
from bistat.store.run_dir import RecordedRun
from bistat.core.divergence import first_divergence  # the one definition (re-exported here)

__all__ = [
    "ANATOMY_SCHEMA",
    "DEFAULT_NEAR_TIE_EPSILON",
    "DEFAULT_TOP_LOGPROBS",
    "LABELS",
    "Anatomy",
    "ArmAnatomy",
    "DivergenceAnatomy",
    "PassOutput",
    "SideAtDivergence",
    "anatomy_of_pair",
    "divergence_anatomy",
    "first_divergence",
    "kv_tile_boundary",
    "label_divergence",
    "load_pass_outputs",
    "pair_margin",
    "read_unit_and_epsilon",
]

ANATOMY_SCHEMA = "bistat.anatomy/1"
DEFAULT_NEAR_TIE_EPSILON = 0.125
DEFAULT_TOP_LOGPROBS = 5
NEAR_TIE = "near-tie flip"
LARGE_DRIFT = "large drift"
JITTER = "logprob jitter"
UNDETERMINED = "undetermined"
LABELS = (NEAR_TIE, LARGE_DRIFT, JITTER, UNDETERMINED)


# --------------------------------------------------------------------------------------------
# Pure core
# --------------------------------------------------------------------------------------------


def _lp(x: Any) -> float:
    """A recorded logprob as float; null (written for -inf) reads as -inf."""
    return -math.inf if x is None else float(x)


def _bits(x: Any) -> int | None:
    return None if x is None else int(np.asarray([float(x)], dtype="<f8").view("<i8")[0])


#: Fewest first divergences of an arm before a KV tile boundary is named (see kv_tile_boundary).
MIN_DIVERGENCES_FOR_KV_BOUNDARY = 20


def kv_tile_boundary(kv_lengths: Sequence[int],
                     min_divergences: int = MIN_DIVERGENCES_FOR_KV_BOUNDARY) -> int | None:
    """The attention tile ``T`` (a power of two >= 16) when every first divergence read more than
    ``T`` keys and the earliest read exactly ``T + 1``; None otherwise or with fewer than
    ``min_divergences``.

    ``kv_lengths`` are the keys each first differing token's attention read (prompt tokens +
    output index). Up to one KV tile any tile width reduces a row in the same order, so
    divergences that all start one key past a tile point at an attention kernel whose KV tile
    changes with the batch (FlashAttention 3 on Hopper: 128 or 192 keys at head size 64, chosen
    from the batch's longest query).

    >>> kv_tile_boundary([129, 130, 200] * 7)
    128
    >>> kv_tile_boundary([130, 200] * 10) is None, kv_tile_boundary([129] * 5) is None
    (True, True)
    """
    if len(kv_lengths) < min_divergences:
        return None
    tile = min(kv_lengths) - 1
    return tile if tile >= 16 and not tile & (tile - 1) else None


def _top_sorted(top: Iterable[Sequence[Any]] | None) -> tuple[tuple[int, float | None], ...]:
    if not top:
        return ()
    items = [(int(t), None if lp is None else float(lp)) for t, lp in top]
    return tuple(sorted(items, key=lambda e: (-_lp(e[1]), e[0])))


def _gap(top: Sequence[tuple[int, float | None]], own: int, rival: int) -> tuple[float, bool] | None:
    """``lp(own) - lp(rival)`` in one pass's top-k; a lower bound when the rival is not listed."""
    lps = {t: _lp(lp) for t, lp in top}
    if own not in lps:
        return None
    if rival in lps:
        return lps[own] - lps[rival], False
    if len(lps) < 2:
        return None  # only the chosen token listed: nothing bounds the rival usefully
    return lps[own] - min(lps.values()), True


def pair_margin(ref_top: Sequence[tuple[int, float | None]], ref_token: int,
                other_top: Sequence[tuple[int, float | None]], other_token: int,
                ) -> tuple[float | None, bool]:
    """The margin of a token divergence (module docstring) and whether it is only a lower bound.

    Parameters
    ----------
    ref_top, other_top : sequence of (token id, logprob)
        Each pass's top-k at the divergence (logprob None = -inf).
    ref_token, other_token : int
        The token each pass chose there.

    Returns
    -------
    (margin, is_bound) : (float or None, bool)
        ``margin`` is None when neither pass's top-k holds both tokens or a bound on the rival.

    Examples
    --------
    >>> pair_margin([(7, -0.69), (9, -0.70)], 7, [(9, -0.69), (7, -0.71)], 9)
    (0.020000000000000018, False)
    >>> pair_margin([(7, -0.1), (3, -4.0)], 7, [(9, -0.2), (7, -3.0)], 9)
    (3.9, True)
    """
    gaps = [g for g in (_gap(ref_top, ref_token, other_token),
                        _gap(other_top, other_token, ref_token)) if g is not None]
    if not gaps:
        return None, False
    exact = [v for v, bound in gaps if not bound]
    bounds = [v for v, bound in gaps if bound]
    best_exact = max(exact) if exact else None
    best_bound = max(bounds) if bounds else None
    if best_bound is not None and (best_exact is None or best_bound > best_exact):
        return float(best_bound), True
    return float(best_exact), False  # type: ignore[arg-type]


def label_divergence(kind: str, margin: float | None, is_bound: bool, epsilon: float) -> str:
    """The label of one divergence (module docstring) from its kind, margin and ε.

    Examples
    --------
    >>> label_divergence("token", 1e-5, False, 0.125)
    'near-tie flip'
    >>> label_divergence("token", 0.01, True, 0.125)
    'undetermined'
    >>> label_divergence("token", 2.0, True, 0.125)
    'large drift'
    >>> label_divergence("logprob", 1e-7, False, 0.125)
    'logprob jitter'
    """
    if not epsilon >= 0:
        raise ValueError(f"epsilon ({epsilon!r}) must be a number >= 0 (nats)")
    if margin is None or kind in ("length", "text"):
        return UNDETERMINED
    if margin > epsilon:
        return LARGE_DRIFT
    if is_bound:
        return UNDETERMINED
    return JITTER if kind == "logprob" else NEAR_TIE


# --------------------------------------------------------------------------------------------
# Result types
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SideAtDivergence:
    """One pass of a prompt at the divergence position."""

    pass_index: int
    seq: int | None
    token_id: int | None            # None: this output ended before the position
    logprob: float | None
    top: tuple[tuple[int, float | None], ...]   # top-k there, by logprob, highest first
    top1_top2_margin: float | None
    n_tokens: int
    finish_reason: str | None


@dataclass(frozen=True)
class DivergenceAnatomy:
    """One diverging (prompt, pass) against the arm's reference pass."""

    arm: str
    prompt_id: str
    position: int
    kind: str                       # "token" | "length" | "logprob" | "text"
    reference: SideAtDivergence
    other: SideAtDivergence
    margin: float | None
    margin_is_bound: bool
    label: str
    relative_position: float | None  # position / length of the shorter output


@dataclass(frozen=True)
class ArmAnatomy:
    """One arm's divergences, counted by label, with margin and position distributions."""

    arm: str
    reference_pass: int | None
    counted_passes: tuple[int, ...]
    n_prompts: int                  # prompts with a successful response in 2+ counted passes
    n_diverging_prompts: int
    n_divergences: int
    label_counts: tuple[tuple[str, int], ...]
    margins: tuple[float, ...]      # finite margins (bounds included), ascending
    positions: tuple[int, ...]      # first-divergence indices, ascending
    relative_positions: tuple[float, ...]

    def count(self, label: str) -> int:
        return dict(self.label_counts).get(label, 0)

    def share(self, label: str) -> float | None:
        return self.count(label) / self.n_divergences if self.n_divergences else None

    @property
    def margin_quantiles(self) -> dict[str, float] | None:
        """Min, quartiles and max of the margins (None without one)."""
        return _quantiles(self.margins)

    @property
    def position_quantiles(self) -> dict[str, float] | None:
        """Min, quartiles and max of the first-divergence indices (None without one)."""
        return _quantiles([float(p) for p in self.positions])

    @property
    def relative_position_quantiles(self) -> dict[str, float] | None:
        """Min, quartiles and max of the depths into the output (None without one)."""
        return _quantiles(list(self.relative_positions))


@dataclass(frozen=True)
class Anatomy:
    """The divergence anatomy of a run (``bistat.anatomy/1``)."""

    run_id: str
    unit: str
    epsilon: float
    top_k: int | None               # most top-k entries recorded at one position (None: none)
    arms: tuple[ArmAnatomy, ...]
    divergences: tuple[DivergenceAnatomy, ...]
    schema: str = field(default=ANATOMY_SCHEMA)

    def arm(self, name: str) -> ArmAnatomy:
        for a in self.arms:
            if a.arm == name:
                return a
        raise KeyError(f"arm {name!r} has no anatomy; arms: {', '.join(a.arm for a in self.arms)}")

    def large_drifts(self) -> dict[str, int]:
        """Large drifts per arm: what ``ArmStats.large_drifts`` takes for ``large_drifts_at_most``."""
        return {a.arm: a.count(LARGE_DRIFT) for a in self.arms}

    @property
    def n_divergences(self) -> int:
        return len(self.divergences)

    def to_dict(self) -> dict[str, Any]:
        def side(s: SideAtDivergence) -> dict[str, Any]:
            return {"pass_index": s.pass_index, "seq": s.seq, "token_id": s.token_id,
                    "logprob": _finite(s.logprob),
                    "top": [[t, _finite(lp)] for t, lp in s.top],
                    "top1_top2_margin": _finite(s.top1_top2_margin), "n_tokens": s.n_tokens,
                    "finish_reason": s.finish_reason}

        return {
            "schema": self.schema, "run_id": self.run_id, "unit": self.unit,
            "epsilon": self.epsilon, "top_k": self.top_k,
            "arms": [{"arm": a.arm, "reference_pass": a.reference_pass,
                      "counted_passes": list(a.counted_passes), "n_prompts": a.n_prompts,
                      "n_diverging_prompts": a.n_diverging_prompts,
                      "n_divergences": a.n_divergences,
                      "label_counts": {k: v for k, v in a.label_counts},
                      "margin_quantiles": a.margin_quantiles,
                      "position_quantiles": a.position_quantiles}
                     for a in self.arms],
            "divergences": [{"arm": d.arm, "prompt_id": d.prompt_id, "position": d.position,
                             "kind": d.kind, "label": d.label, "margin": _finite(d.margin),
                             "margin_is_bound": d.margin_is_bound,
                             "relative_position": d.relative_position,
                             "reference": side(d.reference), "other": side(d.other)}
                            for d in self.divergences],
        }


def _finite(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)


def _quantiles(values: Sequence[float]) -> dict[str, float] | None:
    if not values:
        return None
    arr = np.asarray(values, dtype=float)
    q = np.quantile(arr, [0.0, 0.25, 0.5, 0.75, 1.0], method="inverted_cdf")
    return {"min": float(q[0]), "q25": float(q[1]), "median": float(q[2]),
            "q75": float(q[3]), "max": float(q[4])}


# --------------------------------------------------------------------------------------------
# Reading the records
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PassOutput:
    """One successful response of a counted pass, with what the anatomy and diagnosis need."""

    arm: str
    pass_index: int
    seq: int | None
    prompt_id: str
    token_ids: tuple[int, ...]
    text: str | None
    logprobs: tuple[float | None, ...] | None
    top_logprobs: tuple[tuple[tuple[int, float | None], ...], ...] | None
    finish_reason: str | None
    n_prompt_tokens: int | None
    t_submit: float | None
    t_done: float | None
    #: the output's full length in tokens where the records keep only a prefix of it (a trimmed
    #: run: ``bistat.store.format.OUTPUT_LENGTH``); None: ``token_ids`` is the whole output
    n_output_tokens: int | None = None
    #: the recorded ``token_sha256`` (of the full output, also where a trimmed run keeps a prefix)
    token_sha256: str | None = None

    @property
    def n_tokens(self) -> int:
        """The output's length in tokens (recorded in full or not)."""
        return len(self.token_ids) if self.n_output_tokens is None else self.n_output_tokens

    @property
    def trimmed(self) -> bool:
        """Whether the records keep only a prefix of this output (``bistat compact --trim``)."""
        return self.n_output_tokens is not None and self.n_output_tokens != len(self.token_ids)


def load_pass_outputs(run_dir: str | Path | RecordedRun,
                      passes: Mapping[str, Sequence[int]] | None = None
                      ) -> dict[tuple[str, int, str], PassOutput]:
    """Successful responses of counted passes keyed by (arm, pass_index, prompt_id).

    The last response recorded for a (arm, pass, prompt) counts, as in the match count. In a
    trimmed run (``bistat compact --trim``) the outputs of passes other than each arm's reference
    pass hold a prefix only (``PassOutput.trimmed``; ``n_tokens`` is still the full length):
    enough for their first divergence from the reference pass, which
    :func:`divergence_anatomy` checks (``bistat.store.readers.check_trim``).
    """
    run = RecordedRun.of(run_dir)
    passes = run.counted_passes if passes is None else passes
    cols = ["arm", "seq", "pass_index", "kind", "prompt_id", "token_ids", "text", "logprobs",
            "top_logprobs", "finish_reason", "n_prompt_tokens", "t_submit", "t_done", "error",
            OUTPUT_LENGTH, "token_sha256"]
    frame = run.table("responses", cols, filters={"arm": list(passes), "kind": ["counted"]})
    out: dict[tuple[str, int, str], PassOutput] = {}
    wanted = {(a, int(p)) for a, ps in passes.items() for p in ps}
    for row in frame.itertuples(index=False):
        key = (str(row.arm), int(row.pass_index))
        if key not in wanted:
            continue
        if isinstance(row.error, str):
            out.pop((key[0], key[1], str(row.prompt_id)), None)
            continue
        top = row.top_logprobs
        lps = row.logprobs
        out[(key[0], key[1], str(row.prompt_id))] = PassOutput(
            arm=key[0], pass_index=key[1], seq=_opt_int(row.seq), prompt_id=str(row.prompt_id),
            token_ids=tuple(int(t) for t in (row.token_ids if row.token_ids is not None else ())),
            text=row.text if isinstance(row.text, str) else None,
            logprobs=None if lps is None else tuple(None if x is None or _isnan(x) else float(x)
                                                    for x in lps),
            top_logprobs=None if top is None else tuple(_top_sorted(pos) for pos in top),
            finish_reason=row.finish_reason if isinstance(row.finish_reason, str) else None,
            n_prompt_tokens=_opt_int(row.n_prompt_tokens),
            t_submit=optional_float(row.t_submit), t_done=optional_float(row.t_done),
            n_output_tokens=_opt_int(getattr(row, OUTPUT_LENGTH)),
            token_sha256=row.token_sha256 if isinstance(row.token_sha256, str) else None)
    return out


def _isnan(x: Any) -> bool:
    return isinstance(x, float) and math.isnan(x)


def _opt_int(x: Any) -> int | None:
    if x is None or (not isinstance(x, (list, tuple)) and pd.isna(x)):
        return None
    try:
        return int(x)
    except (TypeError, ValueError):
        return None


def arm_anatomy(arm: str, reference_pass: int | None, counted_passes: Sequence[int],
                n_prompts: int, divergences: Sequence[DivergenceAnatomy]) -> ArmAnatomy:
    """One arm's summary of its first divergences: label counts, sorted margins and positions."""
    counts = {lab: sum(d.label == lab for d in divergences) for lab in LABELS}
    return ArmAnatomy(
        arm=arm, reference_pass=reference_pass, counted_passes=tuple(counted_passes),
        n_prompts=n_prompts, n_diverging_prompts=len({d.prompt_id for d in divergences}),
        n_divergences=len(divergences),
        label_counts=tuple((lab, counts[lab]) for lab in LABELS),
        margins=tuple(sorted(d.margin for d in divergences
                             if d.margin is not None and math.isfinite(d.margin))),
        positions=tuple(sorted(d.position for d in divergences)),
        relative_positions=tuple(sorted(d.relative_position for d in divergences
                                        if d.relative_position is not None)))


def read_unit_and_epsilon(run_dir: str | Path | RecordedRun) -> tuple[str, float]:
    """The match unit and ε of the run's registration, or the defaults.

    ``match.near_tie_epsilon`` is read from the sealed declaration when it has the field; older
    registrations without it get :data:`DEFAULT_NEAR_TIE_EPSILON`.
    """
    unit, eps = "token_ids", DEFAULT_NEAR_TIE_EPSILON
    decl = run_declaration(run_dir)
    match = decl.get("match") if decl else None
    if isinstance(match, Mapping):
        unit = str(match.get("unit", unit))
        if match.get("near_tie_epsilon") is not None:
            eps = float(match["near_tie_epsilon"])
    return unit, eps


def _side(out: PassOutput, i: int) -> SideAtDivergence:
    tok = out.token_ids[i] if i < len(out.token_ids) else None
    lp = out.logprobs[i] if out.logprobs is not None and i < len(out.logprobs) else None
    top = out.top_logprobs[i] if out.top_logprobs is not None and i < len(out.top_logprobs) else ()
    m12 = None
    if len(top) >= 2:
        m12 = _lp(top[0][1]) - _lp(top[1][1])
        m12 = m12 if math.isfinite(m12) else None
    return SideAtDivergence(pass_index=out.pass_index, seq=out.seq, token_id=tok, logprob=lp,
                            top=tuple(top), top1_top2_margin=m12, n_tokens=out.n_tokens,
                            finish_reason=out.finish_reason)


def anatomy_of_pair(arm: str, ref: PassOutput, other: PassOutput, unit: str, epsilon: float
                    ) -> DivergenceAnatomy | None:
    """The anatomy of one pass against the reference pass, or None when they match by ``unit``."""
    with_lps = unit == "token_ids+logprobs"
    with_text = unit == "text"
    found = first_divergence(ref.token_ids, other.token_ids,
                             ref.logprobs if with_lps else None,
                             other.logprobs if with_lps else None,
                             ref.text if with_text else None, other.text if with_text else None)
    if found is None:
        return None
    pos, kind = found
    rs, os_ = _side(ref, pos), _side(other, pos)
    margin: float | None = None
    bound = False
    if kind == "token" and rs.token_id is not None and os_.token_id is not None:
        margin, bound = pair_margin(rs.top, rs.token_id, os_.top, os_.token_id)
    elif kind == "logprob" and rs.logprob is not None and os_.logprob is not None:
        margin = abs(rs.logprob - os_.logprob)
    shorter = min(ref.n_tokens, other.n_tokens)   # full lengths, in a trimmed run too
    return DivergenceAnatomy(
        arm=arm, prompt_id=ref.prompt_id, position=pos, kind=kind, reference=rs, other=os_,
        margin=margin, margin_is_bound=bound, label=label_divergence(kind, margin, bound, epsilon),
        relative_position=(pos / shorter) if shorter else None)


def divergence_anatomy(run_dir: str | Path | RecordedRun, *, epsilon: float | None = None,
                       unit: str | None = None) -> Anatomy:
    """The divergence anatomy of a recorded run.

    Parameters
    ----------
    run_dir : path or RecordedRun
        The run directory, or the run opened.
    epsilon : float, optional
        ε in nats; default: the registration's ``match.near_tie_epsilon``, else
        :data:`DEFAULT_NEAR_TIE_EPSILON`.
    unit : str, optional
        The match unit (``token_ids``, ``text``, ``token_ids+logprobs``); default: the
        registration's.

    Returns
    -------
    Anatomy
    """
    run = RecordedRun.of(run_dir)
    reg_unit, reg_eps = read_unit_and_epsilon(run)
    unit = unit or reg_unit
    if unit not in ("token_ids", "text", "token_ids+logprobs"):
        raise ValueError(f"unit ({unit!r}) must be one of 'token_ids', 'text', "
                         "'token_ids+logprobs'")
    eps = reg_eps if epsilon is None else float(epsilon)
    if not eps >= 0:
        raise ValueError(f"epsilon ({epsilon!r}) must be a number >= 0 (nats)")
    passes = run.counted_passes
    run.check_trim({arm: plist[0] if plist else None for arm, plist in passes.items()}, unit)
    outputs = load_pass_outputs(run, passes)
    top_k = max((len(pos) for o in outputs.values() if o.top_logprobs for pos in o.top_logprobs),
                default=None)
    divs: list[DivergenceAnatomy] = []
    arms: list[ArmAnatomy] = []
    for arm, plist in passes.items():
        ref_pass = plist[0] if plist else None
        prompts = sorted({pid for (a, _, pid) in outputs if a == arm})
        arm_divs: list[DivergenceAnatomy] = []
        n_prompts = 0
        for pid in prompts:
            ref = outputs.get((arm, ref_pass, pid)) if ref_pass is not None else None
            others = [outputs.get((arm, p, pid)) for p in plist[1:]]
            others = [o for o in others if o is not None]
            if ref is None or not others:
                continue
            n_prompts += 1
            for o in others:
                d = anatomy_of_pair(arm, ref, o, unit, eps)
                if d is not None:
                    arm_divs.append(d)
        arms.append(arm_anatomy(arm, ref_pass, plist, n_prompts, arm_divs))
        divs.extend(arm_divs)
    return Anatomy(run_id=run.run_id, unit=unit, epsilon=eps,
                   top_k=top_k, arms=tuple(arms), divergences=tuple(divs))
