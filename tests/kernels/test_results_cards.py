"""RESULTS.md's "Tables on other cards": a card folder as tune_card.py writes it, rendered."""

from __future__ import annotations

import json
from pathlib import Path

from bistat_kernels import make_results, results_cards

SLUG = "nvidia_h100_80gb_hbm3"
PROV = {"gpu_name": "NVIDIA H100 80GB HBM3", "gpu_uuid": "GPU-67980af2", "driver": "580.159.04",
        "torch": "2.11.0+cu130", "cuda": "13.0", "triton": "3.6.0",
        "date_utc": "2026-12-08T10:00:00Z"}


def _bench(overall, decode, default, command):
    return {"provenance": dict(PROV, command=command),
            "summary": {"geomean_tuned_over_mm": overall, "decode_geomean_tuned_over_mm": decode,
                        "geomean_default_over_mm": default,
                        "decode_geomean_default_over_mm": default + 0.7, "decode_max_m": 32,
                        "goal_targets": {"overall": 1.05, "decode": 1.0}}}


def _probe(passed):
    return {"shapes": [{"passed": True}] * 33 + [{"passed": passed}]}


def _card_folder(results: Path) -> Path:
    folder = results / "cards" / SLUG
    folder.mkdir(parents=True)
    files = {
        f"bench_{SLUG}.json": _bench(1.031, 0.998, 2.27, "bistat kernels bench --table a"),
        f"bench_nvidia_h200_on_{SLUG}.json": _bench(1.022, 0.985, 2.26,
                                                    "bistat kernels bench --table b"),
        f"bench_{SLUG}_repeat.json": _bench(1.029, 0.997, 2.28, "bistat kernels bench --table a"),
        f"probe_{SLUG}.json": _probe(True),
        f"probe_nvidia_h200_on_{SLUG}.json": _probe(False),
        "manifest.json": {"device_name": "NVIDIA H100 80GB HBM3", "seconds": 402.4,
                          "budget_s": 500, "source_commit": "abc1234 clean",
                          "tune": {"elapsed_s": 281.0, "budget": {"total_s": 371.0},
                                   "complete": True, "in_table": ["m/l"] * 15}}}
    for name, doc in files.items():
        (folder / name).write_text(json.dumps(doc), encoding="utf-8")
    return folder


def test_a_card_folder_renders_its_tables_side_by_side(tmp_path):
    results = tmp_path / "kernels" / "results"
    _card_folder(results)
    (cards,) = results_cards.load_cards(results)
    assert [(r.table, r.own, r.repeat, r.probe_passed) for r in cards.rows] == [
        (f"{SLUG}.json", True, False, 34), (f"{SLUG}.json", True, True, 34),
        ("nvidia_h200.json", False, False, 33)]
    text = make_results.render_results(results, tmp_path / "no-tables")
    section = text[text.index("## Tables on other cards"):]
    assert section.splitlines()[4:13] == [
        "### NVIDIA H100 80GB HBM3 (`kernels/results/cards/nvidia_h100_80gb_hbm3/`)",
        "",
        "| table | tuned / torch.mm | at M <= 32 | default / torch.mm | default at M <= 32 | "
        "both gates | bench |",
        "|---|---|---|---|---|---|---|",
        f"| `{SLUG}.json` (this card's own) | 1.031 | 0.998 | 2.270 | 2.970 | 34 of 34 cases "
        f"pass | `kernels/results/cards/{SLUG}/bench_{SLUG}.json` |",
        f"| `{SLUG}.json` (this card's own), again | 1.029 | 0.997 | 2.280 | 2.980 | 34 of 34 "
        f"cases pass | `kernels/results/cards/{SLUG}/bench_{SLUG}_repeat.json` |",
        f"| `nvidia_h200.json` | 1.022 | 0.985 | 2.260 | 2.960 | **33 of 34 cases pass** | "
        f"`kernels/results/cards/{SLUG}/bench_nvidia_h200_on_{SLUG}.json` |",
        "",
        "Goals (as for the H200): tuned / torch.mm <= 1.05 over the goal set and <= 1.00 at "
        "M <= 32."]
    assert ("The card's own table: `bistat kernels tune` put 15 shapes through both gates in "
            "281 s of its 371 s budget (complete); the whole call took 402 s of 500, bistat "
            "commit abc1234 clean.") in section
    assert (f"- `kernels/results/cards/{SLUG}/bench_nvidia_h200_on_{SLUG}.json`: NVIDIA H100 "
            "80GB HBM3 (UUID GPU-67980af2), driver 580.159.04, torch 2.11.0+cu130, CUDA 13.0, "
            "triton 3.6.0, 2026-12-08T10:00:00Z; command `bistat kernels bench --table b`.") \
        in section


def test_without_card_folders_the_page_has_no_such_section(tmp_path):
    assert results_cards.load_cards(tmp_path) == ()
    (tmp_path / "cards" / "empty").mkdir(parents=True)
    assert results_cards.load_cards(tmp_path) == ()
    assert "Tables on other cards" not in make_results.render_results(
        make_results.RESULTS_DIR, make_results.TABLES_DIR)
