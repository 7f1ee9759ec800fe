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


def test_probe_cases_probe_each_case_with_its_entry_in_order():
    table = tables.parse_table(small_table_dict(), "small_table")
    cases = [probe.ProbeCase(40, 72, "float32"), probe.ProbeCase(24, 40, "float32", "k_pow2")]
    reported = []
    tables.set_device_table(table)
    try:
        results = probe.probe_cases(cases, table, "cpu", max_m=16,
                                    report=lambda c, r: reported.append((c, r)))
    finally:
        tables.reset_device_table()
    assert [c for c, _ in reported] == cases
    assert [r for _, r in reported] == results
    # 40x72 has an entry: its bucket bounds (4 and the next size 5) are probed; 24x40 has none
    assert results[0].invariance.m_values == (1, 2, 3, 4, 5, 7, 8, 16)
    assert results[1].invariance.m_values == (1, 2, 3, 7, 8, 16)
    assert [(r.invariance.n, r.invariance.k, r.case) for r in results] == [
        (40, 72, "table"), (24, 40, "k_pow2")]
    # gate 2 at 1, 16 and 256 up to max_m, and at max_m itself, each once
    assert [[a.m for a in r.accuracy] for r in results] == [[1, 16], [1, 16]]
    assert all(r.passed for r in results)


def test_probe_cases_without_a_table_use_the_default_and_check_accuracy_up_to_max_m():
    (result,) = probe.probe_cases([probe.ProbeCase(40, 72, "float32")], None, "cpu", max_m=8)
    assert result.invariance.m_values == (1, 2, 3, 7, 8)
    assert [a.m for a in result.accuracy] == [1, 8]
    assert result.passed


def _shape_probe(rows_equal: int) -> probe.ShapeProbe:
    inv = probe.InvarianceResult(8, 16, "float32", (1, 2), 3, rows_equal,
                                 () if rows_equal == 3 else ((2, 1),))
    acc = probe.AccuracyResult(8, 16, 2, "float32", 1e-7, 2e-7, 1e-7, 2e-7, 1e-5, True)
    return probe.ShapeProbe(inv, (acc,), "k_pow2")


def test_probe_document_is_the_layout_results_md_reads():
    prov = {"gpu_name": "test", "command": "x"}
    table = tables.parse_table(small_table_dict(), "small_table")
    good, bad = _shape_probe(3), _shape_probe(2)
    doc = probe.probe_document([good, bad], table, prov)
    assert list(doc) == ["schema", "table", "provenance", "passed", "shapes"]
    assert doc["schema"] == "bistat_kernels.probe/1" and doc["table"] == "small_table"
    assert doc["provenance"] is prov and doc["passed"] is False
    assert doc["shapes"] == [good.to_dict(), bad.to_dict()]
    assert [s["passed"] for s in doc["shapes"]] == [True, False]
    alone = probe.probe_document([good], None, prov)
    assert alone["table"] is None and alone["passed"] is True
