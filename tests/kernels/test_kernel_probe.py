"""The gates themselves: they pass the invariant kernel and catch a non-invariant one."""

from __future__ import annotations

import pytest
from helpers_kernels import small_table_dict, torch

from bistat_kernels import probe, tables  # noqa: E402


def test_probe_sizes_cover_every_bucket_of_an_entry():
    entry = tables.parse_table(small_table_dict()).entries[("float32", 40, 72)]
    values = probe.probe_m_values(entry, max_m=70)
    assert values == (1, 2, 3, 4, 5, 7, 8, 16, 17, 64, 65)
    for previous, bucket in zip((0, 1, 4, 16), entry.buckets):
        assert any(previous < m <= bucket.m_max for m in values)


def test_row_positions():
    assert probe.row_positions(1) == (0,)
    assert probe.row_positions(2) == (0, 1)
    assert probe.row_positions(255) == (0, 1, 127, 254)


def test_gates_pass_the_tuned_kernel_on_every_bucket():
    table = tables.parse_table(small_table_dict())
    tables.set_device_table(table)
    try:
        result = probe.probe_shape(37, 100, torch.float32, "cpu",
                                   table.entries[("float32", 37, 100)], max_m=20,
                                   accuracy_ms=(1, 20), with_bias=True)
    finally:
        tables.reset_device_table()
    assert result.invariance.m_values == (1, 2, 3, 4, 5, 7, 8, 16)
    assert result.invariance.passed and result.invariance.rows_checked == 26
    assert result.invariance.mismatches == ()
    assert [r.m for r in result.accuracy] == [1, 20]
    assert all(r.passed and r.max_rel_err < 1e-6 for r in result.accuracy)
    assert result.passed and result.to_dict()["passed"] is True


def _batch_dependent_mm(a, b, bias):
    """A negative control: each row's bits depend on the batch size (like a split-K by M)."""
    return (a @ b) * (1 + 2.0 ** -20 * (a.shape[0] - 1))


def test_invariance_gate_catches_a_batch_dependent_kernel():
    a = torch.randn(16, 32, generator=torch.Generator().manual_seed(0))
    b = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))
    result = probe.check_invariance(a, b, None, (1, 2, 16), mm=_batch_dependent_mm)
    assert not result.passed
    assert result.rows_checked == 7 and result.rows_equal == 1  # only M=1 matches itself
    assert result.mismatches == ((2, 0), (2, 1), (16, 0), (16, 1), (16, 8), (16, 15))


def test_accuracy_gate_fails_unwritten_or_wrong_outputs():
    a = torch.randn(4, 16, generator=torch.Generator().manual_seed(2))
    b = torch.randn(16, 8, generator=torch.Generator().manual_seed(3))
    nan = probe.check_accuracy(a, b, None, mm=lambda x, y, z: torch.full((4, 8), float("nan")))
    assert not nan.passed and not nan.all_written
    off = probe.check_accuracy(a, b, None, mm=lambda x, y, z: x @ y * 1.01)
    assert not off.passed and off.max_rel_err == pytest.approx(0.01, rel=1e-3)
    assert off.torch_mm_max_rel_err < 1e-6
