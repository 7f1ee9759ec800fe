"""``bistat kernels tune | probe | sweep | bench | results``: the tuned batch-invariant GEMM.

Thin commands over :mod:`bistat_kernels` (the package ``kernels/bistat_kernels``). torch and triton
are imported only inside the commands that need them, so ``bistat`` works without the
``[kernels]`` extra; ``results`` needs neither (it renders recorded JSON).
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import click

_MODELS = ("qwen3-8b", "qwen3-1.7b", "smollm2-135m")
_DTYPES = ("bfloat16", "float16", "float32")


def _import_torch(command: str) -> object:
    """Import torch (and triton) or fail with the fix."""
    try:
        import torch
        import triton  # noqa: F401
    except ImportError as exc:
        raise click.ClickException(
            f"bistat kernels {command} needs torch and triton ({exc.name} is missing); "
            f"install them with: pip install 'bistat[kernels]'") from exc
    return torch


def _require_torch(command: str, *, allow_interpreter: bool) -> object:
    """Import torch (and triton) or fail with the fix; require CUDA unless interpreting."""
    torch = _import_torch(command)
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    if not torch.cuda.is_available() and not (allow_interpreter and interpreting):
        hint = (" or set TRITON_INTERPRET=1 to run small shapes on the CPU interpreter"
                if allow_interpreter else "")
        raise click.ClickException(f"bistat kernels {command} needs a CUDA GPU{hint}")
    return torch


def _parse_shape(text: str) -> tuple[int, int]:
    match = re.fullmatch(r"(\d+)x(\d+)", text)
    if match is None:
        raise click.BadParameter(f"got {text!r}; expected NxK, e.g. 4096x2048",
                                 param_hint="--shape")
    return int(match.group(1)), int(match.group(2))


#: the sweep's and the tune's parallel precompile
_WORKERS = click.option("--workers", default=8, show_default=True, type=click.IntRange(0),
                        help="Processes that precompile the candidates (0: compile when first "
                             "timed).")


@click.group("kernels")
def kernels() -> None:
    """The tuned batch-invariant Triton GEMM: tune, probe, sweep, bench, results, vLLM export."""


@kernels.command("probe")
@click.option("--table", "table_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Table file (default: the table of this GPU under kernels/bistat_kernels/tables).")
@click.option("--model", "models", multiple=True, type=click.Choice(_MODELS),
              help="Probe this model's shapes (repeatable).")
@click.option("--shape", "shapes", multiple=True, help="Probe the shape NxK (repeatable).")
@click.option("--dtype", default="bfloat16", show_default=True, type=click.Choice(_DTYPES))
@click.option("--max-m", default=4096, show_default=True, type=click.IntRange(1),
              help="Largest batch size checked.")
@click.option("--bias/--no-bias", default=False, show_default=True)
@click.option("--edge-cases", is_flag=True,
              help="Also probe K = 512, 1024, 2048, 4096 at N 4096 (in --dtype and float32) and "
                   "every probed shape in float32 (IEEE products, no TF32); JSON rows carry "
                   "case k_pow2 / fp32_ieee.")
@click.option("--output", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the results as JSON here.")
def probe_command(table_path: Path | None, models: tuple[str, ...], shapes: tuple[str, ...],
                  dtype: str, max_m: int, bias: bool, edge_cases: bool,
                  output: Path | None) -> None:
    """Check both gates: bitwise row invariance and accuracy.

    Gate 1 compares rows computed alone with the same rows inside batches (bitwise); gate 2
    compares with a higher-precision reference, beside torch.mm. Without --model/--shape,
    every entry of the table is probed. Exit code 1 if a gate fails.
    """
    torch = _require_torch("probe", allow_interpreter=True)
    from bistat_kernels import probe, tables
    from bistat_kernels.shapes import shapes_for

    from bistat_kernels.resolution import DeviceFacts, cuda_device_facts

    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        if table_path is not None:
            table = tables.load_table(table_path)
            tables.set_device_table(table)
        else:
            table = tables.resolve_device_table(
                cuda_device_facts(0) if device == "cuda" else DeviceFacts(None))
    except tables.TableError as exc:
        raise click.ClickException(str(exc)) from exc
    wanted = [(s.n, s.k) for s in shapes_for(models)] + [_parse_shape(s) for s in shapes]
    if not wanted:
        if table is None:
            raise click.ClickException("no table for this device; pass --table, --model or --shape")
        wanted = [(n, k) for (dt, n, k) in sorted(table.entries) if dt == dtype]
    cases = [probe.ProbeCase(n, k, dtype) for n, k in wanted]
    if edge_cases:
        cases = probe.with_edge_cases(cases, dtype)

    def echo(case: probe.ProbeCase, res: probe.ShapeProbe) -> None:
        inv = res.invariance
        acc = " ".join(f"M={r.m}:{r.max_rel_err:.2e}(torch.mm {r.torch_mm_max_rel_err:.2e})"
                       for r in res.accuracy)
        label = "" if case.case == "table" else f" [{case.case}]"
        click.echo(f"N={case.n} K={case.k} {case.dtype}{label}: invariance {inv.rows_equal}/"
                   f"{inv.rows_checked} rows equal; rel err {acc}; "
                   f"{'PASS' if res.passed else 'FAIL'}")

    results = probe.probe_cases(cases, table, device, max_m, with_bias=bias, report=echo)
    if output is not None:
        from bistat_kernels.provenance import gpu_provenance

        prov = (gpu_provenance(0, sys.argv) if device == "cuda" else
                {"gpu_name": "none (Triton interpreter on the CPU)", "command": " ".join(sys.argv)})
        output.write_text(json.dumps(probe.probe_document(results, table, prov), indent=1)
                          + "\n", encoding="utf-8")
    if not all(r.passed for r in results):
        sys.exit(1)


@kernels.command("sweep")
@click.option("--model", "models", multiple=True, type=click.Choice(_MODELS),
              help="Tune this model's shapes (repeatable; default: all three).")
@click.option("--out-dir", type=click.Path(file_okay=False, path_type=Path),
              default=Path("kernels/bistat_kernels/tables"), show_default=True,
              help="Where the table (<gpu>.json) and raw measurements are written.")
@click.option("--resume/--retune", default=True, show_default=True,
              help="Skip shapes already in the table in --out-dir, or tune all again.")
@click.option("--budget-s", default=480.0, show_default=True, type=click.FloatRange(1),
              help="Stop at a shape boundary before this many seconds.")
@_WORKERS
def sweep_command(models: tuple[str, ...], out_dir: Path, resume: bool, budget_s: float,
                  workers: int) -> None:
    """Tune the GEMM table on this GPU (chunked, resumable).

    BLOCK_K and SPLIT_K are chosen per shape, launch parameters per M bucket; every candidate
    passes both gates before it is timed.
    """
    torch = _require_torch("sweep", allow_interpreter=False)
    from bistat_kernels import sweep, tables
    from bistat_kernels.shapes import shapes_for

    slug = tables.device_slug(torch.cuda.get_device_name(0))
    res = sweep.run_sweep(
        shapes_for(models or _MODELS), out_dir,
        resume_table=out_dir / f"{slug}.json" if resume else None,
        resume_raw=out_dir / f"sweep_raw_{slug}.json" if resume else None,
        budget_s=budget_s, precompile_workers=workers, command=sys.argv, progress=click.echo)
    click.echo(f"table: {res['table']}")
    if res["missing"]:
        click.echo(f"not yet tuned (run again to resume): {', '.join(res['missing'])}")


@kernels.command("tune")
@click.option("--model", "models", multiple=True, type=click.Choice(_MODELS),
              help="Tune this model's shapes (repeatable; default: all three, unless --shape).")
@click.option("--shape", "shapes", multiple=True,
              help="Tune the weight shape NxK (N out, K in; repeatable).")
@click.option("--budget-s", default=600.0, show_default=True, type=click.FloatRange(1),
              help="Seconds for the whole tune (precompile, sweep and probe), kept.")
@click.option("--tables-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Where the table goes (default: $BISTAT_GEMM_TABLE_DIR, else "
                   "$BISTAT_HOME/gemm_tables, where the plugin looks for this GPU's table).")
@click.option("--resume/--retune", default=True, show_default=True,
              help="Continue an earlier tune of this GPU, or start again.")
@_WORKERS
@click.option("--max-m", default=4096, show_default=True, type=click.IntRange(1),
              help="Largest batch size the probe checks.")
@click.option("--edge-cases", is_flag=True,
              help="Also probe K = 512-4096 at N 4096 and float32 in IEEE precision (as "
                   "`probe --edge-cases`); written to the probe file only.")
@click.option("--dtype", default="bfloat16", show_default=True, type=click.Choice(_DTYPES),
              help="The weights' dtype (vLLM's batch-invariant GEMM runs bfloat16; the CPU "
                   "interpreter, float32 only).")
@click.option("--report", "report_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the tune's report (JSON) here too.")
def tune_command(models: tuple[str, ...], shapes: tuple[str, ...], budget_s: float,
                 tables_dir: Path | None, resume: bool, workers: int, max_m: int,
                 edge_cases: bool, dtype: str, report_path: Path | None) -> None:
    """Make this GPU's table: sweep, probe, write.

    The sweep, the probe and the writing of the table keep to --budget-s. Every candidate passes both gates (bitwise row invariance, accuracy) before it is timed, and
    every entry is probed again before it is written; the plugin then uses the table for this
    GPU. Stopped by its budget, a tune resumes where it stopped when run again. Exit code 1 if
    an entry failed the probe (it is left out of the table).
    """
    torch = _require_torch("tune", allow_interpreter=True)
    from bistat_kernels import tune
    from bistat_kernels.resolution import user_tables_dir
    from bistat_kernels.shapes import GemmShape, shapes_for

    wanted = shapes_for(models or (() if shapes else _MODELS))
    wanted += [GemmShape("shape", f"{n}x{k}", n, k) for n, k in map(_parse_shape, shapes)]
    report = tune.run_tune(wanted, tables_dir or user_tables_dir(), budget_s=budget_s,
                           retune=not resume, workers=workers, max_m=max_m,
                           edge_cases=edge_cases, dtype=getattr(torch, dtype),
                           command=sys.argv, progress=click.echo)
    if report_path is not None:
        report_path.write_text(json.dumps(report.to_dict(), indent=1) + "\n", encoding="utf-8")
    asked = len({(s.n, s.k) for s in wanted})
    click.echo(f"table: {report.table} ({len(report.in_table)} of the {asked} shapes asked for, "
               "each through both gates)" if Path(report.table).is_file() else
               "table: none written (no entry has passed both gates yet)")
    click.echo(f"time: {report.elapsed_s:.0f} s of a {budget_s:.0f} s budget")
    for what, names in (("not yet tuned (run again to resume)", report.not_swept),
                        ("not yet probed (run again to resume)", report.not_probed),
                        ("FAILED the probe (left out of the table)", report.failed_probe)):
        if names:
            click.echo(f"{what}: {', '.join(names)}")
    if report.failed_probe:
        sys.exit(1)


@kernels.command("bench")
@click.option("--table", "table_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Table file (default: the table of this GPU under kernels/bistat_kernels/tables).")
@click.option("--model", "models", multiple=True, type=click.Choice(_MODELS),
              help="Bench this model's shapes (repeatable; default: all three).")
@click.option("--vllm-kernel", "vllm_kernel_path", type=click.Path(path_type=Path),
              help="vLLM's batch-invariant GEMM as a fourth column: the installed vllm package "
                   "directory (or an unzipped wheel's), or its "
                   "model_executor/determinism/batch_invariant.py.")
@click.option("--empty-cache", is_flag=True,
              help="Hand PyTorch's cached GPU memory back before each shape, so that no shape's "
                   "timing depends on what the shapes before it left allocated.")
@click.option("--output", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the JSON (rows, summary, provenance) here.")
def bench_command(table_path: Path | None, models: tuple[str, ...],
                  vllm_kernel_path: Path | None, empty_cache: bool, output: Path | None) -> None:
    """Time tuned, torch.mm and the fixed default per shape and M.

    Prints one line per shape and the geometric means against the goals, the HBM roofline at
    M <= 16 and the host cost per eager call. With --vllm-kernel, vLLM's own kernel and tuned
    table run beside them, validated and checked for row invariance first.
    """
    vllm_kernel = None
    if vllm_kernel_path is not None:
        _import_torch("bench")  # a bad PATH is reported before the missing GPU
        from bistat_kernels import vllm_kernel as vk

        try:
            vllm_kernel = vk.load_vllm_kernel(vllm_kernel_path)
        except vk.VllmKernelError as exc:
            raise click.ClickException(str(exc)) from exc
    _require_torch("bench", allow_interpreter=False)
    from bistat_kernels import bench, tables
    from bistat_kernels.shapes import shapes_for

    if table_path is not None:
        try:
            tables.set_device_table(tables.load_table(table_path))
        except tables.TableError as exc:
            raise click.ClickException(str(exc)) from exc
    doc = bench.run_bench(shapes_for(models or _MODELS), command=sys.argv, progress=click.echo,
                          vllm_kernel=vllm_kernel, empty_cache=empty_cache)
    click.echo(format_bench_summary(doc["summary"], doc.get("host", {}).get("summary")),
               nl=False)
    if output is not None:
        output.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")


def format_bench_summary(summary: dict, host: dict | None = None) -> str:
    """The closing lines of ``bench``: geometric means against the goals (the summary's
    ``goal_targets``, else the earlier goals of 1.15 and 1.25)."""
    targets = summary.get("goal_targets", {"overall": 1.15, "decode": 1.25})
    lines = [f"geomean tuned/torch.mm over M in {summary['goal_ms']}: "
             f"{summary['geomean_tuned_over_mm']:.3f} (goal <= {targets['overall']:.2f})",
             f"geomean tuned/torch.mm at M <= {summary['decode_max_m']}: "
             f"{summary['decode_geomean_tuned_over_mm']:.3f} (goal <= {targets['decode']:.2f})",
             f"geomean default/torch.mm over the goal set: "
             f"{summary['geomean_default_over_mm']:.3f}"]
    if "geomean_vllm_over_mm" in summary:
        lines += [f"geomean vllm/torch.mm over the goal set: "
                  f"{summary['geomean_vllm_over_mm']:.3f}, at M <= {summary['decode_max_m']}: "
                  f"{summary['decode_geomean_vllm_over_mm']:.3f} ({summary['n_vllm_rows']} of "
                  f"{summary['n_rows']} rows timed)",
                  f"geomean tuned/vllm over the goal set: "
                  f"{summary['geomean_tuned_over_vllm']:.3f}"]
    if host is not None:
        lines.append(f"host us per eager call: tuned {host['mean_tuned_us']:.1f}, torch.mm "
                     f"{host['mean_torch_mm_us']:.1f}"
                     + (f", vllm {host['mean_vllm_us']:.1f}" if "mean_vllm_us" in host else "")
                     + f"; tuned - torch.mm {host['mean_tuned_minus_mm_us']:.1f} (max "
                       f"{host['max_tuned_minus_mm_us']:.1f}; goal <= {host['goal_us']:.0f})")
    return "\n".join(lines) + "\n"


@kernels.command("export-vllm")
@click.option("--table", "table_path", type=click.Path(dir_okay=False, path_type=Path),
              default=Path("kernels/bistat_kernels/tables/nvidia_h200.json"), show_default=True,
              help="The bistat table to export.")
@click.option("--arch-family", type=click.Choice(("ada", "hopper", "blackwell", "sm120")),
              help="vLLM's architecture key (default: from the entries' compute capability).")
@click.option("--split-k", "split_k", type=click.Choice(("omit", "nearest")), default="omit",
              show_default=True,
              help="Entries with split-K, which vLLM's kernel lacks: leave them out, or export "
                   "the same BLOCK_K without the split, marked UNMEASURED.")
@click.option("--output", type=click.Path(dir_okay=False, path_type=Path),
              default=Path("kernels/results/vllm_tuned_configs_nvidia_h200.py"),
              show_default=True,
              help="Python file to write; the provenance sidecar goes beside it "
                   "(.provenance.json).")
def export_vllm_command(table_path: Path, arch_family: str | None, split_k: str,
                        output: Path) -> None:
    """Write the table in vLLM 0.33.0's tuned-table format.

    The entries use vLLM's _MatmulShapeConfig/_MatmulMConfig literals under an architecture
    family key, each with its measurement's provenance in comments and in a JSON sidecar.
    Launch fields vLLM's kernel has no place for are dropped and listed; split-K entries are
    omitted unless --split-k nearest. Needs no GPU and no torch.
    """
    from bistat_kernels import export_vllm, tables

    try:
        table = tables.load_table(table_path)
    except (OSError, tables.TableError) as exc:
        raise click.ClickException(str(exc)) from exc
    try:
        export = export_vllm.export_table(table, arch_family=arch_family, split_k=split_k,
                                          source=_display_path(table_path))
    except export_vllm.ExportError as exc:
        raise click.ClickException(str(exc)) from exc
    export_vllm.parse_vllm_source(export.python_text)  # the written file reads back
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(export.python_text, encoding="utf-8")
    sidecar = output.with_suffix(".provenance.json")
    sidecar.write_text(export_vllm.sidecar_text(export), encoding="utf-8")
    click.echo(f"wrote {output} ({len(export.shapes)} shapes, family {export.arch_family}) "
               f"and {sidecar}")
    for name, count in export.dropped_summary().items():
        click.echo(f"dropped {name} (vLLM's kernel cannot express it) in {count} buckets")
    for o in export.omitted:
        click.echo(f"omitted ({o['n']}, {o['k']}) {o['dtype']}: {o['reason']}")


def _display_path(path: Path) -> str:
    """``path`` relative to the working directory when inside it (stable file headers)."""
    try:
        return path.resolve().relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        return path.as_posix()


@kernels.command("results")
@click.option("--results-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Recorded JSON (default: kernels/results).")
@click.option("--tables-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Tables (default: kernels/bistat_kernels/tables).")
@click.option("--output", type=click.Path(dir_okay=False, path_type=Path),
              help="Markdown file to write (default: kernels/RESULTS.md).")
def results_command(results_dir: Path | None, tables_dir: Path | None,
                    output: Path | None) -> None:
    """Regenerate RESULTS.md from the recorded JSON.

    Needs no GPU and no torch: it only renders kernels/results and kernels/bistat_kernels/tables.
    """
    from bistat_kernels import make_results

    text = make_results.render_results(results_dir or make_results.RESULTS_DIR,
                                       tables_dir or make_results.TABLES_DIR)
    target = output or make_results.KERNELS_DIR / "RESULTS.md"
    target.write_text(text, encoding="utf-8")
    click.echo(f"wrote {target}")


def register(group: click.Group) -> None:
    group.add_command(kernels)
