"""The bitwise needle-in-batch probe: does an engine give a prompt the same bits alone and in a batch?

An engine that asked for batch invariance does not say whether it got it (vLLM prints no line
saying the mode is on). The probe checks behaviour instead, on any engine, through the
:class:`~bistat.engines.base.Engine` protocol: *needles* are run alone, twice (the second run
checks plain run-to-run determinism), then among *fillers* in ``trials`` trials; each needle's
token ids and chosen-token logprobs are compared **bitwise** with its first alone run (float64 bit
patterns, so ``-0.0 != 0.0`` and one ulp counts); and every filler that came back from two or more
trials is compared bitwise with its output in the first of them: the same prompt among other
neighbours, at another place. That costs no engine time and multiplies the prompts tested
(``h200-match-smollm2-r2``: the FlashAttention-3 arms' needle stayed identical while 457 of 541
prompts diverged across the study's passes). ``n`` fillers per trial are drawn uniformly from
``[min_fillers, max_fillers]`` (default 32-128) without replacement from the rest of the
workload, with ``numpy.random.default_rng(SeedSequence([seed, design, trial]))``.

Designs (``ProbeSettings.design``, batch mode)
----------------------------------------------
``kv-sweep`` (default)
    What batch dependence in the attention kernel needs in order to show (issue 22; the H200's
    FlashAttention 3 at head size 64, ``docs/STUDIES.md``): a row is reduced over KV tiles, so up
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
      needle then decodes among decode rows alone: ``h200-match-smollm2-r2``'s probe saw
      nothing there);
    * a **verdict per needle** (:func:`needle_verdicts`, e.g. violated at 304 tokens and
      confirmed at 112) beside the verdict per arm, which is decided as before over all needles.

    Needles whose length estimate (+25 %) plus ``max_tokens`` exceeds the ``max_model_len`` of
    the engine arguments are left out and listed (``left_out``). Cost per arm: ``2 x (1 + len(
    long_needles))`` passes of one request (10 by default) and ``trials`` passes of the needles
    and their fillers (3 by default, each about ``max_tokens + filler_tokens`` engine steps);
    with SmolLM2-135M on an H200 that is estimated at 15-30 s beside an engine start of 60-140 s
    (``docs/STUDIES.md``, not yet measured).
``single``
    The design bistat used before issue 22: one needle (the declaration's needle prompt, with the
    workload's ``max_tokens`` and ``ignore_eos``) placed at a random position among its fillers,
    all submitted at once. Reports written before designs existed read as ``single``.

The needle is prompt ``needle_index`` of the declaration's prompt source (default 0), or the one a
recorded run of the same workload saw diverge first (:func:`needle_from_run`, ``bistat probe
--needle-from RUN_DIR``): a needle that happens to be insensitive misses what the study saw
(``h200-match-smollm2-r2`` again: its needle, prompt 0, stayed identical). The report then says
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
    "NeedleProbe",
    "NeedleVerdict",
    "NeedleSource",
    "ProbeOutcome",
    "ProbeReport",
    "ProbeSettings",
    "ProbeTrial",
    "PROBE_DESIGNS",
    "PROBE_MODES",
    "filler_tokens_of",
    "fillers_in_flight",
    "long_needle",
    "needle_verdicts",
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
PROBE_DESIGNS: tuple[str, ...] = ("kv-sweep", "single")
PROBE_SCHEMA = "bistat.probe/1"

#: The ``kv-sweep`` design's defaults: the long needles' approximate prompt tokens, the tokens
#: every needle decodes, and the tokens of each filler (``bistat probe --long-needles``,
#: ``--max-tokens``, ``--filler-tokens``). With the declaration's needle prompt (a chat prompt of
#: 36-52 tokens in Study 1(a)) the needles decode over about 40-170, 112-240, 176-304, 304-432
#: and 600-728 keys: past 64, 128, 192, 256, 384 and 640.
LONG_NEEDLES: tuple[int, ...] = (112, 176, 304, 600)
NEEDLE_TOKENS = 128
FILLER_TOKENS = 16
#: Characters per token assumed when a text needle is sized (the usual rule of thumb for English
#: text and byte-pair tokenizers; the report gives the engine's own count).
CHARS_PER_TOKEN = 4
#: The settings a ``single``-design report leaves out (reports written before designs existed
#: have none of them and read as ``single``).
_DESIGN_KEYS = ("design", "long_needles", "filler_tokens")


@dataclass(frozen=True)
class ProbeSettings:
    """How the probe is run (see the module docstring; ``design``, ``long_needles`` and
    ``filler_tokens`` apply to batch mode)."""

    trials: int = 3
    min_fillers: int = 32
    max_fillers: int = 128
    needle_index: int = 0
    max_tokens: int = NEEDLE_TOKENS
    seed: int = 0
    mode: str = "batch"
    design: str = "kv-sweep"
    long_needles: tuple[int, ...] = LONG_NEEDLES
    filler_tokens: int = FILLER_TOKENS

    def __post_init__(self) -> None:
        if self.mode not in PROBE_MODES:
            raise ValueError(f"mode ({self.mode!r}) must be one of "
                             + ", ".join(repr(m) for m in PROBE_MODES))
        if self.design not in PROBE_DESIGNS:
            raise ValueError(f"design ({self.design!r}) must be one of "
                             + ", ".join(repr(d) for d in PROBE_DESIGNS))
        object.__setattr__(self, "long_needles", tuple(int(x) for x in self.long_needles))
        if any(x < 1 for x in self.long_needles) or list(self.long_needles) != sorted(
                set(self.long_needles)):
            raise ValueError(f"long_needles must be increasing prompt lengths of at least 1 "
                             f"token, got {list(self.long_needles)}")
        if self.filler_tokens < 1:
            raise ValueError(f"filler_tokens must be at least 1, got {self.filler_tokens}")
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

    @property
    def sweep(self) -> bool:
        """The ``kv-sweep`` design in batch mode: several needles, fillers arriving over time."""
        return self.mode == "batch" and self.design == "kv-sweep"


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
class NeedleProbe:
    """One needle of the ``kv-sweep`` design on one arm: alone twice, then in every trial."""

    needle: str                       # its prompt id (``needle-304`` for a long needle)
    target_tokens: int | None         # the design's prompt length for it; None: the needle prompt
    n_prompt_tokens: int | None       # its prompt tokens as the engine counted them (alone)
    n_tokens: int | None              # tokens it generated alone
    alone_repeat_identical: bool | None
    trials: tuple[ProbeTrial, ...]

    @property
    def differs(self) -> bool:
        return self.alone_repeat_identical is False or any(
            t.error is None and not t.identical for t in self.trials)

    @property
    def first_divergence(self) -> int | None:
        """The earliest token index at which a trial differed from the needle alone."""
        firsts = [t.first_divergence for t in self.trials
                  if t.error is None and not t.identical and t.first_divergence is not None]
        return min(firsts) if firsts else None

    @property
    def kv_first_divergence(self) -> int | None:
        """Keys the first differing token's attention read (prompt tokens + index)."""
        first = self.first_divergence
        return None if first is None or self.n_prompt_tokens is None else self.n_prompt_tokens + first

    @property
    def kv_range(self) -> tuple[int, int] | None:
        """(first, last) keys its generated tokens' attention read, alone."""
        if self.n_prompt_tokens is None or self.n_tokens is None:
            return None
        return self.n_prompt_tokens, self.n_prompt_tokens + max(self.n_tokens - 1, 0)


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
    # kv-sweep design: every needle's own trials (the arm's ``trials`` and
    # ``alone_repeat_identical`` then sum them up over the needles); empty in the single design
    needles: tuple["NeedleProbe", ...] = ()

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
    # kv-sweep: long needles the engine's max_model_len has no room for, each with the reason
    left_out: tuple[str, ...] = ()

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
        verdicts = needle_verdicts(self.arms)
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
            lines += [f"    {needle_line(n)}" for n in a.needles]
        if self.pending:
            lines.append(f"  not probed: {', '.join(self.pending)}")
        lines += [f"  left out: {x}" for x in self.left_out]
        verdicts = needle_verdicts(self.arms)
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
    same = sum(t.identical for t in done)
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

    every_step = _capability(engine, "every_step_metrics")
    with every_step() if every_step is not None else contextlib.nullcontext():
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
                results.append(probe_arm(engine, name, role, needle, fillers, settings, make_request,
                                         long_needles))
            finally:
                engine.stop()
        if on_report is not None and i + 1 < len(plan):
            on_report(decide_report(in_report_order(results), settings, needle.prompt_id,
                                    pending=tuple(n for n, _ in plan[i + 1:]),
                                    needle_source=needle_source, left_out=tuple(left_out)))
    report = decide_report(in_report_order(results), settings, needle.prompt_id,
                           needle_source=needle_source, left_out=tuple(left_out))
    if on_report is not None:
        on_report(report)
    return report


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
                     needles=tuple(_needle_from_json(n) for n in a.get("needles") or ()))
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
