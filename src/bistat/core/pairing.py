"""The passes of two arms that the schedule ran side by side (pure: no I/O, no clock, no printing).

A cost rule with a paired or HAC interval (``[rule.cost] interval = "paired"`` / ``"hac"``) reads
the arms' values pair by pair: :func:`pass_pairs` pairs the treatment's and the control's counted
pass of one round of the schedule (by pass index, then by position, where rounds are not known).
``bistat.analysis.serial`` reports the same pairs.
"""

from __future__ import annotations

from dataclasses import dataclass

from bistat.core.classify_inputs import ArmStats

__all__ = ["PassPairs", "paired_values", "pass_pairs"]


@dataclass(frozen=True)
class PassPairs:
    """The passes of two arms a paired or HAC cost interval reads, one pair per round of the
    schedule both arms have a value in (:func:`pass_pairs`).

    Attributes
    ----------
    by : str
        What paired them: ``"round"`` (the schedule's rounds, as recorded runs give them),
        ``"pass index"`` (arms built with pass indices but no rounds) or ``"position"`` (neither).
    rounds : tuple of int
        The round of each pair (the pass index or the position when ``by`` says so), in schedule
        order.
    treatment_passes, control_passes : tuple of int
        Each pair's pass index in the treatment and in the control (positions when not known).
    treatment_values, control_values : tuple of float
        Each pair's values of the metric.
    """

    by: str
    rounds: tuple[int, ...]
    treatment_passes: tuple[int, ...]
    control_passes: tuple[int, ...]
    treatment_values: tuple[float, ...]
    control_values: tuple[float, ...]

    def __len__(self) -> int:
        return len(self.rounds)


def _keyed(arm: ArmStats, metric: str) -> tuple[dict[int, tuple[int, float]], str]:
    """Round (or pass index, or position) -> (pass index, value) of one arm's metric, and what
    the key is: rounds where every value has one, else pass indices, else positions."""
    if metric == "throughput":
        values, passes, rounds = arm.pass_throughputs, arm.throughput_passes, arm.throughput_rounds
    else:
        values, passes, rounds = arm.pass_latencies, arm.latency_passes, arm.latency_rounds
    idx = passes if len(passes) == len(values) and passes else tuple(range(len(values)))
    if len(rounds) == len(values) and rounds:
        return {r: (p, v) for r, p, v in zip(rounds, idx, values)}, "round"
    if len(passes) == len(values) and passes:
        return {p: (p, v) for p, v in zip(passes, values)}, "pass index"
    return {i: (i, v) for i, v in enumerate(values)}, "position"


def pass_pairs(treatment: ArmStats, control: ArmStats, metric: str) -> PassPairs:
    """The metric's values (``"throughput"`` or ``"latency"``) of the passes the schedule ran
    side by side: the treatment's and the control's counted pass of one round, for every round
    in which both have a value, in schedule order.

    A round of the schedule (``bistat.core.schedule``) runs one counted pass of every arm next to
    the others (``A B | B A | ...``); an arm's *k*-th counted pass belongs to round *k* however
    the run was interrupted and resumed, since a resume plans only the rounds an arm has not
    completed (:func:`bistat.core.schedule.plan_schedule`). Pass indices do not pair passes: a
    resume gives its new warm-ups pass indices, so after a resume the arms' indices of one round
    differ. Arms without rounds (built by hand) are paired by pass index, and without pass
    indices by position.

    Examples
    --------
    >>> c = ArmStats("c", "control", 0, 0, (100.0, 90.0, 95.0), throughput_passes=(1, 4, 5),
    ...              throughput_rounds=(0, 1, 2))
    >>> t = ArmStats("t", "treatment", 0, 0, (99.0, 89.0), throughput_passes=(1, 5),
    ...              throughput_rounds=(0, 2))
    >>> p = pass_pairs(t, c, "throughput")
    >>> p.rounds, p.control_passes, p.treatment_passes, p.control_values
    ((0, 2), (1, 5), (1, 5), (100.0, 95.0))
    """
    tk, by = _keyed(treatment, metric)
    ck, c_by = _keyed(control, metric)
    if by != c_by:   # one arm keyed otherwise than the other: pair by position
        by, tk, ck = "position", dict(enumerate(tk.values())), dict(enumerate(ck.values()))
    keys = sorted(set(tk) & set(ck))
    return PassPairs(by, tuple(keys), tuple(tk[k][0] for k in keys), tuple(ck[k][0] for k in keys),
                     tuple(tk[k][1] for k in keys), tuple(ck[k][1] for k in keys))


def paired_values(treatment: ArmStats, control: ArmStats, metric: str
                  ) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """:func:`pass_pairs`' values: the treatment's and the control's, pair by pair."""
    pairs = pass_pairs(treatment, control, metric)
    return pairs.treatment_values, pairs.control_values
