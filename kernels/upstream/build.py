#!/usr/bin/env python3
"""Build ``kernels/upstream/``, the evidence package for proposing bistat's H200 GEMM table to
vLLM, from the committed raw files ``kernels/upstream/sources.toml`` lists.

Writes three files, each a pure function of those raw files (no date, no machine state), so the
committed package regenerates byte for byte:

``batch_invariant_configs_nvidia_h200.py``
    the table in the form of vLLM's ``batch_invariant_configs.py`` (``bistat_kernels.export_vllm``
    decides what vLLM's kernel can express); every entry and every bucket names the run that
    measured it, and a legend at the top gives each run's GPU, UUID, serial, driver, versions,
    date, command and raw file;
``provenance.json``
    the same, machine-readable;
``README.md``
    the reviewer-facing summary: what the table is, how it was measured, its ratios to torch.mm
    from the committed benches, vLLM's own table from the last bench that ran it, vLLM's
    ``tests/v1/determinism`` test by test, what the device runs (``scripts/device/
    upstream_bench.py``) measured, or that they are pending, and how to reproduce all of it.

Usage (repository root)::

    python kernels/upstream/build.py            # write the package
    python kernels/upstream/build.py --check    # compare instead; exit 1 naming what differs

``--device DIR`` (repeatable) ingests device folders in place of ``[device] folders`` in
sources.toml, to look at a session's outputs before committing them. A folder that is listed but
missing, or that lacks a file its manifest names, stops the build with an error naming the field
and the path; so do device folders from more than one GPU, and an arm whose log contradicts it
(the plugin installed in the ``vllm-table`` arm, or not in the ``bistat-table`` arm).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "kernels"))

# a script: kernels/ onto the path, for the kernels' package and this folder's modules (upstream.*)
from bistat_kernels import export_vllm, tables  # noqa: E402
from upstream.evidence import (_load_device_script, bucket_runs, load_bench,  # noqa: E402
                               load_device, load_probe, load_runs, vllm_table_facts)
from upstream.render_readme import (readme_determinism, readme_device,  # noqa: E402
                                    readme_intro, readme_measured, readme_pending,
                                    readme_reproduce)
from upstream.render_table import render_provenance, render_table  # noqa: E402
from upstream.sources import (DETERMINISM_SCHEMA, PROVENANCE_OUT, README_OUT,  # noqa: E402
                              SOURCES, STATUSES, TABLE_OUT, PackageError, _read_json, _sha256,
                              load_sources)


# ---- the build ---------------------------------------------------------------------------------

def build(root: Path = ROOT, device_folders: Sequence[str] | None = None,
          sources_path: Path | None = None) -> dict[str, str]:
    """{path relative to root: text} of every generated file. ``sources_path`` reads another
    sources.toml (paths in it still relative to ``root``)."""
    sources = load_sources(sources_path or root / SOURCES)
    table_path = root / sources.table
    if not table_path.is_file():
        raise PackageError(f"{SOURCES}: table = {sources.table!r}: no such file")
    try:
        table = tables.load_table(table_path)
    except Exception as exc:  # the loader's own message names the field and the fix
        raise PackageError(str(exc)) from None
    export = export_vllm.export_table(table, source=sources.table)
    runs = load_runs(root, sources)
    tags = bucket_runs(table, export, runs)
    vfacts = vllm_table_facts(root, sources)
    vllm_shapes = {tuple(s) for s in vfacts["tuned_shapes"]}
    table_sha = _sha256(table_path)
    for where, b in [("[[benches]]", b) for b in sources.benches] + [("[probe]", sources.probe)]:
        if b.table_sha256 != table_sha:
            raise PackageError(f"{SOURCES}: {where} {b.name!r} ran the table with sha256 "
                               f"{b.table_sha256[:16]}..., not {sources.table} as it is now "
                               f"({table_sha[:16]}...): bench and probe the shipped table and "
                               f"list those files")
    probe = load_probe(root, sources.probe)
    benches = [load_bench(root, b, f"[[benches]] {b.name!r} raw", "tuned_over_mm")
               for b in sources.benches]
    vbench = load_bench(root, sources.vllm_kernel_bench, "[vllm_kernel_bench] raw", "vllm_over_mm")
    det = _read_json(root, sources.determinism.raw, "[determinism] raw")
    if det.get("schema") != DETERMINISM_SCHEMA:
        raise PackageError(f"{sources.determinism.raw}: schema {det.get('schema')!r}, not "
                           f"{DETERMINISM_SCHEMA!r}")
    bad = [t["test"] for t in det["tests"] if t["on_lent_h200"] not in STATUSES]
    if bad:
        raise PackageError(f"{sources.determinism.raw}: on_lent_h200 of {bad[0]} is not one of "
                           f"{', '.join(STATUSES)}")
    folders = list(device_folders) if device_folders is not None else sources.device.folders
    field_name = ("--device" if device_folders is not None else f"{SOURCES} [device] folders")
    dev = load_device(root, folders, field_name)
    device_mod = _load_device_script(root)
    det_ran = any(r["step"] == "determinism" for r in dev.runs + dev.failed)
    readme = (readme_intro(sources, export, table_sha, vllm_shapes)
              + readme_measured(runs, benches, export, vbench, vfacts, probe)
              + readme_device(root, dev, device_mod)
              + readme_determinism(root, det, dev, device_mod)
              + readme_pending(dev, det_ran)
              + readme_reproduce(sources))
    return {TABLE_OUT: render_table(sources, export, runs, tags, vllm_shapes),
            PROVENANCE_OUT: render_provenance(sources, table_sha, export, runs, tags, vllm_shapes),
            README_OUT: "\n".join(readme).rstrip("\n") + "\n"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="compare with the committed files instead of writing")
    parser.add_argument("--device", action="append", default=None, metavar="DIR",
                        help="a device folder (repeatable), in place of sources.toml's list")
    parser.add_argument("--root", type=Path, default=ROOT, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        files = build(args.root, args.device)
    except PackageError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return 2
    differ = []
    for rel, text in files.items():
        path = args.root / rel
        if args.check:
            if not path.is_file() or path.read_text(encoding="utf-8") != text:
                differ.append(rel)
        else:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {rel} ({len(text.encode())} bytes)")
    if differ:
        print("differs from the raw files (run python kernels/upstream/build.py): "
              + ", ".join(differ), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
