"""Make this GPU's GEMM table in a stated time: sweep, probe, write (``bistat kernels tune``).

On any CUDA GPU, :func:`run_tune` tunes the weight shapes it is given (by default the three
models' 15) with the sweep that made the shipped H200 table (:mod:`bistat_kernels.sweep`: every
candidate through gate 1, bitwise against the layout's canonical launch, and gate 2, accuracy,
before it is timed), probes every entry it made (:mod:`bistat_kernels.probe`: both gates at every
bucket's edges up to M = 4096, as ``bistat kernels probe`` did for the shipped table) and writes
the entries that passed both to ``<tables folder>/<GPU slug>.json``, where the table resolution
finds it for this GPU's name (:mod:`bistat_kernels.resolution`, "user"). An entry that fails the
probe is left out of the table (and named): its shape keeps going to vLLM's own table.

The budget is stated before anything runs and kept: a share for the precompile, the sweep until
the probe's reserve, the probe's reserve (:class:`TuneBudget`); each stage stops at a shape
boundary, and a shape still sweeping at its deadline is dropped before its next candidate. A
tune stopped by its budget resumes where it stopped: the sweep's table and raw measurements and
the probe's results are kept in ``<tables folder>/tune-state/<GPU slug>/`` after every shape.

On the CPU (``TRITON_INTERPRET=1``) the same path runs the Triton interpreter, so tests run it end
to end with tiny shapes and a tiny budget; its table is named for :data:`sweep.INTERPRETER_DEVICE`
and never resolves for a GPU.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from bistat_kernels import probe, sweep, tables
from bistat_kernels.shapes import GemmShape

REPORT_SCHEMA = "bistat_kernels.tune/1"
STATE_DIR = "tune-state"
# reserved per probe case: twice what the H200 took (34 cases, the 15 entries and the edge
# cases, in 43 s: kernels/results/k12/log.txt)
PROBE_S_PER_SHAPE = 2.5
PRECOMPILE_SHARE = 0.2  # of the budget, at most, for compiling candidates in parallel


@dataclass(frozen=True)
class TuneBudget:
    """How a tune spends its seconds, stated before it starts.

    ``precompile_s``: the precompile stops starting chunks then; ``sweep_s``: no shape is swept
    past it (from the start); ``probe_s``: reserved after the sweep for the probe.
    """

    total_s: float
    precompile_s: float
    sweep_s: float
    probe_s: float

    @classmethod
    def split(cls, total_s: float, probe_cases: int) -> "TuneBudget":
        """The probe's reserve (:data:`PROBE_S_PER_SHAPE` per case, at most half the budget),
        the rest for the sweep, whose precompile takes at most :data:`PRECOMPILE_SHARE`.

        >>> TuneBudget.split(375, 34).describe()
        'budget 375 s: precompile at most 75 s, sweep until 290 s, probe until 375 s'
        """
        probe_s = min(total_s / 2, PROBE_S_PER_SHAPE * probe_cases)
        return cls(total_s, PRECOMPILE_SHARE * total_s, total_s - probe_s, probe_s)

    def describe(self) -> str:
        return (f"budget {self.total_s:.0f} s: precompile at most {self.precompile_s:.0f} s, "
                f"sweep until {self.sweep_s:.0f} s, probe until {self.total_s:.0f} s")


@dataclass(frozen=True)
class TuneReport:
    """What a tune did: the table it wrote, what is left, and the time it took."""

    device_name: str
    table: str
    budget: TuneBudget
    elapsed_s: float
    tuned_now: tuple[str, ...]
    in_table: tuple[str, ...]  # of the shapes asked for (the table may hold an earlier run's too)
    not_swept: tuple[str, ...]
    not_probed: tuple[str, ...]
    failed_probe: tuple[str, ...]
    probe_file: str | None
    provenance: dict[str, Any] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        """Every shape asked for is in the table (swept and through both gates)."""
        return not (self.not_swept or self.not_probed or self.failed_probe)

    @property
    def budget_kept(self) -> bool:
        return self.elapsed_s <= self.budget.total_s

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(schema=REPORT_SCHEMA, complete=self.complete, budget_kept=self.budget_kept)
        return d


def _name(shape: GemmShape) -> str:
    return f"{shape.model}/{shape.layer}"


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def run_tune(shapes: Sequence[GemmShape], tables_dir: Path, *, budget_s: float,
             retune: bool = False, workers: int = 8, max_m: int = 4096,
             edge_cases: bool = False, dtype: torch.dtype = torch.bfloat16,
             command: list[str] | None = None,
             progress: Callable[[str], None] = print) -> TuneReport:
    """Sweep, probe and write this GPU's table within ``budget_s`` (see the module docstring).

    Parameters
    ----------
    shapes : sequence of GemmShape
        The weight shapes to tune (duplicates of an (N, K) are tuned once).
    tables_dir : Path
        Where the table goes (``<GPU slug>.json``) and its state (``tune-state/<GPU slug>/``).
    budget_s : float
        Seconds for the whole tune, kept (:class:`TuneBudget`).
    retune : bool
        Forget the state of an earlier tune of this GPU and tune every shape again.
    workers : int
        Processes that precompile the sweep's candidates (0: compile when first timed).
    max_m : int
        The largest batch size the probe checks (4096: the shipped table's probe).
    edge_cases : bool
        Also probe K a power of two and float32 in IEEE precision (``probe --edge-cases``): they
        check the kernel, not this table, and go to the probe file only.

    Returns
    -------
    TuneReport
    """
    from bistat_kernels.provenance import gpu_provenance

    t0 = sweep.CLOCK()
    dtype_name = str(dtype).removeprefix("torch.")
    on_gpu = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
    device_name = torch.cuda.get_device_name(0) if on_gpu else sweep.INTERPRETER_DEVICE
    slug = tables.device_slug(device_name)
    state = tables_dir / STATE_DIR / slug
    if retune and state.is_dir():
        shutil.rmtree(state)
    state.mkdir(parents=True, exist_ok=True)
    unique: dict[tuple[int, int], GemmShape] = {}
    for shape in shapes:
        unique.setdefault((shape.n, shape.k), shape)
    wanted = list(unique.values())
    cases = [probe.ProbeCase(s.n, s.k, dtype_name) for s in wanted]
    extra = (probe.edge_cases([(s.n, s.k) for s in wanted], dtype=dtype_name)
             if edge_cases else ())
    extra = tuple(c for c in extra if (c.n, c.k, c.dtype) not in
                  {(x.n, x.k, x.dtype) for x in cases})
    budget = TuneBudget.split(budget_s, len(cases) + len(extra))
    progress(f"tune: {device_name}, {len(wanted)} shape(s); {budget.describe()}; state in {state}")

    res = sweep.run_sweep(wanted, state, dtype=dtype, resume_table=state / f"{slug}.json",
                          resume_raw=state / f"sweep_raw_{slug}.json", budget_s=budget.sweep_s,
                          precompile_workers=workers if on_gpu else 0,
                          precompile_budget_s=budget.precompile_s, command=command,
                          progress=progress)
    swept_path = Path(res["table"])
    swept = tables.load_table(swept_path).entries if swept_path.is_file() else {}

    provenance = gpu_provenance(0, command)
    if not on_gpu:
        provenance["gpu_name"] = device_name
    probe_path = state / f"probe_{slug}.json"
    probed: dict[str, dict[str, Any]] = {}  # _case_key -> a ShapeProbe's dict, with probed_on
    if probe_path.is_file():
        probed = {_case_key(s): s for s in json.loads(probe_path.read_text(encoding="utf-8"))
                  ["shapes"]}
    todo = [c for c in cases if (dtype_name, c.n, c.k) in swept] + list(extra)
    per_case: list[float] = []
    # the probe runs the launcher as the plugin will: the swept entries, and for the edge cases'
    # shapes without one the fixed configuration (no vLLM table: that is not this table's to test)
    swept_table = tables.GemmTable(device_name, dict(swept), str(swept_path))
    tables.set_device_table(swept_table)
    try:
        for case in todo:
            if _case_key(asdict(case)) in probed:
                continue  # probed by an earlier run of this tune
            elapsed = sweep.CLOCK() - t0
            if elapsed + (max(per_case) if per_case else 0.0) > budget.total_s:
                progress(f"tune: budget {budget.total_s:.0f} s reached after {elapsed:.0f} s "
                         "before every entry was probed; run again to resume")
                break
            started = sweep.CLOCK()
            (result,) = probe.probe_cases([case], swept_table, "cuda" if on_gpu else "cpu",
                                          max_m)
            per_case.append(sweep.CLOCK() - started)
            probed[_case_key(asdict(case))] = dict(
                result.to_dict(), probed_on={k: provenance.get(k) for k in (
                    "gpu_name", "gpu_uuid", "driver", "torch", "triton", "date_utc")})
            progress(f"tune: probe {case.case} {case.dtype} N={case.n} K={case.k}: invariance "
                     f"{result.invariance.rows_equal}/{result.invariance.rows_checked} rows "
                     "equal, max rel err "
                     f"{max((r.max_rel_err for r in result.accuracy), default=0):.2e}; "
                     + ("PASS" if result.passed else "FAIL"))
            _write_json(probe_path, {"schema": probe.PROBE_SCHEMA, "table": str(swept_path),
                                     "provenance": provenance,
                                     "passed": all(s["passed"] for s in probed.values()),
                                     "shapes": list(probed.values())})
    finally:
        tables.reset_device_table()

    # the table: every swept entry of this GPU (of this run's shapes or an earlier run's) whose
    # probe passed, with the probe's summary; the others are named in the report
    kept, failed, not_probed = [], [], []
    for (dt, n, k), entry in sorted(swept.items()):
        result = probed.get(_case_key({"dtype": dt, "n": n, "k": k, "case": "table"}))
        if result is None:
            not_probed.append(entry)
        elif not result["passed"]:
            failed.append(entry)
        else:
            kept.append(tables.ShapeConfig(
                entry.dtype, entry.n, entry.k, entry.block_k, entry.split_k, entry.buckets,
                entry.provenance, dict(entry.extra, probe=_probe_summary(result))))
    table_path = tables.table_path_for(device_name, tables_dir)
    if kept:
        _write_json(table_path, tables.table_to_dict(device_name, kept))
    elif table_path.is_file():
        table_path.unlink()  # nothing passed: no table, so the GPU keeps vLLM's

    def names(entries: list[tables.ShapeConfig]) -> tuple[str, ...]:
        have = {(e.n, e.k) for e in entries if e.dtype == dtype_name}
        return tuple(_name(s) for s in wanted if (s.n, s.k) in have)

    not_swept = tuple(_name(s) for s in wanted if (dtype_name, s.n, s.k) not in swept)
    report = TuneReport(device_name, str(table_path), budget, round(sweep.CLOCK() - t0, 1),
                        tuple(res["done"]), names(kept), not_swept, names(not_probed),
                        names(failed), str(probe_path) if probed else None, provenance)
    _write_json(state / f"tune_{slug}.json", report.to_dict())
    return report


def _case_key(case: dict[str, Any]) -> str:
    """``'bfloat16/4096x2048/table'``: a probe case (or its result) by dtype, shape and kind."""
    return f"{case['dtype']}/{case['n']}x{case['k']}/{case.get('case', 'table')}"


def _probe_summary(shape: dict[str, Any]) -> dict[str, Any]:
    """What a table entry records of its probe (the rows are in the probe file): both gates'
    outcome, the batch sizes, the largest error against its tolerance, and where it ran."""
    inv, acc = shape["invariance"], shape["accuracy"]
    return {"passed": shape["passed"], "rows_equal": inv["rows_equal"],
            "rows_checked": inv["rows_checked"], "m_values": list(inv["m_values"]),
            "max_rel_err": max((r["max_rel_err"] for r in acc), default=None),
            "tolerance": acc[0]["tolerance"] if acc else None, **shape.get("probed_on", {})}
