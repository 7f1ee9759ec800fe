"""The pass schedule: ABBA balance, seeded random interleaving, engine blocks, warm-ups, resume."""

from __future__ import annotations

from collections import Counter

import pytest

from bistat.core.schedule import counted_order, plan_schedule


def _flat(blocks):
    return [p for b in blocks for p in b.passes]


def test_abba_two_arms_is_the_classic_sequence():
    assert counted_order(["A", "B"], passes=4, order="abba", seed=0) == ("A", "B", "B", "A", "A", "B", "B", "A")


def test_abba_three_arms_reflects_every_other_round():
    assert counted_order(["A", "B", "C"], passes=3, order="abba", seed=0) == (
        "A", "B", "C", "C", "B", "A", "A", "B", "C")


@pytest.mark.parametrize("k", [2, 3, 4, 5])
@pytest.mark.parametrize("passes", [2, 4, 6, 10])
def test_abba_even_passes_give_every_arm_the_same_mean_position(k, passes):
    arms = [f"arm{i}" for i in range(k)]
    seq = counted_order(arms, passes=passes, order="abba", seed=0)
    assert Counter(seq) == {a: passes for a in arms}
    sums = {a: sum(i for i, x in enumerate(seq) if x == a) for a in arms}
    assert len(set(sums.values())) == 1, sums


def test_abba_odd_passes_are_off_by_at_most_one_round():
    seq = counted_order(["A", "B"], passes=3, order="abba", seed=0)
    sums = {a: sum(i for i, x in enumerate(seq) if x == a) for a in "AB"}
    assert sums == {"A": 0 + 3 + 4, "B": 1 + 2 + 5}


def test_random_order_is_reproducible_blocked_and_seed_dependent():
    arms = ["A", "B", "C"]
    a = counted_order(arms, passes=8, order="random", seed=7)
    assert a == counted_order(arms, passes=8, order="random", seed=7)
    for r in range(8):  # every round holds each arm once
        assert sorted(a[3 * r:3 * r + 3]) == arms
    others = {counted_order(arms, passes=8, order="random", seed=s) for s in range(8, 14)}
    assert len(others | {a}) > 1


def test_unknown_order_and_duplicate_arms_are_refused():
    with pytest.raises(ValueError, match="unknown order 'abab'; expected one of 'abba', 'random'"):
        counted_order(["A", "B"], passes=2, order="abab", seed=0)
    with pytest.raises(ValueError, match="unique"):
        counted_order(["A", "A"], passes=2, order="abba", seed=0)


def test_concurrent_engines_one_block_warmups_first():
    blocks = plan_schedule(["A", "B"], passes=2, warmup_passes=1, order="abba", seed=0, engines_concurrent=True)
    assert len(blocks) == 1 and blocks[0].arms == ("A", "B")
    got = [(p.seq, p.arm, p.pass_index, p.kind, p.block) for p in _flat(blocks)]
    assert got == [
        (0, "A", 0, "warmup", 0), (1, "B", 0, "warmup", 0),
        (2, "A", 1, "counted", 0), (3, "B", 1, "counted", 0),
        (4, "B", 2, "counted", 0), (5, "A", 2, "counted", 0),
    ]


def test_restart_mode_blocks_each_begin_with_warmups():
    blocks = plan_schedule(["A", "B"], passes=4, warmup_passes=1, order="abba", seed=0, engines_concurrent=False)
    assert [(b.block, b.arms, [p.kind for p in b.passes]) for b in blocks] == [
        (0, ("A",), ["warmup", "counted"]),
        (1, ("B",), ["warmup", "counted", "counted"]),
        (2, ("A",), ["warmup", "counted", "counted"]),
        (3, ("B",), ["warmup", "counted", "counted"]),
        (4, ("A",), ["warmup", "counted"]),
    ]
    flat = _flat(blocks)
    assert [p.seq for p in flat] == list(range(len(flat)))
    assert [p.pass_index for p in flat if p.arm == "A"] == list(range(7))


def test_resume_plans_only_what_is_left_and_continues_numbering():
    blocks = plan_schedule(
        ["A", "B"], passes=4, warmup_passes=1, order="abba", seed=0, engines_concurrent=True,
        done_counted={"A": 2, "B": 1}, first_seq=9, first_block=1, next_pass_index={"A": 4, "B": 3},
    )
    flat = _flat(blocks)
    assert [(p.arm, p.kind) for p in flat] == [
        ("A", "warmup"), ("B", "warmup"),
        ("B", "counted"), ("A", "counted"), ("B", "counted"), ("B", "counted"), ("A", "counted"),
    ]
    assert [p.seq for p in flat] == list(range(9, 16))
    assert {p.block for p in flat} == {1}
    assert [p.pass_index for p in flat if p.arm == "A"] == [4, 5, 6]
    counted = Counter(p.arm for p in flat if p.kind == "counted")
    assert counted == {"A": 2, "B": 3}


def test_a_finished_schedule_plans_nothing_and_overshoot_is_refused():
    assert plan_schedule(["A", "B"], passes=2, warmup_passes=1, order="abba", seed=0, engines_concurrent=True,
                         done_counted={"A": 2, "B": 2}) == ()
    with pytest.raises(ValueError, match="arm 'A' has 3 counted passes recorded but the declaration asks for 2"):
        plan_schedule(["A", "B"], passes=2, warmup_passes=1, order="abba", seed=0, engines_concurrent=True,
                      done_counted={"A": 3})
