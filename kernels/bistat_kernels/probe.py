"""The two gates every table entry must pass: bitwise row invariance and accuracy.

Gate 1 (invariance) computes each checked row alone (M = 1) and inside batches of many sizes, and
requires ``torch.equal`` — the reference test of thinking-machines-lab/batch_invariant_ops
(``test_batch_invariance.py``: ``torch.mm(a[:1], b)`` vs ``torch.mm(a, b)[:1]``, difference 0),
extended to several row positions and to a batch size inside every M bucket of the table.

Gate 2 (accuracy) compares against a higher-precision reference (float64 on the CPU, float32
without TF32 on a GPU) and reports torch.mm's own error on the same inputs beside ours.

Beyond the table's own shapes, :func:`edge_cases` lists the extra cases both gates must
cover: K a power of two from 512 to 4096 (vLLM #55131 reports its persistent kernel not
invariant there) and float32 inputs, whose products must be IEEE float32 (vLLM #55466: ``tl.dot``
silently used TF32). The float32 tolerance, 1e-5 of max |reference|, sits between the two: a
float32 sum of K products is off by about 1e-7..1e-6 of that scale, while TF32 keeps 10 of the 23
mantissa bits of each operand and lands near 1e-4 (tests/kernels/test_probe_edge_cases.py shows
a TF32 dot failing it under the interpreter).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from bistat_kernels.matmul_persistent import matmul_persistent
from bistat_kernels.tables import GemmTable, ShapeConfig

PROBE_MS: tuple[int, ...] = (1, 2, 3, 7, 8, 16, 64, 255, 256, 1024, 4096)
# Batch sizes gate 2 checks, besides the largest one probed (probe_cases).
ACCURACY_MS: tuple[int, ...] = (1, 16, 256)
PROBE_SCHEMA = "bistat_kernels.probe/1"
# Allowed max |ours - reference| / max |reference| per dtype: about the rounding of the output
# dtype (bf16 keeps 8 significant bits, fp16 11) with headroom; fp32 must stay far below TF32.
ACCURACY_TOLERANCE: dict[torch.dtype, float] = {
    torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}

POW2_KS: tuple[int, ...] = (512, 1024, 2048, 4096)  # vLLM #55131
EDGE_N = 4096  # N of the power-of-two-K cases (Qwen3-8B's o projection at K 4096)

MatmulFn = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


@dataclass(frozen=True)
class InvarianceResult:
    """Gate 1 for one weight shape: rows alone vs the same rows inside batches of size M."""

    n: int
    k: int
    dtype: str
    m_values: tuple[int, ...]
    rows_checked: int
    rows_equal: int
    mismatches: tuple[tuple[int, int], ...]  # (M, row) pairs whose bits differed

    @property
    def passed(self) -> bool:
        return self.rows_checked > 0 and self.rows_equal == self.rows_checked


@dataclass(frozen=True)
class AccuracyResult:
    """Gate 2 for one weight shape at one M: our error and torch.mm's against the reference."""

    n: int
    k: int
    m: int
    dtype: str
    max_abs_err: float
    max_rel_err: float
    torch_mm_max_abs_err: float
    torch_mm_max_rel_err: float
    tolerance: float
    all_written: bool

    @property
    def passed(self) -> bool:
        return self.all_written and self.max_rel_err <= self.tolerance


def row_positions(m: int) -> tuple[int, ...]:
    """Rows checked inside a batch of ``m``: first, second, middle and last."""
    return tuple(sorted({r for r in (0, 1, m // 2, m - 1) if 0 <= r < m}))


def probe_m_values(entry: ShapeConfig | None, max_m: int,
                   base: Sequence[int] = PROBE_MS) -> tuple[int, ...]:
    """The base batch sizes (``base``) plus, for every bucket, its upper bound and the next size up.

    So every bucket of the entry is exercised at least once (capped at ``max_m``).
    """
    values = set(base)
    if entry is not None:
        previous = 0
        for bucket in entry.buckets:
            values.update({previous + 1, bucket.m_max, bucket.m_max + 1})
            previous = bucket.m_max
    return tuple(sorted(v for v in values if 1 <= v <= max_m))


def check_invariance(a_full: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None,
                     m_values: Sequence[int], mm: MatmulFn = matmul_persistent,
                     ) -> InvarianceResult:
    """Gate 1: every checked row of ``mm(a_full[:M], b)`` equals ``mm(row alone, b)`` bitwise.

    ``a_full`` is [max(m_values), K]; ``b`` is [K, N].
    """
    rows_needed = sorted({r for m in m_values for r in row_positions(m)})
    alone = {r: mm(a_full[r:r + 1], b, bias)[0] for r in rows_needed}  # each [N]
    checked = equal = 0
    mismatches: list[tuple[int, int]] = []
    for m in m_values:
        c = mm(a_full[:m], b, bias)  # [m, N]
        for r in row_positions(m):
            checked += 1
            if torch.equal(c[r], alone[r]):
                equal += 1
            else:
                mismatches.append((m, r))
    return InvarianceResult(n=b.shape[1], k=b.shape[0], dtype=str(a_full.dtype).replace(
        "torch.", ""), m_values=tuple(m_values), rows_checked=checked, rows_equal=equal,
        mismatches=tuple(mismatches))


def reference_mm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``a @ b + bias`` in float64 on the CPU, float32 without TF32 on a GPU."""
    if a.device.type == "cpu":
        ref = a.double() @ b.double()
        return ref + bias.double() if bias is not None else ref
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        ref = torch.mm(a.float(), b.float())
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    return ref + bias.float() if bias is not None else ref


def _errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    diff = (out.to(ref.dtype) - ref).abs()
    max_abs = float(diff.max()) if diff.numel() else 0.0
    scale = float(ref.abs().max()) if ref.numel() else 0.0
    return max_abs, (max_abs / scale if scale > 0 else max_abs)


def check_accuracy(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None,
                   mm: MatmulFn = matmul_persistent, ref: torch.Tensor | None = None,
                   ) -> AccuracyResult:
    """Gate 2: max abs and relative (to max |ref|) error of ``mm`` and of torch.mm.

    The output is poisoned first (``torch.empty`` then NaN-checked): an unwritten element fails.
    """
    if ref is None:
        ref = reference_mm(a, b, bias)
    out = mm(a, b, bias)
    all_written = bool(torch.isfinite(out).all())
    ours_abs, ours_rel = _errors(out, ref)
    theirs = torch.mm(a, b) if bias is None else torch.addmm(bias, a, b)
    mm_abs, mm_rel = _errors(theirs, ref)
    return AccuracyResult(n=b.shape[1], k=b.shape[0], m=a.shape[0],
                          dtype=str(a.dtype).replace("torch.", ""), max_abs_err=ours_abs,
                          max_rel_err=ours_rel, torch_mm_max_abs_err=mm_abs,
                          torch_mm_max_rel_err=mm_rel,
                          tolerance=ACCURACY_TOLERANCE[a.dtype], all_written=all_written)


@dataclass(frozen=True)
class ProbeCase:
    """One (N, K, dtype) to probe and why: ``table`` (requested or a table entry), ``k_pow2``
    (K a power of two, vLLM #55131) or ``fp32_ieee`` (float32 inputs, vLLM #55466)."""

    n: int
    k: int
    dtype: str
    case: str = "table"


def edge_cases(table_shapes: Iterable[tuple[int, int]], n: int | None = None,
               ks: Sequence[int] | None = None, dtype: str = "bfloat16",
               ) -> tuple[ProbeCase, ...]:
    """The extra cases: ``(n, k)`` for every ``k`` in ``ks`` in ``dtype`` and in float32,
    and every shape of ``table_shapes`` in float32; duplicates of an earlier case are dropped.

    ``n`` and ``ks`` default to :data:`EDGE_N` and :data:`POW2_KS`.

    A case uses the table entry of its (dtype, N, K) when there is one, the fixed default
    configuration otherwise (the table tunes bfloat16 only).
    """
    n = EDGE_N if n is None else n
    ks = POW2_KS if ks is None else ks
    cases = [ProbeCase(n, k, dtype, "k_pow2") for k in ks]
    cases += [ProbeCase(n, k, "float32", "k_pow2") for k in ks]
    cases += [ProbeCase(tn, tk, "float32", "fp32_ieee") for tn, tk in table_shapes]
    seen: set[tuple[int, int, str]] = set()
    out = []
    for c in cases:
        if (c.n, c.k, c.dtype) not in seen:
            seen.add((c.n, c.k, c.dtype))
            out.append(c)
    return tuple(out)


def with_edge_cases(cases: Sequence[ProbeCase], dtype: str = "bfloat16") -> list[ProbeCase]:
    """``cases`` followed by :func:`edge_cases` of their shapes that are not already among them.

    For a device script that probes a table: ``with_edge_cases([ProbeCase(n, k, dt) for (dt, n,
    k) in sorted(table.entries)])``; each case's entry is ``table.lookup(c.dtype, c.n, c.k)``.
    """
    have = {(c.n, c.k, c.dtype) for c in cases}
    extra = [c for c in edge_cases([(c.n, c.k) for c in cases], dtype=dtype)
             if (c.n, c.k, c.dtype) not in have]
    return [*cases, *extra]


@dataclass(frozen=True)
class ShapeProbe:
    """Both gates for one weight shape."""

    invariance: InvarianceResult
    accuracy: tuple[AccuracyResult, ...]
    case: str = "table"

    @property
    def passed(self) -> bool:
        return self.invariance.passed and all(r.passed for r in self.accuracy)

    def to_dict(self) -> dict[str, Any]:
        inv = asdict(self.invariance)
        inv["passed"] = self.invariance.passed
        acc = []
        for r in self.accuracy:
            d = asdict(r)
            d["passed"] = r.passed
            acc.append(d)
        return {"n": self.invariance.n, "k": self.invariance.k, "dtype": self.invariance.dtype,
                "case": self.case, "passed": self.passed, "invariance": inv, "accuracy": acc}


def probe_shape(n: int, k: int, dtype: torch.dtype, device: str | torch.device,
                entry: ShapeConfig | None, max_m: int, accuracy_ms: Sequence[int],
                with_bias: bool = False, seed: int = 0, mm: MatmulFn = matmul_persistent,
                case: str = "table") -> ShapeProbe:
    """Run both gates on random inputs (N(0, 1) activations, N(0, 0.02) weights)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    m_values = probe_m_values(entry, max_m)
    accuracy_ms = [m for m in accuracy_ms if m <= max_m]
    rows = max([*m_values, *accuracy_ms])
    a_full = torch.randn(rows, k, generator=gen).to(device=device, dtype=dtype)  # [rows, K]
    w = (torch.randn(n, k, generator=gen) * 0.02).to(device=device, dtype=dtype)  # [N, K]
    b = w.t()  # [K, N], the layout vLLM passes
    bias = (torch.randn(n, generator=gen) * 0.1).to(device=device, dtype=dtype) \
        if with_bias else None
    invariance = check_invariance(a_full, b, bias, m_values, mm)
    accuracy = tuple(check_accuracy(a_full[:m], b, bias, mm) for m in accuracy_ms)
    return ShapeProbe(invariance=invariance, accuracy=accuracy, case=case)


def probe_cases(cases: Iterable[ProbeCase], table: GemmTable | None,
                device: str | torch.device, max_m: int, with_bias: bool = False,
                report: Callable[[ProbeCase, ShapeProbe], None] | None = None,
                ) -> list[ShapeProbe]:
    """Both gates on every case, in order: :func:`probe_shape` with the table's entry for the
    case's (dtype, N, K), or the fixed default where the table has none or there is no table.

    Gate 2 runs at M in :data:`ACCURACY_MS` and ``max_m`` (those up to ``max_m``). ``report``
    is called with each case and its result as soon as it is done (a progress line).
    """
    accuracy_ms = sorted({m for m in (*ACCURACY_MS, max_m) if m <= max_m})
    results = []
    for case in cases:
        entry = table.lookup(case.dtype, case.n, case.k) if table is not None else None
        res = probe_shape(case.n, case.k, getattr(torch, case.dtype), device, entry,
                          max_m=max_m, accuracy_ms=accuracy_ms, with_bias=with_bias,
                          case=case.case)
        if report is not None:
            report(case, res)
        results.append(res)
    return results


def probe_document(results: Sequence[ShapeProbe], table: GemmTable | None,
                   provenance: dict[str, Any]) -> dict[str, Any]:
    """The probe's JSON document (:data:`PROBE_SCHEMA`), the layout kernels/RESULTS.md reads."""
    shapes = [r.to_dict() for r in results]
    return {"schema": PROBE_SCHEMA, "table": table.source if table is not None else None,
            "provenance": provenance, "passed": all(r["passed"] for r in shapes),
            "shapes": shapes}
