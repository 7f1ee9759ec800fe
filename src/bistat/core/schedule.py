"""The pass schedule: which arm runs which pass when, and when engines start.

A run measures every arm in repeated *passes* (each pass sends the whole workload once). Arms
are interleaved in time so that slow drifts of the machine (thermal state, other tenants, caches)
fall on all arms alike instead of on whichever arm happened to run last.

Orders of the counted passes
----------------------------
``abba``
    Counterbalanced, in rounds of one pass per arm: even rounds take the arms in declared order,
    odd rounds in reverse (``A B | B A | A B | B A`` for two arms, ``A B C | C B A | …`` for
    three). For two arms this is the classic ABBA design; for more arms it is its reflected
    ("fold-over") generalisation: over each pair of rounds every arm's positions sum to the same
    number, so with an even number of passes every arm has the same mean position in time and
    a linear drift biases no arm. With an odd number of passes the last round is unpaired and
    the declared order leads by one position in it.
``random``
    Seeded random interleaving, blocked by round: each round is a permutation of the arms drawn
    with ``numpy.random.default_rng(SeedSequence([seed, 1]))``. Blocking keeps arms close in
    time (a fully shuffled sequence could put all of one arm's passes first); the same seed gives
    the same schedule.

Engine blocks and warm-up
-------------------------
An engine's first work after a start is not steady state (JIT compilation, caches, allocator), so
warm-up passes are run — and discarded — after *every* engine start, not only the first:

* ``engines_concurrent = True``: all arms' engines are started once (block 0) and stay up;
  ``warmup_passes`` rounds of warm-up (one pass per arm, declared order) precede all counted
  passes.
* ``engines_concurrent = False``: only one engine is up at a time. Each maximal run of
  consecutive counted passes of one arm is a block: the arm's engine is (re)started,
  ``warmup_passes`` warm-ups run, then the block's counted passes. ABBA keeps the number of
  restarts low (``A | B B | A A | B B | A``).

Resume
------
:func:`plan_schedule` takes how many counted passes each arm has already completed; those are
dropped from the front of the order (counted passes of one arm are interchangeable) and the rest
is planned afresh: engines start again, so warm-ups run again. ``seq`` (position in the executed
schedule), ``pass_index`` (per arm, warm-ups included) and ``block`` continue from the values
given, so a resumed run's records never reuse an identifier.

Each arm's *k*-th counted pass, in schedule order, therefore runs in round *k* of the counted order,
beside the other arms' *k*-th, however often the run was interrupted and resumed; pass indices
do not line up after a resume (its warm-ups take some). A paired cost interval pairs the arms'
passes of one round (:func:`bistat.core.classify.pass_pairs`).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import groupby
from typing import Literal, Mapping, Sequence

import numpy as np

__all__ = ["ORDERS", "Block", "PlannedPass", "counted_order", "plan_schedule"]

ORDERS = ("abba", "random")
PassKind = Literal["warmup", "counted"]


@dataclass(frozen=True)
class PlannedPass:
    """One pass of the schedule.

    ``seq`` is the 0-based position in the executed schedule, ``pass_index`` the 0-based index
    among this arm's passes (warm-ups included), ``block`` the engine-start block it runs in.
    """

    seq: int
    arm: str
    pass_index: int
    kind: PassKind
    block: int


@dataclass(frozen=True)
class Block:
    """Passes run between two engine starts; ``arms`` are the engines that must be up for it."""

    block: int
    arms: tuple[str, ...]
    passes: tuple[PlannedPass, ...]


def counted_order(arms: Sequence[str], *, passes: int, order: str, seed: int) -> tuple[str, ...]:
    """The arm of each counted pass, in time order (``passes`` per arm; see the module docstring).

    Examples
    --------
    >>> counted_order(["A", "B"], passes=4, order="abba", seed=0)
    ('A', 'B', 'B', 'A', 'A', 'B', 'B', 'A')
    >>> counted_order(["A", "B", "C"], passes=2, order="abba", seed=0)
    ('A', 'B', 'C', 'C', 'B', 'A')
    """
    arms = list(arms)
    if not arms:
        raise ValueError("a schedule needs at least one arm")
    if len(set(arms)) != len(arms):
        raise ValueError(f"arm names must be unique, got {arms}")
    if passes < 0:
        raise ValueError(f"passes must be >= 0, got {passes}")
    if order == "abba":
        rounds = [arms if r % 2 == 0 else arms[::-1] for r in range(passes)]
    elif order == "random":
        rng = np.random.default_rng(np.random.SeedSequence([seed, 1]))
        rounds = [[arms[i] for i in rng.permutation(len(arms))] for _ in range(passes)]
    else:
        raise ValueError(f"workload.order: unknown order {order!r}; expected one of 'abba', 'random'")
    return tuple(arm for rnd in rounds for arm in rnd)


def plan_schedule(
    arms: Sequence[str],
    *,
    passes: int,
    warmup_passes: int,
    order: str,
    seed: int,
    engines_concurrent: bool,
    done_counted: Mapping[str, int] | None = None,
    first_seq: int = 0,
    first_block: int = 0,
    next_pass_index: Mapping[str, int] | None = None,
) -> tuple[Block, ...]:
    """Plan the (remaining) schedule as engine blocks of passes.

    Parameters
    ----------
    arms
        Arm names in declared order.
    passes, warmup_passes
        Counted passes per arm, and warm-up passes after each engine start.
    order
        ``"abba"`` or ``"random"`` (see :func:`counted_order`).
    seed
        Seed of the random order.
    engines_concurrent
        Keep all arms' engines up together (one block) or restart per block of passes.
    done_counted
        Counted passes already completed per arm (resume); they are not planned again.
    first_seq, first_block, next_pass_index
        Where numbering continues (resume): next ``seq``, next ``block`` and next
        ``pass_index`` per arm.

    Returns
    -------
    tuple of Block
        Empty when nothing is left to run.
    """
    done = dict(done_counted or {})
    for arm, n in done.items():
        if arm not in arms:
            raise ValueError(f"recorded passes name arm {arm!r}, which the declaration does not have")
        if n > passes:
            raise ValueError(f"arm {arm!r} has {n} counted passes recorded but the declaration asks for {passes}")
    if warmup_passes < 0:
        raise ValueError(f"warmup_passes must be >= 0, got {warmup_passes}")
    remaining: list[str] = []
    skipped = {arm: 0 for arm in arms}
    for arm in counted_order(arms, passes=passes, order=order, seed=seed):
        if skipped[arm] < done.get(arm, 0):
            skipped[arm] += 1
        else:
            remaining.append(arm)
    if not remaining:
        return ()

    seq = first_seq
    pass_index = {arm: (next_pass_index or {}).get(arm, 0) for arm in arms}

    def make(arm: str, kind: PassKind, block: int) -> PlannedPass:
        nonlocal seq
        planned = PlannedPass(seq=seq, arm=arm, pass_index=pass_index[arm], kind=kind, block=block)
        seq += 1
        pass_index[arm] += 1
        return planned

    blocks: list[Block] = []
    if engines_concurrent:
        active = tuple(arm for arm in arms if arm in remaining)
        planned = [make(arm, "warmup", first_block) for _ in range(warmup_passes) for arm in active]
        planned += [make(arm, "counted", first_block) for arm in remaining]
        blocks.append(Block(block=first_block, arms=active, passes=tuple(planned)))
    else:
        block = first_block
        for arm, run in groupby(remaining):
            n = len(list(run))
            planned = [make(arm, "warmup", block) for _ in range(warmup_passes)]
            planned += [make(arm, "counted", block) for _ in range(n)]
            blocks.append(Block(block=block, arms=(arm,), passes=tuple(planned)))
            block += 1
    return tuple(blocks)
