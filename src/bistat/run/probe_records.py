"""What the bitwise needle-in-batch probe records: its settings, its trials and each arm's results.

:mod:`bistat.run.probe` runs the probe on the engines and gives a :class:`ProbeRecord` (every arm
probed so far, in report order); :mod:`bistat.analysis.probe_report` decides its outcome and reads
and writes ``probe.json``. The comparison itself (:func:`compare_bitwise`) is the probe's
measurement: token ids, then chosen-token logprobs as float64 bit patterns.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Literal, Mapping

from bistat.engines.base import GenerationResult

__all__ = [
    "ArmProbe",
    "BitwiseComparison",
    "CHARS_PER_TOKEN",
    "FILLER_TOKENS",
    "LONG_NEEDLES",
    "NEEDLE_TOKENS",
    "NeedleProbe",
    "NeedleSource",
    "PROBE_DESIGNS",
    "PROBE_MODES",
    "PROBE_SCHEMA",
    "ProbeOutcome",
    "ProbeRecord",
    "ProbeSettings",
    "ProbeTrial",
    "compare_bitwise",
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
class BitwiseComparison:
    """Bitwise comparison of two results of the needle."""

    tokens_equal: bool
    logprobs_equal: bool | None  # None: an engine returned no logprobs
    first_divergence: int | None  # first token index whose id (or logprob bits) differ

    @property
    def identical(self) -> bool:
        return self.tokens_equal and self.logprobs_equal is not False


def _bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def compare_bitwise(a: GenerationResult, b: GenerationResult) -> BitwiseComparison:
    """Compare token ids, and chosen-token logprobs as float64 bit patterns.

    Examples
    --------
    >>> r = lambda ids, lps: GenerationResult("n", ids, "", lps, None, None, None, 0.0, None, 0.0)
    >>> compare_bitwise(r([1, 2], [-0.5, -1.0]), r([1, 2], [-0.5, -1.0])).identical
    True
    >>> compare_bitwise(r([1, 2], [-0.5, -1.0]), r([1, 2], [-0.5, -1.0000000000000002]))
    BitwiseComparison(tokens_equal=True, logprobs_equal=False, first_divergence=1)
    """
    from bistat.core.divergence import first_divergence   # numpy: not for `bistat probe --help`

    tokens_equal = list(a.token_ids) == list(b.token_ids)
    logprobs_equal: bool | None = None
    if a.logprobs is not None and b.logprobs is not None:
        logprobs_equal = [_bits(x) for x in a.logprobs] == [_bits(x) for x in b.logprobs]
    # where they first differ: the one definition the analysis and the anatomy use too
    found = first_divergence(a.token_ids, b.token_ids, a.logprobs, b.logprobs)
    first = None if found is None else found[0]
    if first is None and logprobs_equal is False:   # lists longer than the token ids differ
        first = min(len(a.token_ids), len(b.token_ids))
    return BitwiseComparison(tokens_equal=tokens_equal, logprobs_equal=logprobs_equal, first_divergence=first)


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
    def n_identical(self) -> int:
        """Trials in which it was bitwise identical to itself alone."""
        return sum(t.identical for t in self.trials)

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
    # where the arm's engine ran (:func:`bistat.run.fingerprint.machine_summary`: its GPUs with
    # name, UUID, driver and serial, versions, host, engine); None where it could not start, and
    # in reports written before it was recorded
    machine: Mapping[str, Any] | None = None

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

    @property
    def n_identical(self) -> int:
        """Trials in which the needle was bitwise identical to the needle alone."""
        return sum(t.identical for t in self.trials)

    @property
    def first_divergences(self) -> tuple[int, ...]:
        """The distinct token indices at which a trial first differed, ascending."""
        return tuple(sorted({t.first_divergence for t in self.trials
                             if t.first_divergence is not None}))


@dataclass(frozen=True)
class NeedleSource:
    """Where the needle came from when a recorded run chose it
    (:func:`bistat.analysis.probe_needle.needle_from_run`): the
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
class ProbeRecord:
    """What the probe recorded, before its outcome is decided
    (:func:`bistat.analysis.probe_report.decide_record`)."""

    settings: ProbeSettings
    needle_prompt_id: str
    arms: tuple[ArmProbe, ...]          # the probed arms first, the negative control last
    pending: tuple[str, ...] = ()       # arms planned but not (yet) probed: a partial record
    # the recorded run that chose the needle (``bistat probe --needle-from``); None: ``--needle``
    needle_source: NeedleSource | None = None
    # kv-sweep: long needles the engine's max_model_len has no room for, each with the reason
    left_out: tuple[str, ...] = ()
