#!/usr/bin/env python3
"""One device command: make this card's GEMM table, then measure it beside another card's table
and the fixed default configuration, against torch.mm, on this card.

Made for the H100 (no table of its own shipped; the H200's resolves by architecture), usable on
any CUDA GPU. The device image has torch and triton but not bistat's other dependencies; the
``bistat kernels`` commands run from the checkout (they need only click besides)::

    PYTHONPATH=src:kernels PYTHONUNBUFFERED=1 python3 kernels/device/tune_card.py \\
        --out "$OUT" --budget-s 500 --compare nvidia_h200

Stages, in this order, each a ``bistat kernels`` command run in this process (its own command
line is what its files record) and each only while the budget lasts:

1. ``probe --table T --edge-cases`` of each --compare table T on this card (both gates);
2. ``tune --edge-cases`` of the three models' 15 shapes into ``--work``/tables, with the budget
   left after the benches' reserve (it resumes a tune state left in ``--work``);
3. ``bench --table`` of the new table, then of each --compare table (side by side on one card, a
   minute apart; each bench also times the fixed default configuration and torch.mm), then of
   the new table again if the time allows (a repeat: pass-to-pass variation).

Everything goes to ``--out``, at most 8 files (what the device tool returns): the new table, its
probe (from the tune), each bench, each compared table's probe, ``manifest.json`` (the card,
versions, commit, each stage's command, exit status and seconds, the tune's report and a summary
of every bench) and ``extras.tgz`` (the tune's state: sweep raw measurements, its report; bench
repeats). Files a stage could not write are absent, and the manifest says why. The log is the
command's output (``tee`` it to ``$OUT/log.txt``). kernels/README.md ("Tables for other cards")
says where each file goes in the repository and how kernels/RESULTS.md picks them up.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import subprocess
import sys
import tarfile
import time
import traceback
from pathlib import Path

import click
import torch

from bistat_kernels import tables
from bistat_kernels.provenance import gpu_provenance

ROOT = Path(__file__).resolve().parents[2]
MANIFEST_SCHEMA = "bistat_kernels.card_run/1"
# Seconds reserved per stage, from the H200 runs (kernels/results/k12/log.txt: the probe of a
# table with the edge cases 43 s, a bench 10-12 s) with room for a slower card and the imports.
PROBE_S = 60.0
BENCH_S = 35.0
PACK_S = 10.0
MAX_FILES = 8


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def bistat(args: list[str]) -> int:
    """``bistat ARGS`` in this process, with ``sys.argv`` set to that command line (so the files
    it writes record it as their command); returns its exit status (2: it raised)."""
    from bistat.cli import cli

    saved = sys.argv
    sys.argv = ["bistat", *args]
    log("$ " + " ".join(sys.argv))
    try:
        cli.main(args, prog_name="bistat", standalone_mode=False)
        return 0
    except SystemExit as exc:
        return int(exc.code or 0)
    except click.ClickException as exc:
        log(f"error: {exc.format_message()}")
        return exc.exit_code
    except Exception:  # noqa: BLE001 - reported; the next stage still runs and files come back
        traceback.print_exc()
        return 2
    finally:
        sys.argv = saved
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def source_commit() -> str | None:
    """The commit this copy is of: scripts/device/SOURCE_COMMIT (travel.sh), else git's HEAD."""
    travelled = ROOT / "scripts" / "device" / "SOURCE_COMMIT"
    if travelled.is_file():
        return travelled.read_text(encoding="utf-8").strip()
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], check=True,
                              capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head or None


def compare_table(name: str) -> Path:
    """A shipped table's name (``nvidia_h200``) or a table file."""
    return tables.override_path(name)


def summary_of(bench_file: Path) -> dict | None:
    """The bench's geometric means (the goal set, M <= 32; default / torch.mm) and its table."""
    if not bench_file.is_file():
        return None
    doc = json.loads(bench_file.read_text(encoding="utf-8"))
    s = doc["summary"]
    keys = ("geomean_tuned_over_mm", "decode_geomean_tuned_over_mm", "geomean_default_over_mm",
            "decode_geomean_default_over_mm", "goal_overall_met", "goal_decode_met")
    return {"file": bench_file.name, "table": doc.get("table"),
            **{k: s[k] for k in keys if k in s},
            **({"geomean_vllm_over_mm": s["geomean_vllm_over_mm"]}
               if "geomean_vllm_over_mm" in s else {})}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--budget-s", type=float, default=500.0,
                        help="the whole command's seconds, kept (default 500: a 9-minute call)")
    parser.add_argument("--compare", action="append", default=[],
                        help="another table to measure on this card: a shipped table's name or a "
                             "file (repeatable; e.g. nvidia_h200)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/bistat-tune-card"),
                        help="the tune's folder (tables/ and its state: a later call resumes it)")
    parser.add_argument("--shape", action="append", default=[],
                        help="tune these NxK instead of the three models' shapes (CPU tests)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-m", type=int, default=4096)
    parser.add_argument("--workers", type=int, default=16, help="precompile processes")
    parser.add_argument("--edge-cases", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--vllm-kernel", type=Path, default=None,
                        help="vLLM's determinism/ folder (e.g. vLLM 0.34.0's, carried): its own "
                             "kernel and table as a fourth bench column, where it exists")
    args = parser.parse_args(argv)
    t0 = time.monotonic()
    out, work = args.out, args.work
    out.mkdir(parents=True, exist_ok=True)
    tables_dir = work / "tables"
    tables_dir.mkdir(parents=True, exist_ok=True)
    on_gpu = torch.cuda.is_available()
    from bistat_kernels import sweep

    device_name = torch.cuda.get_device_name(0) if on_gpu else sweep.INTERPRETER_DEVICE
    slug = tables.device_slug(device_name)
    compare = [compare_table(c) for c in args.compare]
    common = ["--dtype", args.dtype, "--max-m", str(args.max_m)]
    edge = ["--edge-cases"] if args.edge_cases else []
    shapes = [x for s in args.shape for x in ("--shape", s)]
    vllm = (["--vllm-kernel", str(args.vllm_kernel)]
            if args.vllm_kernel is not None and args.vllm_kernel.exists() else [])
    manifest: dict = {"schema": MANIFEST_SCHEMA, "device_name": device_name,
                      "provenance": gpu_provenance(0, sys.argv), "source_commit": source_commit(),
                      "budget_s": args.budget_s, "stages": [], "benches": [],
                      "compare": [str(p) for p in compare],
                      "vllm_kernel": vllm[1] if vllm else None}
    extras = work / "extras"  # packed into --out at the end, so that --out never holds more
    shutil.rmtree(extras, ignore_errors=True)  # than its 8 files, even if the call is cut short
    extras.mkdir()
    if args.vllm_kernel is not None and not vllm:
        log(f"--vllm-kernel {args.vllm_kernel}: not found; the benches run without vLLM's kernel")

    def left() -> float:
        return args.budget_s - (time.monotonic() - t0)

    def stage(name: str, command: list[str], files: list[Path]) -> int:
        started = time.monotonic()
        code = bistat(command)
        manifest["stages"].append({
            "stage": name, "command": "bistat " + " ".join(command), "exit": code,
            "started_s": round(started - t0, 1), "seconds": round(time.monotonic() - started, 1),
            "files": [f.name for f in files if f.is_file()]})
        write_manifest()
        return code

    def skip(name: str, why: str) -> None:
        log(f"{name}: skipped ({why})")
        manifest["stages"].append({"stage": name, "skipped": why})

    def write_manifest() -> None:
        (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n",
                                           encoding="utf-8")

    log(f"tune_card: {device_name}; budget {args.budget_s:.0f} s; compare "
        f"{', '.join(p.name for p in compare) or 'nothing'}")
    write_manifest()
    # 1. each compared table's gates on this card
    for path in compare:
        name = f"probe_{path.stem}_on_{slug}.json"
        if left() < PROBE_S + PACK_S:
            skip(f"probe {path.name}", f"{left():.0f} s left")
            continue
        stage(f"probe {path.name}", ["kernels", "probe", "--table", str(path), *edge, *common,
                                     "--output", str(out / name)], [out / name])
    # 2. this card's table, with the benches' reserve kept back
    reserve = BENCH_S * (1 + len(compare)) + PACK_S
    tune_s = left() - reserve
    report = extras / f"tune_report_{slug}.json"
    if tune_s < 30:
        skip("tune", f"{tune_s:.0f} s would be left for it")
    else:
        stage("tune", ["kernels", "tune", *shapes, *edge, *common, "--budget-s", f"{tune_s:.0f}",
                       "--workers", str(args.workers), "--tables-dir", str(tables_dir),
                       "--report", str(report)], [report])
    if report.is_file():
        manifest["tune"] = json.loads(report.read_text(encoding="utf-8"))
    table = tables_dir / f"{slug}.json"
    state = tables_dir / "tune-state" / slug
    if table.is_file():
        shutil.copy(table, out / table.name)
    if (state / f"probe_{slug}.json").is_file():
        shutil.copy(state / f"probe_{slug}.json", out / f"probe_{slug}.json")
    # 3. the benches: this card's table, each compared one, this card's again if time allows
    plan = ([table] if table.is_file() else []) + compare
    plan += [table] if table.is_file() else []
    for i, path in enumerate(plan):
        repeat = i == len(plan) - 1 and path == table and len(plan) > 1
        name = (f"bench_{slug}.json" if path == table else f"bench_{path.stem}_on_{slug}.json")
        target = extras / f"bench_{slug}_repeat.json" if repeat else out / name
        if left() < BENCH_S + PACK_S:
            skip(f"bench {path.name}" + (" (repeat)" if repeat else ""), f"{left():.0f} s left")
            continue
        code = stage(f"bench {path.name}" + (" (repeat)" if repeat else ""),
                     ["kernels", "bench", "--table", str(path), *vllm, "--output", str(target)],
                     [target])
        if code == 0:
            manifest["benches"].append(dict(summary_of(target) or {}, repeat=repeat))
    # the tune's state and the repeats, packed (the device tool returns at most 8 files)
    if state.is_dir():
        shutil.copytree(state, extras / "tune-state", dirs_exist_ok=True)
    with tarfile.open(out / "extras.tgz", "w:gz") as tar:
        tar.add(extras, arcname="extras")
    manifest["seconds"] = round(time.monotonic() - t0, 1)
    manifest["budget_kept"] = manifest["seconds"] <= args.budget_s
    write_manifest()
    files = sorted(p.name for p in out.iterdir())
    log(f"tune_card: {manifest['seconds']:.0f} s of {args.budget_s:.0f}; files: {', '.join(files)}")
    for b in manifest["benches"]:
        log(f"bench {b['table']}{' (repeat)' if b['repeat'] else ''}: tuned/torch.mm "
            f"{b.get('geomean_tuned_over_mm', float('nan')):.3f} over the goal set, "
            f"{b.get('decode_geomean_tuned_over_mm', float('nan')):.3f} at M <= 32; default/"
            f"torch.mm {b.get('geomean_default_over_mm', float('nan')):.3f}")
    if len(files) > MAX_FILES:
        log(f"tune_card: {len(files)} files in {out}, more than the {MAX_FILES} the device tool "
            "returns")
    failed = [s for s in manifest["stages"] if s.get("exit")]
    return 1 if failed or not table.is_file() else 0


if __name__ == "__main__":
    sys.exit(main())
