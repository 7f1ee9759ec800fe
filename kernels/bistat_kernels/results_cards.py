"""RESULTS.md's section for cards other than the H200: each table measured on one card, side by
side (the card's own table, other cards' tables, the fixed default configuration, torch.mm).

A card's files sit in ``kernels/results/cards/<card slug>/``, as ``kernels/device/tune_card.py``
writes them: ``manifest.json`` (the card, the commands, the tune's report, the budget),
``bench_<card slug>.json`` (the card's own table), ``bench_<table>_on_<card slug>.json`` (another
card's table), ``probe_*.json`` beside each, and optionally ``bench_<card slug>_repeat.json``.
:func:`card` computes one card's numbers from them (this module words nothing; the template's
``cards`` macro does); :func:`load_cards` finds the folders. Every number is the bench's own
summary (geometric means of time / torch.mm time over the goal set and at M <= 32), and every
row carries the file it came from and that file's provenance.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bistat_kernels.results_common import Provenance, provenance

CARDS_DIR = "cards"


@dataclass(frozen=True)
class TableOnCard:
    """One table's bench (and probe) on the card."""

    table: str                     # the table's file name
    own: bool                      # the card's own table (not another card's)
    source: str                    # the bench file, from the repository's root
    overall: float                 # tuned / torch.mm, geometric mean over the goal set
    decode: float                  # ... at M <= decode_max_m
    default_overall: float         # the fixed default configuration / torch.mm, same rows
    default_decode: float
    overall_target: float | None
    decode_target: float | None
    decode_max_m: int
    repeat: bool                   # a second bench of the same table in the same call
    probe_cases: int | None        # cases the probe ran (None: no probe file)
    probe_passed: int | None
    provenance: Provenance


@dataclass(frozen=True)
class Card:
    """One card's measurements: its tables side by side, and how its own table was made."""

    name: str
    folder: str
    rows: tuple[TableOnCard, ...]
    tune_seconds: float | None
    tune_budget_s: float | None
    tune_complete: bool | None
    tune_shapes: int | None
    call_seconds: float | None
    call_budget_s: float | None
    source_commit: str | None


def _load(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def _row(folder: Path, bench_file: Path, slug: str, kernels_dir: Path) -> TableOnCard:
    doc = json.loads(bench_file.read_text(encoding="utf-8"))
    s = doc["summary"]
    stem = bench_file.stem.removeprefix("bench_")
    repeat = stem.endswith("_repeat")
    own = stem.removesuffix("_repeat") == slug
    table = f"{slug}.json" if own else f"{stem.removesuffix(f'_on_{slug}')}.json"
    probe = _load(folder / (f"probe_{slug}.json" if own else f"probe_{stem}.json"))
    shapes = probe["shapes"] if probe is not None else None
    targets = s.get("goal_targets") or {}
    return TableOnCard(
        table=table, own=own, source=bench_file.relative_to(kernels_dir.parent).as_posix(),
        overall=s["geomean_tuned_over_mm"], decode=s["decode_geomean_tuned_over_mm"],
        default_overall=s["geomean_default_over_mm"],
        default_decode=s["decode_geomean_default_over_mm"],
        overall_target=targets.get("overall"), decode_target=targets.get("decode"),
        decode_max_m=s["decode_max_m"], repeat=repeat,
        probe_cases=None if shapes is None else len(shapes),
        probe_passed=None if shapes is None else sum(bool(x["passed"]) for x in shapes),
        provenance=provenance(doc["provenance"]))


def card(folder: Path, kernels_dir: Path) -> Card | None:
    """One card's section model from ``folder`` (None when it holds no bench). Rows: the card's
    own table first, then the others by file name, each repeat after its first bench."""
    manifest = _load(folder / "manifest.json") or {}
    slug = folder.name
    benches = sorted(folder.glob("bench_*.json"))
    if not benches:
        return None
    rows = sorted((_row(folder, b, slug, kernels_dir) for b in benches),
                  key=lambda r: (not r.own, r.table, r.repeat))
    tune = manifest.get("tune") or {}
    budget = tune.get("budget") or {}
    name = manifest.get("device_name") or rows[0].provenance.gpu_name
    return Card(name=name, folder=folder.relative_to(kernels_dir.parent).as_posix(),
                rows=tuple(rows),
                tune_seconds=tune.get("elapsed_s"), tune_budget_s=budget.get("total_s"),
                tune_complete=tune.get("complete"),
                tune_shapes=len(tune["in_table"]) if "in_table" in tune else None,
                call_seconds=manifest.get("seconds"), call_budget_s=manifest.get("budget_s"),
                source_commit=manifest.get("source_commit"))


def load_cards(results_dir: Path) -> tuple[Card, ...]:
    """Every card folder under ``results_dir/cards`` with a bench, in folder-name order."""
    root = results_dir / CARDS_DIR
    if not root.is_dir():
        return ()
    found = (card(folder, results_dir.parent) for folder in sorted(root.iterdir())
             if folder.is_dir())
    return tuple(c for c in found if c is not None)
