"""Regenerate ``kernels/RESULTS.md`` from the recorded JSON (tables, bench, probe, check, fused,
the decode profile and the plugin probe in compiled vLLM, the sweep timing check, and the tables
measured on other cards: ``results/cards/<card>/``, :mod:`bistat_kernels.results_cards`).

Nothing here measures; every number comes from a file written on the GPU, and the page says which
file and which command. This module finds and loads the files; :mod:`bistat_kernels.results_model`
computes each section's numbers into a frozen model; ``templates/RESULTS.md.j2`` words them (one
macro per section, plus the page). Rendering is deterministic, so a deleted RESULTS.md regenerates
to the same bytes (STYLE §1.5). Needs jinja2 (a core dependency of bistat), not torch::

    python -m bistat_kernels.make_results            # or: bistat kernels results
"""

from __future__ import annotations

import argparse
import functools
import json
import re
from pathlib import Path
from typing import Any

import jinja2

from bistat_kernels import results_cards
from bistat_kernels import results_model as model

PACKAGE_DIR = Path(__file__).resolve().parent
# The repository folder kernels/ (README, RESULTS.md, recorded results) holds the package.
KERNELS_DIR = PACKAGE_DIR.parent
RESULTS_DIR = KERNELS_DIR / "results"
TABLES_DIR = PACKAGE_DIR / "tables"
LAYERS = model.LAYERS


def _load(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


_NUMBER_WORDS = ("no", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
                 "ten", "eleven", "twelve")


def _and_words(words: list[str]) -> str:
    return " and ".join([", ".join(words[:-1]), words[-1]] if len(words) > 2 else words)


def _number_word(count: int) -> str:
    return str(_NUMBER_WORDS[count]) if count < len(_NUMBER_WORDS) else str(count)


@functools.cache
def _template() -> jinja2.Template:
    """``templates/RESULTS.md.j2``: plain text (no escaping), block tags take their line along."""
    env = jinja2.Environment(loader=jinja2.PackageLoader("bistat_kernels", "templates"),
                             autoescape=False, trim_blocks=True, lstrip_blocks=True,
                             keep_trailing_newline=False, undefined=jinja2.StrictUndefined)
    env.filters.update(fmt=format, number_word=_number_word,
                       and_words=lambda values: _and_words([str(v) for v in values]))
    return env.get_template("RESULTS.md.j2")


def _render(section: str, data: Any) -> list[str]:
    """One section of the page, as lines: the template's macro ``section`` given its model (a
    macro whose last line is a loop's ends in that line's newline; the page adds its own)."""
    return str(getattr(_template().module, section)(data)).removesuffix("\n").split("\n")


def _status_section(bench: dict[str, Any] | None, probe: dict[str, Any] | None,
                    check: dict[str, Any] | None, table: dict[str, Any] | None,
                    fused: dict[str, Any] | None, slug: str,
                    extra_rows: tuple[tuple[str, dict[str, Any]], ...] = (),
                    repeats: tuple[tuple[str, dict[str, Any]], ...] = (),
                    results_dir: Path = RESULTS_DIR) -> list[str]:
    """Goal status in one line, then which GPU and command each artefact came from.

    ``extra_rows`` are (what, provenance) pairs of further artefacts, listed after the check;
    ``repeats`` (source, bench) the main bench's table benched again on its GPU.
    """
    return _render("status", model.status(bench, probe, check, table, fused, slug, extra_rows,
                                          repeats, _source_provenance(table, results_dir)))


def _source_provenance(table: dict[str, Any] | None,
                       results_dir: Path = RESULTS_DIR) -> dict[str, dict[str, Any]]:
    """The provenance of each raw file a table's buckets name as their ``measured.source``
    (``kernels/results/... (what)``, read under ``results_dir``), for the files that exist and
    record one."""
    found: dict[str, dict[str, Any]] = {}
    for entry in (table or {}).get("entries", []):
        for bucket in entry["buckets"]:
            source = bucket["measured"].get("source")
            if source is None or source in found:
                continue
            name = source.split(" ", 1)[0].removeprefix("kernels/results/")
            doc = _load(results_dir / name)
            if doc is not None and "provenance" in doc:
                found[source] = doc["provenance"]
    return found


def _bench_section(bench: dict[str, Any], source: str, note: str | None = None) -> list[str]:
    return _render("bench", model.bench(bench, source, note))


def _table_section(table: dict[str, Any], source: str) -> list[str]:
    return _render("table", model.table(table, source))


def _probe_section(probe: dict[str, Any], source: str) -> list[str]:
    return _render("probe", model.probe(probe, source))


def _fused_section(fused: dict[str, Any], source: str) -> list[str]:
    """The fused split-K comparison: per shape and M, the table's launch, the fused ones, mm."""
    return _render("fused", model.fused(fused, source))


def _check_configs(gates: list[dict[str, Any]]) -> str:
    """'five launch configurations including split-K 2 and 3' (+ the fused ones), from the data."""
    return str(_template().module.check_configs(model.check_configs(gates)))


def _check_section(check: dict[str, Any], source: str) -> list[str]:
    return _render("check", model.check(check, source))


def _profile_section(doc: dict[str, Any], source: str, logs: str,
                     title: str = "Decode profile in compiled vLLM (before/after)") -> list[str]:
    """Per arm: call time, device time per decode step by category, CUDA graphs, the plugin.

    When the batch exceeds the CUDA-graph capture sizes (the decode steps ran eagerly), the
    section says so with the launch counts, gives each arm's wall minus device time per step and
    the tuned / batch-invariant ratios; a batch within the capture sizes renders without them.
    """
    return _render("profile", model.profile(doc, source, logs, title))


def _plugin_probe_section(probe: dict[str, Any], sidecar: dict[str, Any] | None,
                          model_doc: dict[str, Any] | None, source: str,
                          sidecar_source: str) -> list[str]:
    """The ``bistat probe`` of the plugin in compiled vLLM, with the sidecar's provenance."""
    return _render("plugin_probe",
                   model.plugin_probe(probe, sidecar, model_doc, source, sidecar_source))


def _sweep_timing_section(raw: dict[str, Any], table: dict[str, Any] | None,
                          committed: dict[str, Any] | None, before: dict[str, Any] | None,
                          device_output: dict[str, Any] | None, source: str,
                          before_source: str) -> list[str]:
    """A full re-tune after ``sweep.pin_triton_toolchain``: time per shape, first launches."""
    return _render("sweep_timing", model.sweep_timing(raw, table, committed, before,
                                                      device_output, source, before_source))


# The earlier runs kept under results/: folder, and what it was.
_EARLIER_RUNS = (
    ("call1_do_bench", "first sweep and bench timed with `triton.testing.do_bench`: it starts its "
     "event before the Python launch, so kernels shorter than a Triton launch (tens of "
     "microseconds) were timed as launch overhead; the method was replaced by CUDA-graph "
     "replays"),
    ("call2_first_graph_sweep", "first sweep with CUDA-graph timing and a smaller candidate set "
     "(decode-heavier layout score 3:3:1:1)"),
    ("call4_retune_partial", "device call 10 (`results/log_call4.txt`): a re-tune that reached "
     "only qwen3-8b/qkv before its budget ran out (its kernels compiled inside the timed loop; "
     "kernels/README.md says why); the bench used that qkv entry with the other 14 of the "
     "committed table, before the fused buckets; that table was not adopted"),
    ("tma_sweep/call5", "the descriptor-load (TMA) table of 2026-12-02 with split-K partials added "
     "by a second (reduce) kernel and plans launched through the compiled kernel's `run`; "
     "its table, sweep and log are in `results/tma_sweep/`"),
    ("k8", "the table before the per-bucket BLOCK_K re-tune (BLOCK_K fixed per shape), split-K "
     "in one launch, with vLLM 0.33.0's kernel as the third column (its probe is beside it)"),
    ("k10/before", "the k8 table on the k10 bench's GPU, minutes after it, by the same "
     "command (`results/k10/`)"),
    ("k10", "the table after the per-bucket BLOCK_K re-tune from M = 256 up, before the decode "
     "and small buckets (M <= 32) were re-tuned (`results/k10/`)"),
    ("k11/before", "the k10 table on the main bench's GPU, just before the M <= 32 re-tune "
     "(`results/k11/`)"),
    ("k11/after", "the re-tuned table benched in the re-tune's own call, after its candidates "
     "were chosen by time on the same GPU (selection makes this run optimistic; the main bench "
     "and `k11/confirm3` are its independent repeats)"),
    ("k11/before2", "the k10 table again, right after the main bench (`results/k11/`)"),
    ("k11/confirm3", "the re-tuned table, a third time (`results/k11/`)"),
    ("k11/before3", "the k10 table, a third time, right after `k11/confirm3`"),
    ("k11/confirm", "the k11 table's main bench (GPU-f2e2bf42...), before the k12 re-tune"),
    ("k12/after", "the k12 table benched in its re-tune's own call, after its candidates were "
     "chosen by time on the same GPU (optimistic; the main bench and `k12/confirm2` are its "
     "independent repeats; `results/k12/`)"),
    *((f"k13/{side}{i}", f"{what}, round {i} of three on GPU-bc251caf... (not the main bench's "
       "GPU), the two tables interleaved by `kernels/device/bench_tables.sh` (`results/k13/`)")
      for i in (1, 2, 3)
      for side, what in (("a", "the k11 table"), ("b", "the committed (k12) table"))))


# Independent repeats of the main bench: the committed table benched again on the main bench's
# GPU by the same command (folders under results/). A ratio goal counts as met only if every run
# meets it (results_model.goal).
_REPEATS = ("k12/confirm2",)


# Benches on another software stack (folder under results/, and what table it benched), shown in
# full after the main bench: the bench's heading names vLLM's kernel version, its provenance line
# the torch and triton it ran on.
_STACK_RUNS = (("k9", "This bench ran the table before the per-bucket BLOCK_K re-tune (the "
                      "`k8` row of the earlier runs below), on vLLM 0.34.0's own stack."),)


def _history_section(results_dir: Path) -> list[str]:
    found = [(sub, what, doc) for sub, what in _EARLIER_RUNS
             if (doc := _load(results_dir / sub / "bench_nvidia_h200.json")) is not None]
    history = model.history(found)
    return _render("history", history) if history is not None else []


def _batch_profiles(results_dir: Path, device_slug: str) -> list[tuple[str, str, dict[str, Any]]]:
    """(file name, log folder name, document) of each ``profile_decode_b<N>_<slug>.json``, by
    the batch in its settings; its engine logs are in ``profile_decode_b<N>_logs/``."""
    pattern = re.compile(rf"profile_decode_b(\d+)_{re.escape(device_slug)}\.json")
    found = []
    for path in results_dir.glob(f"profile_decode_b*_{device_slug}.json"):
        match = pattern.fullmatch(path.name)
        doc = _load(path) if match else None
        if match and doc is not None:
            found.append((path.name, f"profile_decode_b{match.group(1)}_logs", doc))
    return sorted(found, key=lambda item: (int(item[2]["settings"]["batch"]), item[0]))


def _batch_profile_title(doc: dict[str, Any]) -> str:
    return (f"Decode profile at batch {doc['settings']['batch']}"
            + (" (beyond the CUDA-graph sizes)" if model.beyond_graphs(doc) else ""))


def render_results(results_dir: Path = RESULTS_DIR, tables_dir: Path = TABLES_DIR,
                   device_slug: str = "nvidia_h200") -> str:
    """The markdown page, from the files under ``results_dir`` and ``tables_dir``."""
    sections: list[list[str]] = []
    bench = _load(results_dir / f"bench_{device_slug}.json")
    table = _load(tables_dir / f"{device_slug}.json")
    probe = _load(results_dir / f"probe_{device_slug}.json")
    check = _load(results_dir / "check_gpu.json")
    fused = _load(results_dir / f"fused_compare_{device_slug}.json")
    profile = _load(results_dir / f"profile_decode_{device_slug}.json")
    batch_profiles = _batch_profiles(results_dir, device_slug)
    plugin_probe = _load(results_dir / f"plugin_probe_{device_slug}.json")
    sidecar = _load(results_dir / f"plugin_probe_{device_slug}.provenance.json")
    check_dir = results_dir / "sweep_timing_check"
    sweep_raw = _load(check_dir / f"sweep_raw_{device_slug}.json")
    extra: list[tuple[str, dict[str, Any]]] = []
    if profile is not None:
        extra.append((f"`kernels/results/profile_decode_{device_slug}.json`: decode profile in "
                      "compiled vLLM", profile["provenance"]))
    for name, _, doc in batch_profiles:
        extra.append((f"`kernels/results/{name}`: decode profile at batch "
                      f"{doc['settings']['batch']} in compiled vLLM", doc["provenance"]))
    if plugin_probe is not None and sidecar is not None:
        extra.append((f"`kernels/results/plugin_probe_{device_slug}.json`: bistat probe of the "
                      "plugin in compiled vLLM (provenance from its sidecar)",
                      sidecar["provenance"]))
    if sweep_raw is not None:
        extra.append(("`kernels/results/sweep_timing_check/`: sweep timing check (not adopted)",
                      sweep_raw["provenance"]))
    if bench is not None or table is not None:
        repeats = tuple((f"results/{sub}/", doc) for sub in _REPEATS
                        if (doc := _load(results_dir / sub / f"bench_{device_slug}.json"))
                        is not None)
        sections.append(_status_section(bench, probe, check, table, fused, device_slug,
                                        tuple(extra), repeats, results_dir))
    if bench is not None:
        sections.append(_bench_section(bench, f"kernels/results/bench_{device_slug}.json"))
    for sub, note in _STACK_RUNS:
        stack = _load(results_dir / sub / f"bench_{device_slug}.json")
        if stack is not None:
            sections.append(_bench_section(stack,
                                           f"kernels/results/{sub}/bench_{device_slug}.json",
                                           note))
    if probe is not None:
        sections.append(_probe_section(probe, f"kernels/results/probe_{device_slug}.json"))
    if check is not None:
        sections.append(_check_section(check, "kernels/results/check_gpu.json"))
    if table is not None:
        sections.append(_table_section(table,
                                       f"kernels/bistat_kernels/tables/{device_slug}.json"))
    if fused is not None:
        sections.append(_fused_section(fused,
                                       f"kernels/results/fused_compare_{device_slug}.json"))
    if profile is not None:
        sections.append(_profile_section(profile,
                                         f"kernels/results/profile_decode_{device_slug}.json",
                                         "kernels/results/profile_decode_logs/"))
    for name, logs, doc in batch_profiles:
        sections.append(_profile_section(doc, f"kernels/results/{name}",
                                         f"kernels/results/{logs}/", _batch_profile_title(doc)))
    if plugin_probe is not None:
        probe_model = (_load(results_dir / Path(sidecar["model"]).name)
                       if sidecar is not None and "model" in sidecar else None)
        sections.append(_plugin_probe_section(
            plugin_probe, sidecar, probe_model, f"kernels/results/plugin_probe_{device_slug}.json",
            f"kernels/results/plugin_probe_{device_slug}.provenance.json"))
    if sweep_raw is not None:
        sections.append(_sweep_timing_section(
            sweep_raw, _load(check_dir / f"{device_slug}.json"), table,
            _load(results_dir / "call4_retune_partial" / f"sweep_raw_{device_slug}.json"),
            _load(check_dir / "device_output.json"),
            f"kernels/results/sweep_timing_check/sweep_raw_{device_slug}.json",
            f"results/call4_retune_partial/sweep_raw_{device_slug}.json"))
    cards = results_cards.load_cards(results_dir)
    if cards:
        sections.append(_render("cards", cards))
    history = _history_section(results_dir)
    if history:
        sections.append(history)
    # the page: each section followed by a blank line; the file ends in one newline
    page = _template().module.page(["\n".join(lines) for lines in sections],
                                   bench is None and table is None)
    return str(page).removesuffix("\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Regenerate kernels/RESULTS.md")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--tables-dir", type=Path, default=TABLES_DIR)
    parser.add_argument("--output", type=Path, default=KERNELS_DIR / "RESULTS.md")
    args = parser.parse_args(argv)
    args.output.write_text(render_results(args.results_dir, args.tables_dir), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
