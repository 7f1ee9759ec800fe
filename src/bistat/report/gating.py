"""CI gating: ``--fail-on LABELS`` parsing, verdict -> exit code, and a one-screen CI summary.

Every verdict-producing command (``analyze``, ``run``, ``probe``) exits 0 whatever the verdict
unless ``--fail-on`` names labels; then the first verdict (in comparison order) whose label is
named sets the exit code from :data:`bistat.core.exitcodes.VERDICT_CODES` (10 *doubtful*, 11
*reported as observed*, 12 *untested*). *working* has code 0, so it cannot fail a command and
is refused in ``--fail-on``. A probe's outcome maps onto the same codes
(:data:`PROBE_OUTCOME_LABELS`: ``violated`` -> 11, ``no_power`` and ``untested`` -> 12, the
codes ``bistat probe`` documents).

Labels are given as the verdict's words (``"reported as observed"``) or with ``-`` / ``_`` for
the spaces (``reported-as-observed``), separated by commas, or the option repeated; ``any``
names every failing label. Anything else is refused with the list of accepted names.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from bistat.core.exitcodes import OK, VERDICT_CODES

if TYPE_CHECKING:  # pragma: no cover
    from bistat.analysis.results import RunSummary

__all__ = [
    "FAILABLE_LABELS",
    "PROBE_OUTCOME_LABELS",
    "FailOnError",
    "GateResult",
    "ci_summary",
    "gate",
    "parse_fail_on",
    "probe_gate",
]

#: Labels ``--fail-on`` accepts (every verdict with a non-zero code).
FAILABLE_LABELS: tuple[str, ...] = tuple(sorted(k for k, v in VERDICT_CODES.items() if v != OK))
#: Probe outcome -> the verdict label whose exit code it shares.
PROBE_OUTCOME_LABELS: dict[str, str] = {
    "confirmed": "working",
    "violated": "reported as observed",
    "no_power": "untested",
    "untested": "untested",
    "vacuous": "untested",
}


class FailOnError(ValueError):
    """A ``--fail-on`` value names no failable verdict label."""


def parse_fail_on(values: str | Iterable[str] | None) -> frozenset[str]:
    """Parse ``--fail-on`` values into verdict labels.

    Parameters
    ----------
    values : str or iterable of str or None
        Each a label or a comma-separated list of labels (``"doubtful,untested"``); ``-`` and
        ``_`` stand for spaces; ``any`` means every failable label.

    Returns
    -------
    frozenset of str
        The labels, spelled as in :data:`bistat.core.exitcodes.VERDICT_CODES`.

    Raises
    ------
    FailOnError
        An unknown label, or ``working`` (exit code 0 cannot fail a command).

    Examples
    --------
    >>> sorted(parse_fail_on("doubtful,reported-as-observed"))
    ['doubtful', 'reported as observed']
    >>> sorted(parse_fail_on(["any"]))
    ['doubtful', 'reported as observed', 'untested']
    """
    if values is None:
        return frozenset()
    if isinstance(values, str):
        values = [values]
    out: set[str] = set()
    for value in values:
        for part in str(value).split(","):
            name = " ".join(part.strip().lower().replace("-", " ").replace("_", " ").split())
            if not name:
                continue
            if name == "any":
                out.update(FAILABLE_LABELS)
            elif name == "working":
                raise FailOnError(
                    "--fail-on: 'working' has exit code 0 and cannot fail a command; name one of "
                    + ", ".join(repr(x) for x in FAILABLE_LABELS) + " or 'any'")
            elif name in FAILABLE_LABELS:
                out.add(name)
            else:
                raise FailOnError(
                    f"--fail-on: unknown verdict label {part.strip()!r}; expected one of "
                    + ", ".join(repr(x) for x in FAILABLE_LABELS)
                    + " or 'any' (comma-separated; '-' or '_' may stand for spaces)")
    return frozenset(out)


@dataclass(frozen=True)
class GateResult:
    """The exit code a command returns and why."""

    exit_code: int
    reason: str


def gate(labels: Sequence[str], fail_on: Iterable[str]) -> GateResult:
    """Exit code for verdicts ``labels`` (in comparison order) under ``fail_on``.

    Examples
    --------
    >>> gate(["working", "doubtful"], {"doubtful"})
    GateResult(exit_code=10, reason="verdict 2 is 'doubtful', named by --fail-on")
    >>> gate(["doubtful"], set()).exit_code
    0
    """
    fail_on = frozenset(fail_on)
    for label in labels:
        if label not in VERDICT_CODES:
            raise ValueError(f"unknown verdict label {label!r}; expected one of "
                             + ", ".join(repr(x) for x in VERDICT_CODES))
    for i, label in enumerate(labels, start=1):
        if label in fail_on:
            return GateResult(VERDICT_CODES[label], f"verdict {i} is {label!r}, named by --fail-on")
    if fail_on:
        return GateResult(OK, "no verdict has a label named by --fail-on")
    return GateResult(OK, "no --fail-on given: every verdict exits 0")


def probe_gate(outcome: str, fail_on: Iterable[str]) -> GateResult:
    """Exit code of a probe outcome under ``fail_on`` (outcomes map to labels as documented)."""
    if outcome not in PROBE_OUTCOME_LABELS:
        raise ValueError(f"unknown probe outcome {outcome!r}; expected one of "
                         + ", ".join(repr(x) for x in PROBE_OUTCOME_LABELS))
    return gate([PROBE_OUTCOME_LABELS[outcome]], fail_on)


def _short(x: object, n: int = 12) -> str:
    s = str(x)
    return s if len(s) <= n else s[:n]


def _wrapped(line: str, width: int) -> list[str]:
    """``line`` in lines of at most ``width`` characters, the continuations indented two spaces
    more than it (words longer than a line are broken)."""
    if len(line) <= width:
        return [line]
    indent = " " * (len(line) - len(line.lstrip(" ")) + 2)
    return textwrap.wrap(line, width, subsequent_indent=indent, break_on_hyphens=False)


def ci_summary(summary: RunSummary, fail_on: Iterable[str] = (), *, width: int = 100,
               max_lines: int = 40, result: GateResult | None = None) -> str:
    """A one-screen plain-text summary of an analysed run for CI logs (no colour, no markup).

    At most ``max_lines`` lines of at most ``width`` characters: the run and its seal, each
    comparison's verdict with its fixed sentence and every criterion, failed validity checks,
    divergences per arm, and the exit code the command exits with and its reason: ``result``
    where the command's code is not the gate's alone (``bistat run`` of an engine that failed to
    start exits 1), else the gate's. A longer line is wrapped, its continuation indented, never
    cut: the numbers at its end are what a reader looks for.
    """
    fail_on = frozenset(fail_on)
    lines = [f"bistat: {summary.name} run {summary.run_id} "
             f"(registration {_short(summary.registration_sha256)})"]
    for a in summary.arms:
        rate = f"{a.n_matched}/{a.n_units}" if a.n_units else "no units"
        iv = a.match_interval
        ivs = (f", two-sided {summary.confidence_level * 100:g} % Wilson "
               f"[{iv.low:.4f}, {iv.high:.4f}]" if iv is not None else "")
        lines.append(f"  arm {a.name} ({a.role}): matched {rate}{ivs}; "
                     f"{len(a.divergences)} divergence(s)")
    for c in summary.comparisons:
        v = c.verdict
        lines.append(f"VERDICT {c.treatment} vs {c.control}: {v.label.value.upper()}")
        lines.append(f"  {v.sentence}")
        for lr in v.labels:
            for cr in lr.criteria:
                mark = {True: "met", False: "not met", None: "n/a"}[cr.met]
                lines.append(f"  [{mark}] {lr.label}: {cr.description}: {cr.observed_text} "
                             f"(needs {cr.threshold})")
        for r in v.untested_reasons:
            lines.append(f"  untested: {r}")
        if v.cost is not None:
            lines.append(f"  cost: {v.cost.statement}")
    if summary.exploratory:
        lines.insert(1, "  EXPLORATORY: the rule was sealed after the run's first record; not a "
                        "test of the hypothesis")
    failed = [x for x in summary.validity if x.passed is False]
    for x in failed:
        lines.append(f"  validity FAILED: {x.name}: observed {x.observed}, limit {x.limit}")
    if summary.failed_requests is not None and summary.failed_requests.total:
        fr = summary.failed_requests
        lines.append(f"  failed requests: {fr.total}")
        lines += [f"    {line}" for line in fr.lines(limit=2)]
    res = result or gate([c.verdict.label.value for c in summary.comparisons], fail_on)
    tail = f"exit {res.exit_code}: {res.reason}"
    lines = [part for ln in lines for part in _wrapped(ln, width)]
    if len(lines) > max_lines - 1:
        lines = lines[: max_lines - 2] + [f"  ... {len(lines) - max_lines + 2} more line(s)"]
    return "\n".join(lines + [tail]) + "\n"
