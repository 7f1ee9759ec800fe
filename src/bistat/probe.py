"""The bitwise needle-in-batch probe: does an engine give a prompt the same bits alone and in a batch?

An engine that asked for batch invariance does not say whether it got it (vLLM prints no line
saying the mode is on). The probe checks behaviour instead, on any engine, through the
:class:`~bistat.engines.base.Engine` protocol:

1. the *needle* (one prompt of the workload) is run alone, twice (the second run checks plain
   run-to-run determinism);
2. in each of ``trials`` trials, the needle is placed at a random position among ``n`` filler
   prompts (``n`` drawn uniformly from ``[min_fillers, max_fillers]``, default 32–128; fillers
   drawn without replacement from the rest of the workload; all submitted at once, so they
   share batches), with ``numpy.random.default_rng(SeedSequence([seed, 2, trial]))``;
3. the needle's token ids and chosen-token logprobs are compared **bitwise** with the first
   alone run (float64 bit patterns, so ``-0.0 != 0.0`` and one ulp counts);
4. every filler that came back from two or more trials is compared bitwise with its output in
   the first of them: the same prompt among other neighbours, at another place. This costs no
   engine time and multiplies the prompts tested; one needle alone can miss a difference that
   only some prompts show (``h200-match-smollm2-r2``: the FlashAttention-3 arms' needle stayed
   identical while 457 of 541 prompts diverged across the study's passes).

The needle is prompt ``needle_index`` of the declaration's prompt source (default 0), or the one a
recorded run of the same workload saw diverge first (:func:`needle_from_run`, ``bistat probe
--needle-from RUN_DIR``): a needle that happens to be insensitive misses what the study saw
(``h200-match-smollm2-r2`` again: its needle, prompt 0, stayed identical). The report then says
where the needle came from (``needle_source``).

A probe that finds no difference proves nothing unless it could have found one. Every probe
therefore runs the same procedure on a *negative control*: an arm in which invariance is off
(the declaration's control arm by default, e.g. ``gemm = "blas"``), which must show at least one
difference. It runs first, so that a probe stopped by its time budget keeps its power. Outcomes:

``confirmed``
    every probed arm is bitwise invariant and the negative control differs: the probe has
    power and invariance is confirmed (exit code 0).
``violated``
    a probed arm gave the needle different bits in some batch, or alone twice, or a filler
    different bits in two trials (exit code 11).
``no_power``
    the probed arms are invariant but so is the negative control: the probe could not have
    seen a difference at this size; raise the fillers, tokens or trials (exit code 12).
``untested``
    an engine refused the setting, failed to start, died, the needle's request failed, or the
    mode needs a capability the engine lacks (reported *unsupported*) (exit code 12).
``vacuous``
    the probed arms showed no difference, but the engine's batching evidence does not show the
    needle sharing an engine step with other requests in any trial: the sweep never tested what
    it claims to, so the label is *untested* (exit code 12). The evidence is the embedded
    engine's exact per-step batch sizes (metrics samples with ``step_batch_size``) while the
    needle was in flight, else the running-request counts of the engine's metrics samples
    (the last one before the needle was submitted and every one until it finished). Engines
    that can sample after every step (``every_step_metrics``, the vLLM offline adapter) do so
    during the probe's passes, which are shorter than their usual sampling interval.

Modes (``ProbeSettings.mode``)
------------------------------
``batch`` (default)
    the needle alone and among fillers, as above.
``prefill-decode``
    the logprob each generated token got while decoding, against the one it gets when the same
    prefix (prompt + earlier generated tokens) is prefilled -- the engine's
    ``prompt_logprobs(request, continuation)`` (the embedded adapter's forward functions; vLLM's
    ``prompt_logprobs`` request field over HTTP). Engines without it are reported unsupported.
``prefix-cache``
    the needle with the prefix cache cold (first after engine start, or after the server's
    ``/reset_prefix_cache`` where it has one) and warm (at once again), ``trials`` times. vLLM
    turns the cache on per arm with ``enable_prefix_caching = true`` in the arm's ``args``
    (``--enable-prefix-caching``). Engines without a prefix cache (the embedded one) are
    reported unsupported.

Every request asks for the declaration's ``workload.top_logprobs`` alternatives.
"""

from __future__ import annotations

import contextlib
import math
import struct
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal, Mapping, Sequence

import numpy as np

from bistat.divergence import first_divergence
from bistat.engines.base import (
    Engine,
    EngineError,
    EngineUnsupported,
    GenerationRequest,
    GenerationResult,
    MetricsSample,
)
from bistat.workload import Prompt, load_prompts, prompt_seed, prompts_sha256

if TYPE_CHECKING:  # pragma: no cover
    from bistat.experiment import Arm, Experiment

__all__ = [
    "ArmProbe",
    "NeedleError",
    "NeedleSource",
    "ProbeOutcome",
    "ProbeReport",
    "ProbeSettings",
    "ProbeTrial",
    "PROBE_MODES",
    "compare_bitwise",
    "shared_step_evidence",
    "probe_arm",
    "needle_from_run",
    "run_probe",
    "report_from_json",
    "merge_reports",
    "decide_report",
]

ProbeOutcome = Literal["confirmed", "violated", "no_power", "untested", "vacuous"]
ProbeMode = Literal["batch", "prefill-decode", "prefix-cache"]
PROBE_MODES: tuple[str, ...] = ("batch", "prefill-decode", "prefix-cache")
PROBE_SCHEMA = "bistat.probe/1"


@dataclass(frozen=True)
class ProbeSettings:
    """How the probe is run (see the module docstring)."""

    trials: int = 3
    min_fillers: int = 32
    max_fillers: int = 128
    needle_index: int = 0
    max_tokens: int = 32
    seed: int = 0
    mode: str = "batch"

    def __post_init__(self) -> None:
        if self.mode not in PROBE_MODES:
            raise ValueError(f"mode ({self.mode!r}) must be one of "
                             + ", ".join(repr(m) for m in PROBE_MODES))
        if self.trials < 1:
            raise ValueError(f"trials must be at least 1, got {self.trials}")
        if not 1 <= self.min_fillers <= self.max_fillers:
            raise ValueError(
                f"need 1 <= min_fillers <= max_fillers, got {self.min_fillers} and {self.max_fillers}"
            )
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.needle_index < 0:
            raise ValueError(f"needle_index must be >= 0, got {self.needle_index}")


@dataclass(frozen=True)
class Comparison:
    """Bitwise comparison of two results of the needle."""

    tokens_equal: bool
    logprobs_equal: bool | None  # None: an engine returned no logprobs
    first_divergence: int | None  # first token index whose id (or logprob bits) differ

    @property
    def identical(self) -> bool:
        return self.tokens_equal and self.logprobs_equal is not False


def _bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def compare_bitwise(a: GenerationResult, b: GenerationResult) -> Comparison:
    """Compare token ids, and chosen-token logprobs as float64 bit patterns.

    Examples
    --------
    >>> r = lambda ids, lps: GenerationResult("n", ids, "", lps, None, None, None, 0.0, None, 0.0)
    >>> compare_bitwise(r([1, 2], [-0.5, -1.0]), r([1, 2], [-0.5, -1.0])).identical
    True
    >>> compare_bitwise(r([1, 2], [-0.5, -1.0]), r([1, 2], [-0.5, -1.0000000000000002]))
    Comparison(tokens_equal=True, logprobs_equal=False, first_divergence=1)
    """
    tokens_equal = list(a.token_ids) == list(b.token_ids)
    logprobs_equal: bool | None = None
    if a.logprobs is not None and b.logprobs is not None:
        logprobs_equal = [_bits(x) for x in a.logprobs] == [_bits(x) for x in b.logprobs]
    # where they first differ: the one definition the analysis and the anatomy use too
    found = first_divergence(a.token_ids, b.token_ids, a.logprobs, b.logprobs)
    first = None if found is None else found[0]
    if first is None and logprobs_equal is False:   # lists longer than the token ids differ
        first = min(len(a.token_ids), len(b.token_ids))
    return Comparison(tokens_equal=tokens_equal, logprobs_equal=logprobs_equal, first_divergence=first)


@dataclass(frozen=True)
class ProbeTrial:
    """One placement of the needle among fillers."""

    trial: int
    n_fillers: int
    position: int
    tokens_equal: bool | None
    logprobs_equal: bool | None
    first_divergence: int | None
    error: str | None = None
    shared_step: bool | None = None   # batch mode: the needle shared an engine step (None: no evidence)
    evidence: str | None = None       # the batching (or mode) evidence, in words

    @property
    def identical(self) -> bool:
        return self.error is None and bool(self.tokens_equal) and self.logprobs_equal is not False


@dataclass(frozen=True)
class ArmProbe:
    """The probe on one arm."""

    arm: str
    role: str  # "probed" or "negative_control"
    alone_repeat_identical: bool | None
    trials: tuple[ProbeTrial, ...]
    n_needle_tokens: int | None
    error: str | None = None
    # batch mode: the fillers that ran in two or more trials (other neighbours, other places),
    # each compared bitwise with its first trial's output -- free extra evidence beside the
    # needle; None in reports written before it was recorded
    n_fillers_compared: int | None = None
    fillers_differing: tuple[str, ...] = ()
    filler_first_divergence: int | None = None

    @property
    def differs(self) -> bool:
        """At least one bitwise difference was seen (the needle alone twice, the needle alone vs
        in a batch, or a filler between two trials)."""
        return self.alone_repeat_identical is False or bool(self.fillers_differing) or any(
            t.error is None and not t.identical for t in self.trials
        )

    @property
    def failed(self) -> bool:
        return self.error is not None or any(t.error is not None for t in self.trials)

    @property
    def n_shared(self) -> int:
        """Trials whose batching evidence shows the needle sharing an engine step."""
        return sum(t.shared_step is True for t in self.trials)


@dataclass(frozen=True)
class NeedleSource:
    """Where the needle came from when a recorded run chose it (:func:`needle_from_run`): the
    prompt whose first divergence, bitwise, came earliest in the run, and where it came."""

    run: str                  # the run directory, as it was given
    run_id: str               # its run.json's run_id
    prompt_id: str
    prompt_index: int         # the needle's index in the declaration's prompt source
    arm: str                  # where it first diverged: the arm,
    pass_index: int           # the counted pass,
    reference_pass: int       # the arm's reference pass (its first counted pass) it differed from,
    position: int             # the first differing token index,
    kind: str                 # and how: "token", "logprob" (chosen-token logprob bits), "length"
    n_prompts_diverged: int   # the run's prompts that diverged in some arm and pass

    def describe(self) -> str:
        """The choice in words, e.g. ``prompt 17 (chat-0017) first diverged at token 3 in arm
        default, pass 2 of runs/r (against pass 0), the earliest of 457 diverging prompt(s)``."""
        how = {"logprob": " (chosen-token logprob bits)", "length": " (one output ended there)"}
        return (f"prompt {self.prompt_index} ({self.prompt_id}) first diverged at token "
                f"{self.position}{how.get(self.kind, '')} in arm {self.arm}, pass "
                f"{self.pass_index} of {self.run} (against pass {self.reference_pass}), the "
                f"earliest of {self.n_prompts_diverged} diverging prompt(s)")


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

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["schema"] = PROBE_SCHEMA
        if self.needle_source is None:
            del data["needle_source"]
        for arm, probe in zip(data["arms"], self.arms):
            arm["differs"] = probe.differs
            if probe.n_fillers_compared is None:   # not a batch probe: no filler evidence
                for key in ("n_fillers_compared", "fillers_differing", "filler_first_divergence"):
                    del arm[key]
            else:
                arm["fillers_differing"] = list(probe.fillers_differing)
        for key in ("pending", "merged_from"):
            if not data[key]:
                del data[key]
            else:
                data[key] = list(data[key])
        return data

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (``to_json``), for readers that serialise any object by ``to_dict``."""
        return self.to_json()

    def summary_lines(self) -> list[str]:
        """The human summary: one line per arm, then the outcome and its reason."""
        st = self.settings
        if st.mode == "batch":
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
            same = sum(t.identical for t in a.trials)
            repeat = {True: "identical", False: "DIFFERENT", None: "n/a"}[a.alone_repeat_identical]
            firsts = sorted({t.first_divergence for t in a.trials if t.first_divergence is not None})
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
        if self.pending:
            lines.append(f"  not probed: {', '.join(self.pending)}")
        lines.append(f"outcome: {self.outcome} — {self.reason}")
        return lines


def filler_line(a: ArmProbe) -> str:
    """The filler evidence of a batch probe in words (for reports and findings)."""
    if not a.fillers_differing:
        return f"fillers in two or more trials: {a.n_fillers_compared}, all identical"
    return (f"fillers in two or more trials: {a.n_fillers_compared}, DIFFERENT in "
            f"{len(a.fillers_differing)} (first at token {a.filler_first_divergence})")


def _run_batch(engine: Engine, requests: Sequence[GenerationRequest]
               ) -> tuple[dict[str, GenerationResult], list[MetricsSample]]:
    """One pass of ``requests``, all submitted at once.

    An engine that samples its metrics on an interval but can sample after every engine step
    (an ``every_step_metrics()`` context manager: the vLLM offline adapter) is asked to: the
    probe's passes are shorter than the interval, and one sample per pass cannot show the needle
    sharing a step (on the H200 it was one stale sample, "max 0", in 2 of 3 trials; see
    :mod:`bistat.engines.vllm_offline_worker`).
    """
    results: dict[str, GenerationResult] = {}
    samples: list[MetricsSample] = []

    def on_result(result: GenerationResult) -> None:
        results[result.prompt_id] = result

    every_step = _capability(engine, "every_step_metrics")
    with every_step() if every_step is not None else contextlib.nullcontext():
        engine.run_pass(requests, concurrency=len(requests), on_result=on_result,
                        on_metrics=samples.append)
    return results, samples


def _needle_result(results: dict[str, GenerationResult], needle_id: str) -> GenerationResult:
    result = results.get(needle_id)
    if result is None:
        raise _ProbeFailed(f"the engine returned no result for the needle {needle_id!r}")
    if result.error is not None:
        raise _ProbeFailed(f"the needle's request failed: {result.error}")
    return result


class _ProbeFailed(Exception):
    pass


def _finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)


def shared_step_evidence(samples: Sequence[MetricsSample], needle: GenerationResult
                         ) -> tuple[bool | None, str]:
    """Did the needle share an engine step with other requests, by the engine's batching evidence?

    Per-step samples (``step_batch_size``) count when the step finished while the needle was in
    flight (``t_submit < t <= t_done``); a batch of 2 or more there means it shared a step.
    Without them, the running-request samples count: the last one at or before ``t_submit`` and
    every one up to ``t_done``; 2 or more running means shared. No usable sample: None.

    Returns
    -------
    (bool or None, str)
        The answer and the evidence in words.

    Examples
    --------
    >>> r = GenerationResult("n", [1], "", None, None, None, None, 1.0, None, 2.0)
    >>> step = lambda t, b: MetricsSample(t, math.nan, math.nan, math.nan, math.nan, math.nan,
    ...                                   "embedded-step", step_batch_size=b)
    >>> shared_step_evidence([step(1.5, 1.0), step(1.9, 3.0)], r)
    (True, 'per-step batch sizes while the needle ran: 2 step(s), max 3, mean 2')
    >>> shared_step_evidence([step(1.5, 1.0)], r)
    (False, 'per-step batch sizes while the needle ran: 1 step(s), max 1, mean 1')
    """
    lo, hi = needle.t_submit, needle.t_done
    steps = [float(x.step_batch_size) for x in samples
             if _finite(x.step_batch_size) and lo < x.t <= hi]
    if steps:
        return (max(steps) >= 2, f"per-step batch sizes while the needle ran: {len(steps)} "
                                 f"step(s), max {max(steps):g}, mean {sum(steps) / len(steps):.3g}")
    running = sorted(((x.t, float(x.num_requests_running)) for x in samples
                      if x.step_batch_size is None and _finite(x.num_requests_running)),
                     key=lambda p: p[0])
    before = [v for t, v in running if t <= lo][-1:]
    during = [v for t, v in running if lo < t <= hi]
    window = before + during
    if not window:
        return None, "no batching evidence: the engine reported no metrics while the needle ran"
    return (max(window) >= 2, f"running requests from {len(window)} metrics sample(s) around "
                              f"the needle: max {max(window):g}")


def _capability(engine: Engine, name: str) -> Callable[..., Any] | None:
    """An optional engine method (``prompt_logprobs``, ``reset_prefix_cache``), or None.

    Adapters that wrap an HTTP client (``vllm_server``) may offer it on their ``client``.
    """
    for obj in (engine, getattr(engine, "client", None)):
        fn = getattr(obj, name, None) if obj is not None else None
        if callable(fn):
            return fn
    return None


def _prefix_caching(engine: Engine) -> bool | None:
    """Whether the engine runs with a prefix cache: True/False where it says, None if it has none."""
    for obj in (engine, getattr(engine, "client", None)):
        v = getattr(obj, "enable_prefix_caching", None) if obj is not None else None
        if isinstance(v, bool):
            return v
    return None


@dataclass(frozen=True)
class _FillerEvidence:
    n_compared: int
    differing: tuple[str, ...]
    first_divergence: int | None


def _compare_fillers(per_trial: Sequence[Mapping[str, GenerationResult]]) -> _FillerEvidence:
    """Each filler that came back from two or more trials, compared bitwise with its output in
    the first of them: the same prompt among other neighbours at another place in the batch."""
    first: dict[str, GenerationResult] = {}
    compared: set[str] = set()
    differing: dict[str, None] = {}
    earliest: int | None = None
    for results in per_trial:
        for pid, r in results.items():
            if r.error is not None:
                continue
            if pid not in first:
                first[pid] = r
                continue
            compared.add(pid)
            c = compare_bitwise(first[pid], r)
            if not c.identical:
                differing.setdefault(pid)
                if c.first_divergence is not None:
                    earliest = (c.first_divergence if earliest is None
                                else min(earliest, c.first_divergence))
    return _FillerEvidence(len(compared), tuple(differing), earliest)


def _batch_trials(engine: Engine, needle: Prompt, needle_request: GenerationRequest,
                  alone: GenerationResult, fillers: Sequence[Prompt], settings: ProbeSettings,
                  make_request: Callable[[Prompt], GenerationRequest]
                  ) -> tuple[list[ProbeTrial], _FillerEvidence]:
    trials = []
    filler_results: list[dict[str, GenerationResult]] = []
    for t in range(settings.trials):
        rng = np.random.default_rng(np.random.SeedSequence([settings.seed, 2, t]))
        n = int(rng.integers(settings.min_fillers, settings.max_fillers + 1))
        chosen = [fillers[int(i)] for i in rng.choice(len(fillers), size=n, replace=False)]
        position = int(rng.integers(0, n + 1))
        batch = [make_request(p) for p in chosen[:position]] + [needle_request] + [
            make_request(p) for p in chosen[position:]
        ]
        try:
            results, samples = _run_batch(engine, batch)
            result = _needle_result(results, needle.prompt_id)
        except (_ProbeFailed, EngineError) as exc:
            trials.append(ProbeTrial(t, n, position, None, None, None, error=str(exc)))
            continue
        c = compare_bitwise(alone, result)
        shared, evidence = shared_step_evidence(samples, result)
        trials.append(ProbeTrial(t, n, position, c.tokens_equal, c.logprobs_equal,
                                 c.first_divergence, shared_step=shared, evidence=evidence))
        filler_results.append({p.prompt_id: results[p.prompt_id] for p in chosen
                               if p.prompt_id in results})
    return trials, _compare_fillers(filler_results)


def _prefill_trials(engine: Engine, needle_request: GenerationRequest,
                    alone: GenerationResult) -> list[ProbeTrial]:
    fn = _capability(engine, "prompt_logprobs")
    if fn is None:
        raise EngineUnsupported(
            f"unsupported: engine kind {getattr(engine, 'kind', '?')!r} offers no prompt logprobs "
            "(a prompt_logprobs method), so prefill cannot be compared with decode")
    if alone.logprobs is None:
        raise EngineUnsupported("unsupported: the engine returned no logprobs for the needle")
    prefill = [float(x) for x in fn(needle_request, list(alone.token_ids))]
    decode = [float(x) for x in alone.logprobs]
    pre = replace(alone, logprobs=prefill)
    c = compare_bitwise(alone, pre)
    diffs = [abs(a - b) for a, b in zip(decode, prefill) if math.isfinite(a) and math.isfinite(b)]
    evidence = (f"{len(prefill)} position(s) compared; max |decode - prefill| "
                f"{max(diffs) if diffs else 0.0:.3g} nats")
    return [ProbeTrial(0, 0, 0, True, c.logprobs_equal, c.first_divergence, evidence=evidence)]


def _prefix_cache_trials(engine: Engine, needle: Prompt, needle_request: GenerationRequest,
                         cold_first: GenerationResult, settings: ProbeSettings) -> list[ProbeTrial]:
    state = _prefix_caching(engine)
    if state is None:
        raise EngineUnsupported(
            f"unsupported: engine kind {getattr(engine, 'kind', '?')!r} has no prefix cache")
    reset = _capability(engine, "reset_prefix_cache")
    trials = []
    cold = cold_first  # the first needle after the engine started: the cache held nothing of it
    for t in range(settings.trials):
        how = "first after engine start"
        if t > 0:
            if reset is None or not reset():
                how = "no cache reset available: cold run is warm too"
            else:
                how = "after /reset_prefix_cache"
            cold = _needle_result(_run_batch(engine, [needle_request])[0], needle.prompt_id)
        warm = _needle_result(_run_batch(engine, [needle_request])[0], needle.prompt_id)
        c = compare_bitwise(cold, warm)
        trials.append(ProbeTrial(t, 0, 0, c.tokens_equal, c.logprobs_equal, c.first_divergence,
                                 evidence=f"prefix caching {'on' if state else 'off'}; cold: {how}"))
    return trials


def probe_arm(
    engine: Engine,
    arm: str,
    role: str,
    needle: Prompt,
    fillers: Sequence[Prompt],
    settings: ProbeSettings,
    make_request: Callable[[Prompt], GenerationRequest],
) -> ArmProbe:
    """Run the probe on one started engine (the caller starts and stops it)."""
    if settings.mode == "batch" and len(fillers) < settings.max_fillers:
        raise ValueError(f"need at least {settings.max_fillers} filler prompts, got {len(fillers)}")
    needle_request = make_request(needle)
    fill: _FillerEvidence | None = None
    try:
        alone = _needle_result(_run_batch(engine, [needle_request])[0], needle.prompt_id)
        if settings.mode == "prefix-cache":
            trials = _prefix_cache_trials(engine, needle, needle_request, alone, settings)
            again = alone  # the warm repeats are the trials
            repeat: bool | None = None
        else:
            again = _needle_result(_run_batch(engine, [needle_request])[0], needle.prompt_id)
            repeat = compare_bitwise(alone, again).identical
            if settings.mode == "prefill-decode":
                trials = _prefill_trials(engine, needle_request, alone)
            else:
                trials, fill = _batch_trials(engine, needle, needle_request, alone, fillers,
                                             settings, make_request)
    except EngineUnsupported as exc:
        return ArmProbe(arm=arm, role=role, alone_repeat_identical=None, trials=(),
                        n_needle_tokens=None, error=str(exc))
    except (_ProbeFailed, EngineError) as exc:
        return ArmProbe(arm=arm, role=role, alone_repeat_identical=None, trials=(), n_needle_tokens=None,
                        error=str(exc))
    return ArmProbe(
        arm=arm,
        role=role,
        alone_repeat_identical=repeat,
        trials=tuple(trials),
        n_needle_tokens=len(alone.token_ids),
        n_fillers_compared=None if fill is None else fill.n_compared,
        fillers_differing=() if fill is None else fill.differing,
        filler_first_divergence=None if fill is None else fill.first_divergence,
    )


def _decide(arms: Sequence[ArmProbe], mode: str = "batch") -> tuple[ProbeOutcome, str]:
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
    done = {"batch": "bitwise identical alone and in every batch"
                     + (" (the fillers too, across trials)" if fillers_too else ""),
            "prefill-decode": "decode logprobs bitwise equal to prefill logprobs",
            "prefix-cache": "bitwise identical with the prefix cache cold and warm"}[mode]
    return "confirmed", f"{done}, and the negative control differs"


class NeedleError(ValueError):
    """A recorded run cannot choose the needle (:func:`needle_from_run`)."""


#: How a recorded run's outputs are compared to choose the needle: bitwise, as the probe compares
#: (token ids, then chosen-token logprobs as float64 bits), whatever the run's match unit.
NEEDLE_UNIT = "token_ids+logprobs"


def _workload_words(workload: Mapping[str, Any] | None) -> dict[str, Any]:
    if not isinstance(workload, Mapping):
        return {}
    return {k: workload.get(k) for k in ("source", "n_prompts", "seed")}


def _check_same_prompts(run_dir: Path, prompts: Sequence[Prompt], experiment: "Experiment",
                        declaration: str) -> None:
    """Refuse a run recorded with other prompts than ``experiment``'s workload: a prompt index
    would name another prompt in each. ``run.json``'s ``workload_sha256`` decides; a run
    recorded before it was kept is checked by the prompt ids its responses recorded per index."""
    from bistat import records
    from bistat.anatomy import run_declaration

    header = records.read_header(run_dir)
    run_json = run_dir / records.HEADER_FILE
    fix = ("choose the needle from a run of this declaration's workload, or give the needle's "
           "index with --needle INDEX")
    recorded = header.get("workload_sha256")
    if recorded is not None:
        mine = prompts_sha256(prompts)
        if recorded == mine:
            return
        theirs = _workload_words((run_declaration(run_dir) or {}).get("workload"))
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
    frame = records.read_table(run_dir, "responses", ["prompt_id", "prompt_index"])
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
                f"{run_dir}: the run was recorded with other prompts than {declaration}'s workload "
                f"(its responses record prompt {i} as {pid!r}, but {where}; {run_json} has no "
                f"workload_sha256 to compare): a prompt index names another prompt in each; {fix}")


def needle_from_run(run_dir: str | Path, experiment: "Experiment", *,
                    declaration: str = "the declaration", base_dir: Path | None = None
                    ) -> NeedleSource:
    """The needle a recorded run of the same workload suggests: the prompt that diverged first.

    Every counted pass of every arm is compared with the arm's reference pass (its first counted
    pass), as the divergence anatomy does (:func:`bistat.anatomy.divergence_anatomy`), bitwise
    as the probe compares (:data:`NEEDLE_UNIT`). The needle is the prompt whose earliest first
    divergence, over all arms and passes, has the smallest token index; ties go to the lowest
    prompt index (then the arm, then the pass, in order, say where).

    Parameters
    ----------
    run_dir : path
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
    bistat.records.RecordsError
        The run directory cannot be read.
    """
    from bistat.anatomy import divergence_anatomy

    run_dir = Path(run_dir)
    wl = experiment.workload
    prompts = load_prompts(wl.source, wl.n_prompts, wl.seed, base_dir=base_dir)
    _check_same_prompts(run_dir, prompts, experiment, declaration)
    anatomy = divergence_anatomy(run_dir, unit=NEEDLE_UNIT)
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


def run_probe(
    experiment: "Experiment",
    *,
    arms: Sequence[str] | None = None,
    control: str | None = None,
    settings: ProbeSettings = ProbeSettings(),
    engine_factory: Callable[["Experiment", "Arm"], Engine] | None = None,
    on_arm: Callable[[str], None] | None = None,
    on_report: Callable[[ProbeReport], None] | None = None,
    needle_source: NeedleSource | None = None,
) -> ProbeReport:
    """Probe ``arms`` (default: every treatment arm) with ``control`` as the negative control
    (default: the declaration's control arm; ``""`` for none), one engine at a time.

    The prompts come from the declaration's prompt source (``max_fillers + 1`` of them, or the
    needle index + 1 when larger) with the declaration's sampling settings, its
    ``workload.top_logprobs`` and ``settings.max_tokens``.

    ``needle_source``: the recorded run that chose the needle (:func:`needle_from_run`; its
    ``prompt_index`` must be ``settings.needle_index``), kept in the report.

    ``on_report`` receives the report so far after every arm (its ``pending`` names the arms
    still to run), so that a caller can keep it on disk: an interrupted probe loses only the arm
    it was on.
    """
    by_name = {a.name: a for a in experiment.arms}
    probed = list(arms) if arms else [a.name for a in experiment.treatments]
    control_name = experiment.control.name if control is None else control
    for name in [*probed, *([control_name] if control_name else [])]:
        if name not in by_name:
            raise ValueError(f"arm {name!r} is not in the declaration; arms: {', '.join(by_name)}")
    if control_name in probed:
        raise ValueError(f"arm {control_name!r} cannot be both probed and the negative control")
    if needle_source is not None and needle_source.prompt_index != settings.needle_index:
        raise ValueError(f"needle_source names prompt {needle_source.prompt_index} but "
                         f"settings.needle_index is {settings.needle_index}; set needle_index "
                         "to the source's prompt_index")
    wl = experiment.workload
    n = max(settings.max_fillers + 1, settings.needle_index + 1)
    prompts = load_prompts(wl.source, n, wl.seed)
    needle = prompts[settings.needle_index]
    if needle_source is not None and needle_source.prompt_id != needle.prompt_id:
        raise ValueError(f"needle_source names prompt {needle_source.prompt_id!r} but prompt "
                         f"{settings.needle_index} of the declaration's source is "
                         f"{needle.prompt_id!r}; choose it with needle_from_run")
    fillers = [p for p in prompts if p.prompt_id != needle.prompt_id]

    def make_request(p: Prompt) -> GenerationRequest:
        return p.request(max_tokens=settings.max_tokens, temperature=wl.temperature, top_p=wl.top_p,
                         top_k=wl.top_k, seed=prompt_seed(wl.seed, p.index), ignore_eos=wl.ignore_eos,
                         logprobs=wl.top_logprobs)

    if engine_factory is None:
        from bistat.engines.registry import create_engine

        engine_factory = create_engine
    results: list[ArmProbe] = []
    # the negative control runs first: a probe stopped by its budget then keeps its power, and
    # the arms it did not reach can be probed later without a control (`merge_reports`). The
    # report lists the probed arms first, the control last, whatever the order they ran in.
    plan = ([(control_name, "negative_control")] if control_name else []) + [(name, "probed") for name in probed]

    def in_report_order(done: list[ArmProbe]) -> list[ArmProbe]:
        return sorted(done, key=lambda a: a.role == "negative_control")
    for i, (name, role) in enumerate(plan):
        if on_arm is not None:
            on_arm(name)
        engine = None
        try:
            engine = engine_factory(experiment, by_name[name])
            engine.start()
        except EngineError as exc:
            results.append(ArmProbe(name, role, None, (), None, error=f"{type(exc).__name__}: {exc}"))
        except BaseException:   # interrupted while starting: leave no engine behind
            if engine is not None:
                with contextlib.suppress(Exception):
                    engine.stop()
            raise
        else:
            try:
                results.append(probe_arm(engine, name, role, needle, fillers, settings, make_request))
            finally:
                engine.stop()
        if on_report is not None and i + 1 < len(plan):
            on_report(decide_report(in_report_order(results), settings, needle.prompt_id,
                                    pending=tuple(n for n, _ in plan[i + 1:]),
                                    needle_source=needle_source))
    report = decide_report(in_report_order(results), settings, needle.prompt_id,
                           needle_source=needle_source)
    if on_report is not None:
        on_report(report)
    return report


def decide_report(arms: Sequence[ArmProbe], settings: ProbeSettings, needle_prompt_id: str, *,
                  pending: tuple[str, ...] = (), merged_from: tuple[str, ...] = (),
                  needle_source: NeedleSource | None = None) -> ProbeReport:
    """The report over ``arms``; with ``pending`` arms it is partial, and says so in its reason."""
    outcome, reason = _decide(arms, settings.mode)
    if pending:
        reason = f"partial: {', '.join(pending)} not probed yet; {reason}"
    return ProbeReport(outcome=outcome, reason=reason, settings=settings,
                       needle_prompt_id=needle_prompt_id, arms=tuple(arms), pending=pending,
                       merged_from=merged_from, needle_source=needle_source)


def _needle_source_from_json(data: Any) -> NeedleSource | None:
    """The ``needle_source`` of a report's JSON (absent in reports written before it was kept);
    fields a later writer adds are ignored."""
    if data is None:
        return None
    known = {f.name for f in fields(NeedleSource)}
    return NeedleSource(**{k: v for k, v in dict(data).items() if k in known})


def report_from_json(data: Mapping[str, Any], source: str = "probe report") -> ProbeReport:
    """A :class:`ProbeReport` from its JSON (``bistat probe --output``); ``source`` names it in
    errors."""
    if not isinstance(data, Mapping) or data.get("schema") != PROBE_SCHEMA:
        got = data.get("schema") if isinstance(data, Mapping) else type(data).__name__
        raise ValueError(f"{source}: field 'schema' is {got!r}, expected {PROBE_SCHEMA!r}; write "
                         "it with `bistat probe REGISTRATION --output FILE`")
    try:
        settings = ProbeSettings(**data["settings"])
        arms = tuple(
            ArmProbe(arm=str(a["arm"]), role=str(a["role"]),
                     alone_repeat_identical=a.get("alone_repeat_identical"),
                     trials=tuple(ProbeTrial(**t) for t in a.get("trials") or ()),
                     n_needle_tokens=a.get("n_needle_tokens"), error=a.get("error"),
                     n_fillers_compared=a.get("n_fillers_compared"),
                     fillers_differing=tuple(a.get("fillers_differing") or ()),
                     filler_first_divergence=a.get("filler_first_divergence"))
            for a in data["arms"])
        return ProbeReport(outcome=data["outcome"], reason=str(data["reason"]), settings=settings,
                           needle_prompt_id=str(data["needle_prompt_id"]), arms=arms,
                           pending=tuple(data.get("pending") or ()),
                           merged_from=tuple(data.get("merged_from") or ()),
                           needle_source=_needle_source_from_json(data.get("needle_source")))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{source}: not a complete {PROBE_SCHEMA} report ({exc!r}); write it "
                         "with `bistat probe REGISTRATION --output FILE`") from None


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
                         merged_from=tuple(src for src, _ in reports), needle_source=source)
