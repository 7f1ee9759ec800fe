"""Host cost per eager call: interleaved runs and their medians (CPU, synchronisation stubbed)."""

from __future__ import annotations

from helpers_kernels import torch

from bistat_kernels import host_cost  # noqa: E402


def test_runs_are_interleaved_and_the_order_rotates(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    order: list[str] = []
    fns = {name: (lambda name=name: order.append(name)) for name in ("a", "b", "c")}
    result = host_cost.side_by_side_us(fns, calls=2, repeats=4, warmup=1)
    assert set(result) == {"a", "b", "c"}
    timed = order[3:]  # after one warm-up call each
    runs = [timed[i] for i in range(0, len(timed), 2)]  # one entry per run of 2 calls
    assert runs == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]
    for host, wall in result.values():
        assert 0 < host <= wall


def test_the_median_of_the_repeats_is_reported(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    clock = iter([0.0, 1e-5, 2e-5,     # repeat 1: 10 us to issue one call, 20 us with the sync
                  1.0, 1.0 + 3e-5, 1.0 + 3e-5,
                  2.0, 2.0 + 2e-5, 2.0 + 4e-5])
    monkeypatch.setattr(host_cost.time, "perf_counter", lambda: next(clock))
    host, wall = host_cost.per_call_us(lambda: None, calls=1, repeats=3, warmup=0)
    assert round(host, 6) == 20.0 and round(wall, 6) == 30.0
