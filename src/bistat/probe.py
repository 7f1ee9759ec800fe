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
   alone run (float64 bit patterns, so ``-0.0 != 0.0`` and one ulp counts).

A probe that finds no difference proves nothing unless it could have found one. Every probe
therefore runs the same procedure on a *negative control*: an arm in which invariance is off
(the declaration's control arm by default, e.g. ``gemm = "blas"``), which must show at least one
difference. Outcomes:

``confirmed``
    every probed arm is bitwise invariant and the negative control differs: the probe has
    power and invariance is confirmed (exit code 0).
``violated``
    a probed arm gave the needle different bits in some batch, or alone twice (exit code 11).
``no_power``
    the probed arms are invariant but so is the negative control: the probe could not have
    seen a difference at this size; raise the fillers, tokens or trials (exit code 12).
``untested``
    an engine refused the setting, failed to start, died, or the needle's request failed
    (exit code 12).
"""

from __future__ import annotations

import struct
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Callable, Literal, Sequence

import numpy as np

from bistat.engines.base import Engine, EngineError, GenerationRequest, GenerationResult, MetricsSample
from bistat.workload import Prompt, load_prompts, prompt_seed

if TYPE_CHECKING:  # pragma: no cover
    from bistat.experiment import Arm, Experiment

__all__ = [
    "ArmProbe",
    "ProbeOutcome",
    "ProbeReport",
    "ProbeSettings",
    "ProbeTrial",
    "compare_bitwise",
    "probe_arm",
    "run_probe",
]

ProbeOutcome = Literal["confirmed", "violated", "no_power", "untested"]
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

    def __post_init__(self) -> None:
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
    first: int | None = None
    tokens_equal = list(a.token_ids) == list(b.token_ids)
    if not tokens_equal:
        n = min(len(a.token_ids), len(b.token_ids))
        first = next((i for i in range(n) if a.token_ids[i] != b.token_ids[i]), n)
    logprobs_equal: bool | None = None
    if a.logprobs is not None and b.logprobs is not None:
        la, lb = [_bits(x) for x in a.logprobs], [_bits(x) for x in b.logprobs]
        logprobs_equal = la == lb
        if not logprobs_equal:
            n = min(len(la), len(lb))
            lp_first = next((i for i in range(n) if la[i] != lb[i]), n)
            first = lp_first if first is None else min(first, lp_first)
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

    @property
    def differs(self) -> bool:
        """At least one bitwise difference was seen (alone twice, or alone vs batch)."""
        return self.alone_repeat_identical is False or any(
            t.error is None and not t.identical for t in self.trials
        )

    @property
    def failed(self) -> bool:
        return self.error is not None or any(t.error is not None for t in self.trials)


@dataclass(frozen=True)
class ProbeReport:
    """The probe's result: outcome, reason, and every arm's trials."""

    outcome: ProbeOutcome
    reason: str
    settings: ProbeSettings
    needle_prompt_id: str
    arms: tuple[ArmProbe, ...]

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["schema"] = PROBE_SCHEMA
        for arm, probe in zip(data["arms"], self.arms):
            arm["differs"] = probe.differs
        return data

    def summary_lines(self) -> list[str]:
        """The human summary: one line per arm, then the outcome and its reason."""
        lines = [f"needle {self.needle_prompt_id}, {self.settings.trials} trial(s) of "
                 f"{self.settings.min_fillers}-{self.settings.max_fillers} fillers, "
                 f"{self.settings.max_tokens} tokens"]
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
            lines.append(
                f"  {a.arm} ({label}): alone twice {repeat}; in batch identical in {same}/{len(a.trials)} "
                f"trial(s){where}{err}"
            )
        lines.append(f"outcome: {self.outcome} — {self.reason}")
        return lines


def _run_batch(engine: Engine, requests: Sequence[GenerationRequest]) -> dict[str, GenerationResult]:
    results: dict[str, GenerationResult] = {}

    def on_result(result: GenerationResult) -> None:
        results[result.prompt_id] = result

    def on_metrics(sample: MetricsSample) -> None:
        return None

    engine.run_pass(requests, concurrency=len(requests), on_result=on_result, on_metrics=on_metrics)
    return results


def _needle_result(results: dict[str, GenerationResult], needle_id: str) -> GenerationResult:
    result = results.get(needle_id)
    if result is None:
        raise _ProbeFailed(f"the engine returned no result for the needle {needle_id!r}")
    if result.error is not None:
        raise _ProbeFailed(f"the needle's request failed: {result.error}")
    return result


class _ProbeFailed(Exception):
    pass


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
    if len(fillers) < settings.max_fillers:
        raise ValueError(f"need at least {settings.max_fillers} filler prompts, got {len(fillers)}")
    needle_request = make_request(needle)
    try:
        alone = _needle_result(_run_batch(engine, [needle_request]), needle.prompt_id)
        again = _needle_result(_run_batch(engine, [needle_request]), needle.prompt_id)
    except (_ProbeFailed, EngineError) as exc:
        return ArmProbe(arm=arm, role=role, alone_repeat_identical=None, trials=(), n_needle_tokens=None,
                        error=str(exc))
    trials = []
    for t in range(settings.trials):
        rng = np.random.default_rng(np.random.SeedSequence([settings.seed, 2, t]))
        n = int(rng.integers(settings.min_fillers, settings.max_fillers + 1))
        chosen = [fillers[int(i)] for i in rng.choice(len(fillers), size=n, replace=False)]
        position = int(rng.integers(0, n + 1))
        batch = [make_request(p) for p in chosen[:position]] + [needle_request] + [
            make_request(p) for p in chosen[position:]
        ]
        try:
            result = _needle_result(_run_batch(engine, batch), needle.prompt_id)
        except (_ProbeFailed, EngineError) as exc:
            trials.append(ProbeTrial(t, n, position, None, None, None, error=str(exc)))
            continue
        c = compare_bitwise(alone, result)
        trials.append(ProbeTrial(t, n, position, c.tokens_equal, c.logprobs_equal, c.first_divergence))
    return ArmProbe(
        arm=arm,
        role=role,
        alone_repeat_identical=compare_bitwise(alone, again).identical,
        trials=tuple(trials),
        n_needle_tokens=len(alone.token_ids),
    )


def _decide(arms: Sequence[ArmProbe]) -> tuple[ProbeOutcome, str]:
    probed = [a for a in arms if a.role == "probed"]
    controls = [a for a in arms if a.role == "negative_control"]
    failed = [a.arm for a in probed if a.failed]
    if failed:
        return "untested", f"the probe could not run on {', '.join(failed)}"
    violated = [a.arm for a in probed if a.differs]
    if violated:
        return "violated", f"bitwise differences on {', '.join(violated)}: not batch invariant"
    if not controls:
        return "no_power", "no negative control was run, so the probe's power is unknown"
    if any(a.failed for a in controls):
        return "untested", "the negative control could not run, so the probe's power is unknown"
    if not any(a.differs for a in controls):
        return "no_power", (
            "the negative control showed no difference either: the probe lacks power at this size; "
            "raise --max-tokens, the fillers or --trials"
        )
    return "confirmed", "bitwise identical alone and in every batch, and the negative control differs"


def run_probe(
    experiment: "Experiment",
    *,
    arms: Sequence[str] | None = None,
    control: str | None = None,
    settings: ProbeSettings = ProbeSettings(),
    engine_factory: Callable[["Experiment", "Arm"], Engine] | None = None,
    on_arm: Callable[[str], None] | None = None,
) -> ProbeReport:
    """Probe ``arms`` (default: every treatment arm) with ``control`` as the negative control
    (default: the declaration's control arm; ``""`` for none), one engine at a time.

    The prompts come from the declaration's prompt source (``max_fillers + 1`` of them, or the
    needle index + 1 when larger) with the declaration's sampling settings and ``settings.max_tokens``.
    """
    by_name = {a.name: a for a in experiment.arms}
    probed = list(arms) if arms else [a.name for a in experiment.treatments]
    control_name = experiment.control.name if control is None else control
    for name in [*probed, *([control_name] if control_name else [])]:
        if name not in by_name:
            raise ValueError(f"arm {name!r} is not in the declaration; arms: {', '.join(by_name)}")
    if control_name in probed:
        raise ValueError(f"arm {control_name!r} cannot be both probed and the negative control")
    wl = experiment.workload
    n = max(settings.max_fillers + 1, settings.needle_index + 1)
    prompts = load_prompts(wl.source, n, wl.seed)
    needle = prompts[settings.needle_index]
    fillers = [p for p in prompts if p.prompt_id != needle.prompt_id]

    def make_request(p: Prompt) -> GenerationRequest:
        return p.request(max_tokens=settings.max_tokens, temperature=wl.temperature, top_p=wl.top_p,
                         top_k=wl.top_k, seed=prompt_seed(wl.seed, p.index), ignore_eos=wl.ignore_eos)

    if engine_factory is None:
        from bistat.engines.registry import create_engine

        engine_factory = create_engine
    results = []
    plan = [(name, "probed") for name in probed] + ([(control_name, "negative_control")] if control_name else [])
    for name, role in plan:
        if on_arm is not None:
            on_arm(name)
        try:
            engine = engine_factory(experiment, by_name[name])
            engine.start()
        except EngineError as exc:
            results.append(ArmProbe(name, role, None, (), None, error=f"{type(exc).__name__}: {exc}"))
            continue
        try:
            results.append(probe_arm(engine, name, role, needle, fillers, settings, make_request))
        finally:
            engine.stop()
    outcome, reason = _decide(results)
    return ProbeReport(outcome=outcome, reason=reason, settings=settings, needle_prompt_id=needle.prompt_id,
                       arms=tuple(results))
