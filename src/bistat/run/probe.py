"""The bitwise needle-in-batch probe: does an engine give a prompt the same bits alone and in a batch?

The probe has one home per stage: this module runs it on the engines and records what it saw
(:func:`record_probe` -> :class:`~bistat.run.probe_records.ProbeRecord`);
:mod:`bistat.analysis.probe_report` decides the outcomes described below, chooses a needle from a
recorded run and reads ``probe.json``; ``bistat probe`` is :mod:`bistat.cli.cmd_probe`.

An engine that asked for batch invariance does not say whether it got it (vLLM prints no line
saying the mode is on). The probe checks behaviour instead, on any engine, through the
:class:`~bistat.engines.base.Engine` protocol: *needles* are run alone, twice (the second run
checks plain run-to-run determinism), then among *fillers* in ``trials`` trials; each needle's
token ids and chosen-token logprobs are compared **bitwise** with its first alone run (float64 bit
patterns, so ``-0.0 != 0.0`` and one ulp counts); and every filler that came back from two or more
trials is compared bitwise with its output in the first of them: the same prompt among other
neighbours, at another place. That costs no engine time and multiplies the prompts tested.
``n`` fillers per trial are drawn uniformly from
``[min_fillers, max_fillers]`` (default 32-128) without replacement from the rest of the
workload, with ``numpy.random.default_rng(SeedSequence([seed, design, trial]))``.

Designs (``ProbeSettings.design``, batch mode)
----------------------------------------------
``kv-sweep`` (default)
    What batch dependence in the attention kernel needs in order to show: a row is reduced over
    KV tiles, so up
    to one tile any tile width gives the same bits, and a kernel whose tile changes with the
    batch (FA3 picks 64 x 192 or 192 x 128 from the step's longest query) changes a decoding
    row's bits only past the tile, and only in a step that holds a prefill. So:

    * **needles of several lengths**: the declaration's needle prompt as it is, plus one needle
      per entry of ``long_needles`` (default about 112, 176, 304 and 600 prompt tokens): the
      needle prompt followed by the next prompts of the workload until the length is reached
      (token-id prompts exactly; text at :data:`CHARS_PER_TOKEN` characters per token, so
      approximately; the report gives each needle's prompt tokens as the engine counted them).
      Each decodes ``max_tokens`` (default 128) tokens with ``ignore_eos``, so together they run
      from the short prompt's few keys past 64, 128, 192, 256, 384 and 640 keys;
    * **fillers arriving while the needles decode**: all needles start in the first wave, at
      random places among it, and the fillers (``filler_tokens / 2`` to ``filler_tokens``
      tokens each, default 16, fixed per prompt, also with ``ignore_eos``) are kept
      :func:`fillers_in_flight` at a time, so that a new one is prefilled every few engine
      steps for as long as the needles decode (the pass's ``concurrency``; a prompt submitted
      all at once, as the ``single`` design does, is prefilled in the first steps only and the
      needle then decodes among decode rows alone);
    * a **verdict per needle** (:func:`needle_verdicts`, e.g. violated at 304 tokens and
      confirmed at 112) beside the verdict per arm, which is decided as before over all needles.

    Needles whose length estimate (+25 %) plus ``max_tokens`` exceeds the ``max_model_len`` of
    the engine arguments are left out and listed (``left_out``). Cost per arm: ``2 x (1 + len(
    long_needles))`` passes of one request (10 by default) and ``trials`` passes of the needles
    and their fillers (3 by default, each about ``max_tokens + filler_tokens`` engine steps).
``single``
    One needle (the declaration's needle prompt, with the workload's ``max_tokens`` and
    ``ignore_eos``) placed at a random position among its fillers, all submitted at once.
    Reports written before designs existed read as ``single``.

The needle is prompt ``needle_index`` of the declaration's prompt source (default 0), or the one a
recorded run of the same workload saw diverge first
(:func:`bistat.analysis.probe_needle.needle_from_run`, ``bistat probe
--needle-from RUN_DIR``): a needle that happens to be insensitive misses what the study saw.
The report then says
where the needle came from (``needle_source``); in the ``kv-sweep`` design the long needles start
with it.

A probe that finds no difference proves nothing unless it could have found one. Every probe
therefore runs the same procedure on a *negative control*: an arm in which invariance is off
(the declaration's control arm by default, e.g. ``gemm = "blas"``), which must show at least one
difference. It runs first, so that a probe stopped by its time budget keeps its power. Outcomes
(per arm, over every needle; ``kv-sweep`` decides the same outcomes per needle as well):

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
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import numpy as np

from bistat.engines.base import (
    Engine,
    EngineError,
    EngineUnsupported,
    EveryStepMetrics,
    GenerationRequest,
    GenerationResult,
    MetricsSample,
    PrefixCacheReset,
    PrefixCaching,
    PromptLogprobs,
)
from bistat.run.probe_records import (
    ArmProbe,
    CHARS_PER_TOKEN,
    NeedleProbe,
    NeedleSource,
    ProbeRecord,
    ProbeSettings,
    ProbeTrial,
    compare_bitwise,
)
from bistat.run.workload import Prompt, load_prompts, prompt_seed

if TYPE_CHECKING:  # pragma: no cover
    from bistat.declare.experiment import Arm, Experiment

__all__ = [
    "filler_tokens_of",
    "fillers_in_flight",
    "long_needle",
    "shared_step_evidence",
    "probe_arm",
    "record_probe",
]


def _run_batch(engine: Engine, requests: Sequence[GenerationRequest],
               concurrency: int | None = None
               ) -> tuple[dict[str, GenerationResult], list[MetricsSample]]:
    """One pass of ``requests``: all submitted at once, or (``concurrency``) at most that many in
    flight, the next submitted as one finishes.

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

    every_step = isinstance(engine, EveryStepMetrics)
    with engine.every_step_metrics() if every_step else contextlib.nullcontext():
        engine.run_pass(requests, concurrency=concurrency or len(requests), on_result=on_result,
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


def _prefix_caching(engine: Engine) -> bool | None:
    """Whether the engine runs with a prefix cache: True/False where it says, None if it has none."""
    if isinstance(engine, PrefixCaching) and isinstance(engine.enable_prefix_caching, bool):
        return engine.enable_prefix_caching
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


def filler_tokens_of(prompt: Prompt, filler_tokens: int) -> int:
    """The tokens a kv-sweep filler generates: between ``filler_tokens / 2`` and
    ``filler_tokens``, fixed per prompt (every trial asks the same of it, so fillers compare
    across trials), so that fillers started together finish at different steps and the next
    ones arrive spread out rather than in bursts.

    >>> [filler_tokens_of(Prompt(f"p{i}", i, "x", False), 16) for i in range(9)]
    [16, 15, 14, 13, 12, 11, 10, 9, 16]
    """
    return filler_tokens - prompt.index % ((filler_tokens + 1) // 2)


def fillers_in_flight(filler_steps: int, needle_tokens: int, filler_tokens: int) -> int:
    """Fillers kept in flight beside the needles in a kv-sweep trial: the fillers' tokens together
    (``filler_steps``, one engine step each), at this many at a time, keep arriving for
    ``needle_tokens + filler_tokens`` steps, past the needles' last token.

    >>> fillers_in_flight(32 * 12, 128, 16), fillers_in_flight(128 * 12, 128, 16)
    (2, 10)
    """
    return max(1, filler_steps // (needle_tokens + filler_tokens))


def long_needle(base: Prompt, pool: Sequence[Prompt], target_tokens: int) -> Prompt:
    """The needle of about ``target_tokens`` prompt tokens: ``base`` followed by the prompts of
    ``pool`` in order (again from the start if it runs out) until the length is reached; token-id
    prompts are joined exactly, text prompts (``"\n\n"`` between them) at
    :data:`CHARS_PER_TOKEN` characters per token. Its id is ``needle-<target_tokens>``.

    >>> p = lambda i, ids: Prompt(f"p{i}", i, tuple(ids), False)
    >>> long_needle(p(0, [1, 2]), [p(1, [3, 4, 5]), p(2, [6])], 7).prompt
    (1, 2, 3, 4, 5, 6, 3)
    """
    if not pool:
        raise ValueError("a long needle needs other prompts to follow the needle prompt")
    if isinstance(base.prompt, str):
        text, i = base.prompt, 0
        while len(text) < target_tokens * CHARS_PER_TOKEN:
            nxt = pool[i % len(pool)].prompt
            text += "\n\n" + (nxt if isinstance(nxt, str) else " ".join(map(str, nxt)))
            i += 1
        prompt: str | tuple[int, ...] = text
    else:
        ids, i = list(base.prompt), 0
        while len(ids) < target_tokens:
            nxt = pool[i % len(pool)].prompt
            if isinstance(nxt, str):
                raise ValueError("cannot join a text prompt to a token-id needle")
            ids += list(nxt)
            i += 1
        prompt = tuple(ids[:target_tokens])
    return Prompt(prompt_id=f"needle-{target_tokens}", index=base.index, prompt=prompt,
                  chat=base.chat)


def _filler_request(p: Prompt, lifetimes: Mapping[str, int],
                    make_request: Callable[..., GenerationRequest]) -> GenerationRequest:
    return make_request(p, max_tokens=lifetimes[p.prompt_id], ignore_eos=True)


def _sweep_trial(t: int, n: int, position: int, runs: Sequence[ProbeTrial]) -> ProbeTrial:
    """One kv-sweep trial of an arm summed up over its needles: identical when every needle is,
    first divergence the earliest token index, sharing a step when any needle did."""
    errors = sorted({r.error for r in runs if r.error is not None})
    if errors:
        return ProbeTrial(t, n, position, None, None, None, error="; ".join(errors))
    lps = [r.logprobs_equal for r in runs]
    firsts = [r.first_divergence for r in runs if r.first_divergence is not None]
    shared = [r.shared_step for r in runs]
    return ProbeTrial(
        t, n, position, all(r.tokens_equal for r in runs),
        False if False in lps else None if None in lps else True, min(firsts) if firsts else None,
        shared_step=True if True in shared else False if False in shared else None,
        evidence=f"{sum(x is True for x in shared)} of {len(runs)} needle(s) shared an engine step")


def _sweep(engine: Engine, targeted: Sequence[tuple[Prompt, int | None]],
           fillers: Sequence[Prompt], settings: ProbeSettings,
           make_request: Callable[..., GenerationRequest]
           ) -> tuple[list[NeedleProbe], list[ProbeTrial], _FillerEvidence]:
    """The kv-sweep design on one started engine (module docstring): ``targeted`` pairs each
    needle with its design length (None: the needle prompt as it is)."""
    needles = [p for p, _ in targeted]
    requests = {p.prompt_id: make_request(p, ignore_eos=True) for p in needles}
    alone: dict[str, GenerationResult] = {}
    repeat: dict[str, bool] = {}
    for p in needles:
        first = _needle_result(_run_batch(engine, [requests[p.prompt_id]])[0], p.prompt_id)
        again = _needle_result(_run_batch(engine, [requests[p.prompt_id]])[0], p.prompt_id)
        alone[p.prompt_id], repeat[p.prompt_id] = first, compare_bitwise(first, again).identical
    per_needle: dict[str, list[ProbeTrial]] = {p.prompt_id: [] for p in needles}
    summed: list[ProbeTrial] = []
    filler_results: list[dict[str, GenerationResult]] = []
    k = len(needles)
    for t in range(settings.trials):
        rng = np.random.default_rng(np.random.SeedSequence([settings.seed, 3, t]))
        n = int(rng.integers(settings.min_fillers, settings.max_fillers + 1))
        chosen = [fillers[int(i)] for i in rng.choice(len(fillers), size=n, replace=False)]
        lifetimes = {p.prompt_id: filler_tokens_of(p, settings.filler_tokens) for p in chosen}
        wave = k + fillers_in_flight(sum(lifetimes.values()), settings.max_tokens,
                                     settings.filler_tokens)
        slots = [int(x) for x in rng.choice(wave, size=k, replace=False)]   # needle j at slots[j]
        order: list[GenerationRequest | None] = [None] * (n + k)
        for p, slot in zip(needles, slots):
            order[slot] = requests[p.prompt_id]
        rest = iter(chosen)
        batch = [r if r is not None else _filler_request(next(rest), lifetimes, make_request)
                 for r in order]
        try:
            results, samples = _run_batch(engine, batch, concurrency=wave)
        except EngineError as exc:
            runs = [ProbeTrial(t, n, slot, None, None, None, error=str(exc)) for slot in slots]
        else:
            runs = []
            for p, slot in zip(needles, slots):
                try:
                    result = _needle_result(results, p.prompt_id)
                except _ProbeFailed as exc:
                    runs.append(ProbeTrial(t, n, slot, None, None, None, error=str(exc)))
                    continue
                c = compare_bitwise(alone[p.prompt_id], result)
                shared, evidence = shared_step_evidence(samples, result)
                runs.append(ProbeTrial(t, n, slot, c.tokens_equal, c.logprobs_equal,
                                       c.first_divergence, shared_step=shared, evidence=evidence))
            filler_results.append({p.prompt_id: results[p.prompt_id] for p in chosen
                                   if p.prompt_id in results})
        for p, run in zip(needles, runs):
            per_needle[p.prompt_id].append(run)
        summed.append(_sweep_trial(t, n, slots[0], runs))
    probes = [NeedleProbe(
        needle=p.prompt_id, target_tokens=target,
        n_prompt_tokens=alone[p.prompt_id].n_prompt_tokens,
        n_tokens=len(alone[p.prompt_id].token_ids),
        alone_repeat_identical=repeat[p.prompt_id],
        trials=tuple(per_needle[p.prompt_id])) for p, target in targeted]
    return probes, summed, _compare_fillers(filler_results)


def _prefill_trials(engine: Engine, needle_request: GenerationRequest,
                    alone: GenerationResult) -> list[ProbeTrial]:
    if not isinstance(engine, PromptLogprobs):
        raise EngineUnsupported(
            f"unsupported: engine kind {getattr(engine, 'kind', '?')!r} offers no prompt logprobs "
            "(a prompt_logprobs method), so prefill cannot be compared with decode")
    if alone.logprobs is None:
        raise EngineUnsupported("unsupported: the engine returned no logprobs for the needle")
    prefill = [float(x) for x in engine.prompt_logprobs(needle_request, list(alone.token_ids))]
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
    reset = engine.reset_prefix_cache if isinstance(engine, PrefixCacheReset) else None
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
    make_request: Callable[..., GenerationRequest],
    long_needles: Sequence[tuple[Prompt, int]] = (),
) -> ArmProbe:
    """Run the probe on one started engine (the caller starts and stops it).

    ``make_request(prompt, max_tokens=None, ignore_eos=None)`` builds a request (None: the
    settings' and the workload's values); ``long_needles`` are the kv-sweep design's needles
    beside ``needle``, each with its design length (:func:`long_needle`).
    """
    if settings.mode == "batch" and len(fillers) < settings.max_fillers:
        raise ValueError(f"need at least {settings.max_fillers} filler prompts, got {len(fillers)}")
    if settings.sweep:
        try:
            needles, summed, swept = _sweep(engine, [(needle, None), *long_needles], fillers,
                                            settings, make_request)
        except (_ProbeFailed, EngineError) as exc:   # a needle alone failed: nothing to compare
            return ArmProbe(arm=arm, role=role, alone_repeat_identical=None, trials=(),
                            n_needle_tokens=None, error=str(exc))
        repeats = [n.alone_repeat_identical for n in needles]
        return ArmProbe(
            arm=arm, role=role,
            alone_repeat_identical=False if False in repeats else None if None in repeats else True,
            trials=tuple(summed), n_needle_tokens=needles[0].n_tokens,
            n_fillers_compared=swept.n_compared, fillers_differing=swept.differing,
            filler_first_divergence=swept.first_divergence, needles=tuple(needles))
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


def record_probe(
    experiment: "Experiment",
    *,
    arms: Sequence[str] | None = None,
    control: str | None = None,
    settings: ProbeSettings = ProbeSettings(),
    engine_factory: Callable[["Experiment", "Arm"], Engine] | None = None,
    on_arm: Callable[[str], None] | None = None,
    on_record: Callable[[ProbeRecord], None] | None = None,
    needle_source: NeedleSource | None = None,
) -> ProbeRecord:
    """Probe ``arms`` (default: every treatment arm) with ``control`` as the negative control
    (default: the declaration's control arm; ``""`` for none), one engine at a time.

    The prompts come from the declaration's prompt source (``max_fillers + 1`` of them, or the
    needle index + 1 when larger) with the declaration's sampling settings, its
    ``workload.top_logprobs`` and ``settings.max_tokens``.

    ``needle_source``: the recorded run that chose the needle
    (:func:`bistat.analysis.probe_needle.needle_from_run`; its ``prompt_index`` must be
    ``settings.needle_index``), kept in the record.

    ``on_record`` receives the record so far after every arm but the last (its ``pending`` names
    the arms still to run), so that a caller can keep it on disk: an interrupted probe loses only
    the arm it was on. The last is the one returned. The outcome is decided by
    :func:`bistat.analysis.probe_report.decide_record` (:func:`~bistat.analysis.probe_report.run_probe`
    records and decides in one call).
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
    long_needles: list[tuple[Prompt, int]] = []
    left_out: list[str] = []
    if settings.sweep:
        limit, where = _context_limit(experiment)
        pool = prompts[settings.needle_index + 1:] + prompts[:settings.needle_index]
        for target in settings.long_needles:
            need = math.ceil(target * 1.25) + settings.max_tokens
            if limit is not None and need > limit:
                left_out.append(f"needle-{target}: about {target} prompt tokens (+25 %) and "
                                f"{settings.max_tokens} generated exceed max_model_len {limit} "
                                f"({where})")
                continue
            long_needles.append((long_needle(needle, pool, target), target))

    def make_request(p: Prompt, max_tokens: int | None = None,
                     ignore_eos: bool | None = None) -> GenerationRequest:
        return p.request(max_tokens=settings.max_tokens if max_tokens is None else max_tokens,
                         temperature=wl.temperature, top_p=wl.top_p, top_k=wl.top_k,
                         seed=prompt_seed(wl.seed, p.index),
                         ignore_eos=wl.ignore_eos if ignore_eos is None else ignore_eos,
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
            info = engine.start()
        except EngineError as exc:
            results.append(ArmProbe(name, role, None, (), None, error=f"{type(exc).__name__}: {exc}"))
        except BaseException:   # interrupted while starting: leave no engine behind
            if engine is not None:
                with contextlib.suppress(Exception):
                    engine.stop()
            raise
        else:
            try:
                machine = _machine(engine, by_name[name], info)
                results.append(replace(probe_arm(engine, name, role, needle, fillers, settings,
                                                 make_request, long_needles), machine=machine))
            finally:
                engine.stop()
        if on_record is not None and i + 1 < len(plan):
            on_record(ProbeRecord(settings, needle.prompt_id, tuple(in_report_order(results)),
                                  pending=tuple(n for n, _ in plan[i + 1:]),
                                  needle_source=needle_source, left_out=tuple(left_out)))
    return ProbeRecord(settings, needle.prompt_id, tuple(in_report_order(results)),
                       needle_source=needle_source, left_out=tuple(left_out))


def _machine(engine: Engine, arm: "Arm", info: Any) -> dict[str, Any] | None:
    """Where a started arm's engine runs, as its run would fingerprint it
    (:func:`bistat.run.fingerprint.machine_summary`), with the engine's kind and version as its
    start reported them (``info``): the report's provenance. None where the fingerprint cannot be
    taken (the probe goes on; the report then says nothing of it)."""
    from bistat.run.fingerprint import engine_fingerprint, machine_summary

    try:
        return machine_summary(engine_fingerprint(engine, arm.env), info)
    except Exception:   # noqa: BLE001 -- provenance must not cost the probe
        return None


def _context_limit(experiment: "Experiment") -> tuple[int | None, str]:
    """The smallest ``max_model_len`` the engine arguments give any arm, and where it is set."""
    found = []
    for arm in experiment.arms:
        value = experiment.arm_args(arm).get("max_model_len")
        if value is not None:
            where = ("arms." + arm.name + ".args" if "max_model_len" in arm.args
                     else "engine.args")
            found.append((int(value), where))
    if not found:
        return None, ""
    return min(found)


