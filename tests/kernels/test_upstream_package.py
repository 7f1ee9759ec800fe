"""kernels/upstream/: the evidence package for proposing bistat's H200 table to vLLM.

The package regenerates byte for byte from the raw files sources.toml lists; its table parses back
in vLLM's format and matches the table the plugin ships; every bucket names a run with full
provenance; the device script's ``vllm bench`` flags exist in vLLM 0.34.0; the determinism listing
is vLLM 0.34.0's suite test for test; and the build refuses device folders that are missing,
incomplete, from two GPUs or contradicted by their own logs. The wheel and sdist checks run where
BISTAT_VLLM_WHEELS and BISTAT_VLLM_SDISTS name folders holding them (tests/external.py).
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import json
import re
import sys
import tarfile
import types
import zipfile
from pathlib import Path

import pytest
from external import vllm_sdist, vllm_wheel

from bistat_kernels import export_vllm, tables

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
UPSTREAM = ROOT / "kernels/upstream"


def _module(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module   # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


build = _module("upstream_build", UPSTREAM / "build.py")
device = _module("upstream_bench", ROOT / "scripts/device/upstream_bench.py")
kernel_ab = _module("upstream_kernel_ab", ROOT / "kernels/device/upstream_kernel_ab.py")
SOURCES = tomllib.loads((UPSTREAM / "sources.toml").read_text())
TABLE = tables.load_table(ROOT / SOURCES["table"])
TABLE_PY = (ROOT / build.TABLE_OUT).read_text()
PROVENANCE = json.loads((ROOT / build.PROVENANCE_OUT).read_text())
DETERMINISM = json.loads((ROOT / SOURCES["determinism"]["raw"]).read_text())


def test_the_committed_package_regenerates_byte_for_byte():
    files = build.build(ROOT)
    assert sorted(files) == sorted([build.TABLE_OUT, build.PROVENANCE_OUT, build.README_OUT])
    for rel, text in files.items():
        assert (ROOT / rel).read_text(encoding="utf-8") == text, rel
    assert build.main(["--check"]) == 0


def test_the_readme_states_the_probe_and_bench_numbers_of_their_files():
    readme = (ROOT / build.README_OUT).read_text()
    probe = json.loads((ROOT / SOURCES["probe"]["raw"]).read_text())
    table = [s for s in probe["shapes"] if s["case"] == "table"]
    assert probe["passed"] and len(table) == len(TABLE.entries) == 15
    rows = sum(s["invariance"]["rows_checked"] for s in table)
    assert sum(s["invariance"]["rows_equal"] for s in table) == rows
    assert f"| `table bfloat16` | 15 | 25 from 1 to 4096 | {rows} of {rows} | 60 of 60 |" in readme
    for bench in SOURCES["benches"]:
        summary = json.loads((ROOT / bench["raw"]).read_text())["summary"]
        assert (f"| {bench['name']} | {summary['geomean_tuned_over_mm']:.4f} | "
                f"{summary['decode_geomean_tuned_over_mm']:.4f} |") in readme
    main = json.loads((ROOT / SOURCES["benches"][0]["raw"]).read_text())["rows"]
    qkv = {r["m"]: r["tuned_over_mm"] for r in main if (r["n"], r["k"]) == (6144, 4096)}
    assert ("| qwen3-8b/qkv | (6144, 4096) | yes | "
            + " | ".join(f"{qkv[m]:.3f}" for m in (1, 4, 16, 64, 256, 1024, 4096)) + " |") in readme


def test_the_table_parses_back_and_is_the_shipped_tables_single_chain_shapes():
    parsed = export_vllm.parse_vllm_source(TABLE_PY)
    assert list(parsed) == ["hopper"]
    single = {(e.n, e.k): e for e in TABLE.entries.values()
              if e.dtype == "bfloat16" and e.split_k == 1}
    split = sorted((e.n, e.k) for e in TABLE.entries.values() if e.split_k > 1)
    assert sorted(parsed["hopper"]) == sorted(single) and len(single) == 12
    assert split == [(576, 1536), (2048, 6144), (4096, 12288)]   # the three down projections
    export = export_vllm.export_table(TABLE)
    for shape in export.shapes:
        block_k, buckets = parsed["hopper"][(shape.n, shape.k)]
        entry = single[(shape.n, shape.k)]
        assert block_k == entry.block_k
        assert [m for m, _ in buckets] == [b.m_max for b in entry.buckets]
        assert [cfg for _, cfg in buckets] == [(b.block_m, b.block_n, b.num_warps, b.num_stages)
                                               for b in shape.buckets]
    # where the exported launch is the shipped bucket's own (no other BLOCK_K), it is that launch
    b = single[(6144, 4096)].buckets[0]
    assert parsed["hopper"][(6144, 4096)][1][0] == (b.m_max, (b.block_m, b.block_n, b.num_warps,
                                                              b.num_stages))
    for n, k in split:
        assert f"#   ({n}, {k}) " in TABLE_PY and f"        ({n}, {k}):" not in TABLE_PY


def test_every_bucket_names_a_run_with_its_full_provenance():
    runs = PROVENANCE["runs"]
    assert sorted(runs) == sorted(SOURCES["runs"])
    for tag, run in runs.items():
        p = run["provenance"]
        assert p["gpu_name"] == "NVIDIA H200" and re.fullmatch(r"GPU-[0-9a-f-]{36}", p["gpu_uuid"])
        assert p["gpu_serial"].isdigit() and p["driver"] and p["torch"] and p["triton"]
        assert p["date_utc"].endswith("Z") and p["command"].startswith("kernels/device/gpu_call.py")
        assert run["raw_sha256"] == hashlib.sha256((ROOT / run["raw"]).read_bytes()).hexdigest()
        assert f"#   [{tag}] " in TABLE_PY and f"#       raw: {run['raw']}" in TABLE_PY
        assert p["gpu_uuid"] in TABLE_PY and f"command: {p['command']}" in TABLE_PY
    assert len(PROVENANCE["entries"]) == 12
    counted = {}
    for e in PROVENANCE["entries"]:
        entry = TABLE.lookup("bfloat16", e["n"], e["k"])
        assert [b["measured"] for b in e["buckets"]] == [b.measured for b in entry.buckets]
        for b, shipped in zip(e["buckets"], entry.buckets):
            run = runs[b["run"]]["provenance"]
            source = shipped.measured.get("source")
            if source:   # a re-tuned bucket: its raw file's run, which the table itself names
                assert runs[b["run"]]["raw"] == source.split()[0]
                assert shipped.measured["retuned_on"]["gpu_uuid"] == run["gpu_uuid"]
            else:        # set by the sweep: the entry's provenance is the sweep run's
                assert entry.provenance["gpu_uuid"] == run["gpu_uuid"]
                assert entry.provenance["command"] == run["command"]
            counted[b["run"]] = counted.get(b["run"], 0) + 1
            assert b["ratio_to_torch_mm"] == pytest.approx(
                shipped.measured["time_ms"] / shipped.measured["torch_mm_ms"])
    # k12-after re-tuned only the split-K shapes, which are not exported; the legend says so
    assert sum(counted.values()) == 132 and set(counted) == set(runs) - {"k12-after"}
    assert "#   [k12-after] re-tune of the split-K shapes' buckets from M = 256 up, with the " \
           "flat fused split-K form (only shapes not exported here)" in TABLE_PY
    # in the file: one comment per bucket, each opening with its run's tag
    tagged = re.findall(r"_MatmulMConfig\([^)]*\)\),  # \[([\w-]+)\] ", TABLE_PY)
    assert len(tagged) == 132 and set(tagged) == set(counted)


def _wheel() -> zipfile.ZipFile:
    return zipfile.ZipFile(vllm_wheel("0.34.0"))


def test_the_format_is_the_wheels_and_vllms_loader_reads_the_merged_table(monkeypatch):
    """The recorded sha256s are the 0.34.0 wheel's files, and vLLM's own loader, with the package's
    entries merged over its Hopper dict (kernels/device/upstream_kernel_ab.py's merge), serves our
    launches for the exported shapes and its own for the rest."""
    torch = pytest.importorskip("torch")
    with _wheel() as wheel:
        for name, key in (("batch_invariant_configs.py", "configs_sha256"),
                          ("batch_invariant.py", "kernel_sha256")):
            data = wheel.read(f"vllm/model_executor/determinism/{name}")
            assert hashlib.sha256(data).hexdigest() == SOURCES["vllm"][key]
    from test_export_vllm import _load_vllm_configs_module

    configs = _load_vllm_configs_module(monkeypatch, "0.34.0")
    own = {f: dict(s) for f, s in configs._BATCH_INVARIANT_MATMUL_TUNED_CONFIGS.items()}
    exported = kernel_ab.load_export(TABLE_PY, configs)
    arms = kernel_ab.merged_tables(own, exported)
    parsed = export_vllm.parse_vllm_source(TABLE_PY)["hopper"]
    default = {"BLOCK_SIZE_M": 128, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 8,
               "num_stages": 3, "num_warps": 8}
    for n, k in [(6144, 4096), (2048, 2048), (576, 576), (2048, 6144)]:
        for m in (1, 5, 300, 10000):
            kernel_ab.use_table(configs, arms["bistat-entries"])
            ours = configs._get_matmul_config(m, n, k, torch.bfloat16, default)
            kernel_ab.use_table(configs, arms["vllm-table"])
            theirs = configs._get_matmul_config(m, n, k, torch.bfloat16, default)
            if (n, k) in parsed:
                block_k, buckets = parsed[(n, k)]
                bm, bn, nw, ns = next((c for mm, c in buckets if mm >= m), buckets[-1][1])
                assert ours == {"BLOCK_SIZE_M": bm, "BLOCK_SIZE_N": bn, "BLOCK_SIZE_K": block_k,
                                "GROUP_SIZE_M": 8, "num_warps": nw, "num_stages": ns}, (n, k, m)
            else:   # a split-K shape: not exported, vLLM's own entry stays
                assert ours == theirs
            if (n, k) not in own["hopper"]:
                assert theirs == default   # SmolLM2's o: vLLM's fixed launch without us
    assert PROVENANCE["vllm"]["version"] == "0.34.0"


def _option_strings(source: str) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            out |= {a.value for a in node.args
                    if isinstance(a, ast.Constant) and str(a.value).startswith("-")}
    return out


def test_the_device_scripts_vllm_bench_arguments_exist_in_vllm_0_34_0():
    with _wheel() as wheel:
        read = lambda rel: wheel.read(rel).decode()  # noqa: E731
        engine = _option_strings(read("vllm/engine/arg_utils.py"))
        known = {
            "latency": _option_strings(read("vllm/benchmarks/latency.py")) | engine,
            "throughput": (_option_strings(read("vllm/benchmarks/throughput.py"))
                           | _option_strings(read("vllm/benchmarks/datasets/datasets.py"))
                           | engine)}
        for bench in ("latency", "throughput"):
            cli = read(f"vllm/entrypoints/cli/benchmark/{bench}.py")
            assert f'name = "{bench}"' in cli
        main = read("vllm/entrypoints/cli/main.py")
        assert 'if __name__ == "__main__":' in main   # `python3 -m vllm.entrypoints.cli.main`
    assert device.LATENCY[:2] == ("bench", "latency")
    assert device.THROUGHPUT[:2] == ("bench", "throughput")
    for bench, args in device.BENCHES.items():
        flags = [a for a in args[2:] if a.startswith("--")] + ["--output-json"]
        missing = [f for f in flags if f not in known[bench]]
        assert not missing, (bench, missing)
    # a misspelt flag would be caught
    assert "--num-iter" not in known["latency"] and "--num-iters" in known["latency"]


def test_the_arms_alternate_and_the_commands_read_as_typed():
    assert device.arm_order(["a", "b"], 1) == [(1, "a"), (1, "b")]
    assert device.arm_order(["a", "b"], 3) == [(1, "a"), (1, "b"), (2, "b"), (2, "a"),
                                               (3, "a"), (3, "b")]
    argv = device.bench_argv("latency", "/o/latency-x.json")
    assert argv[:3] == ["python3", "-m", "vllm.entrypoints.cli.main"]
    assert device.shown(argv).startswith("vllm bench latency --model /tmp/model/qwen3-8b-config ")
    assert device.shown(argv).endswith(" --output-json /o/latency-x.json")
    assert device.ARMS["vllm-table"]["BISTAT_TUNED_GEMM"] == "0"
    assert {a["VLLM_BATCH_INVARIANT"] for a in device.ARMS.values()} == {"1"}
    gpu = device.parse_gpu_csv("0, NVIDIA H200, GPU-1, 165, 580.1, 00000000:18:00.0, 143771 MiB, "
                               "1980 MHz, 700.00 W\n")
    assert gpu == [dict(zip(device.GPU_FIELDS, ["0", "NVIDIA H200", "GPU-1", "165", "580.1",
                                                "00000000:18:00.0", "143771 MiB", "1980 MHz",
                                                "700.00 W"]))]
    with pytest.raises(device.DeviceScriptError, match="expected 9 fields"):
        device.parse_gpu_csv("0, NVIDIA H200\n")


def test_the_determinism_listing_agrees_with_the_device_selection():
    tests = DETERMINISM["tests"]
    assert {t["on_lent_h200"] for t in tests} <= set(build.STATUSES)
    selected_files = {t["file"] for t in tests if t["selected"]}
    assert selected_files == {name for name, _ in device.DETERMINISM}
    whole = {name for name, select in device.DETERMINISM if select is None}
    for t in tests:
        if t["file"] in whole:
            assert t["selected"], t["test"]   # a file run without -k runs every test
        if t["on_lent_h200"] == "cannot":
            assert not t["selected"] and "hub" in t["why"]
    # the end-to-end selection: the six tests with a backend parameter, at FLASH_ATTN; the two
    # whose model is fixed to a hub checkpoint have none, so the -k leaves them out
    e2e = [k for name, k in device.DETERMINISM if name == "test_batch_invariance.py"]
    chosen = [t for t in tests if t["file"] == "test_batch_invariance.py" and t["selected"]]
    assert sorted(k.split(" and ")[0] for k in e2e) == sorted(t["test"] for t in chosen)
    assert all(k.endswith(" and FLASH_ATTN and not vllm_c and not 8-16") for k in e2e)
    assert len(chosen) == 6 and {t["on_lent_h200"] for t in chosen} == {"runs-local-model"}
    assert device.TEST_MODEL == "/tmp/model/smollm2"


def _sdist() -> tarfile.TarFile:
    sdist = vllm_sdist("0.34.0")     # its URL: DETERMINISM["source"]["url"]
    assert hashlib.sha256(sdist.read_bytes()).hexdigest() == DETERMINISM["source"]["sha256"]
    return tarfile.open(sdist)


def test_the_listing_is_vllm_0_34_0s_suite_test_for_test():
    src = DETERMINISM["source"]
    with _sdist() as sdist:
        prefix = src["folder"] + "/"
        files = {m.name[len(prefix):]: sdist.extractfile(m).read() for m in sdist
                 if m.isfile() and m.name.startswith(prefix) and "/" not in m.name[len(prefix):]}
    assert {f: hashlib.sha256(b).hexdigest() for f, b in files.items()} == src["files_sha256"]
    listed: dict[str, list[str]] = {}
    for t in DETERMINISM["tests"]:
        listed.setdefault(t["file"], []).append(t["test"])
    in_sdist = {f: [n.name for n in ast.parse(b).body
                    if isinstance(n, ast.FunctionDef) and n.name.startswith("test")]
                for f, b in sorted(files.items()) if f.startswith("test_")}
    assert listed == in_sdist


def test_pack_tests_keeps_the_sdists_tests_only_and_checks_what_travels(tmp_path):
    """On a small stand-in with the sdist's layout (the real one takes half a minute to pack): only
    tests/ goes into the archive, SHA256SUMS is its digest, and the device side unpacks what the
    digest allows, refusing an archive changed after packing."""
    sdist = tmp_path / "vllm-0.34.0.tar.gz"
    with tarfile.open(sdist, "w:gz") as tf:
        for name, data in (("vllm-0.34.0/tests/conftest.py", b"# conftest\n"),
                           ("vllm-0.34.0/tests/v1/determinism/utils.py", b"X = 1\n"),
                           ("vllm-0.34.0/vllm/__init__.py", b"# vLLM itself stays out\n")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, __import__("io").BytesIO(data))
    digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
    out = device.pack_tests(sdist, tmp_path / "packed", wheels=False, recorded=digest)
    assert [p.name for p in out] == ["vllm034-tests.tar.xz", "SHA256SUMS"]
    with tarfile.open(out[0]) as tf:
        assert tf.getnames() == ["vllm-0.34.0/tests/conftest.py",
                                 "vllm-0.34.0/tests/v1/determinism/utils.py"]
    assert out[1].read_text() == (f"{hashlib.sha256(out[0].read_bytes()).hexdigest()}  "
                                  f"vllm034-tests.tar.xz\n")
    out[0].write_bytes(out[0].read_bytes() + b"\0")
    with pytest.raises(device.DeviceScriptError, match="sha256 differs from .*; pack it again"):
        device.unpack_tests(tmp_path / "packed")
    with pytest.raises(device.DeviceScriptError, match="did not travel: run `python"):
        device.unpack_tests(tmp_path / "elsewhere")


def test_pack_tests_refuses_another_sdist(tmp_path):
    other = tmp_path / "vllm-0.34.0.tar.gz"
    other.write_bytes(b"not the sdist")
    with pytest.raises(device.DeviceScriptError, match="is not the one .* was read from"):
        device.pack_tests(other, tmp_path / "out", wheels=False)
    with pytest.raises(device.DeviceScriptError, match="not found: `pip download`"):
        device.pack_tests(tmp_path / "absent.tar.gz", tmp_path / "out", wheels=False)


# ---- device folders: what the build accepts and refuses (synthetic folders, tests only) --------

def _gpu(uuid: str = "GPU-aaaa", serial: str = "1") -> list[dict[str, str]]:
    return [dict(zip(device.GPU_FIELDS, ["0", "NVIDIA H200", uuid, serial, "580.1", "0:18:00.0",
                                         "143771 MiB", "1980 MHz", "700.00 W"]))]


def _run(step: str, arm: str, stem: str, uuid: str = "GPU-aaaa", plugin: bool | None = None):
    installed = arm == "bistat-table" if plugin is None else plugin
    lines = (["bistat_kernels: tuned GEMM installed as vllm.model_executor.determinism."
              "batch_invariant.matmul_persistent (pid 7)"] if installed else [])
    return {"step": step, "arm": arm, "argv": ["python3"], "env": device.ARMS[arm],
            "log": f"{stem}.log", "files": [f"{stem}.json"], "status": "ok", "returncode": 0,
            "start_utc": "2026-12-05T10:00:00Z", "gpu_before": _gpu(uuid), "gpu_after": _gpu(uuid),
            "plugin_lines": lines}


def _folder(tmp_path: Path, name: str, runs: list[dict], uuid: str = "GPU-aaaa",
            results: dict[str, dict] | None = None) -> str:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "manifest.json").write_text(json.dumps({
        "schema": device.SCHEMA, "gpu": _gpu(uuid), "runs": runs,
        "versions": {"vllm": "0.34.0", "vllm_commit": "g62d4bc3c7", "torch": "2.14.0",
                     "triton": "3.8.0", "bistat_commit": "abc clean"}}))
    for run in runs:
        stem = run["log"][:-4]
        (folder / run["log"]).write_text("\n".join(run["plugin_lines"]) + "\nThroughput: 50.00 "
                                         "requests/s, 6600.00 total tokens/s, 5000.00 output "
                                         "tokens/s\n")
        (folder / f"{stem}.json").write_text(json.dumps((results or {})[stem]))
    return str(folder)


LATENCY = {"latency-vllm-table": {"avg_latency": 2.0, "latencies": [2.0] * 30,
                                  "percentiles": {"50": 2.0, "90": 2.1}},
           "latency-bistat-table": {"avg_latency": 1.5, "latencies": [1.5] * 30,
                                    "percentiles": {"50": 1.5, "90": 1.6}}}


def test_a_complete_device_folder_fills_the_bench_section(tmp_path):
    runs = [_run("latency", "vllm-table", "latency-vllm-table"),
            _run("latency", "bistat-table", "latency-bistat-table")]
    folder = _folder(tmp_path, "call1", runs, results=LATENCY)
    # a second call of the same session: kernel-ab and one determinism run per arm
    ab_rows = [{"m": 1, "torch_mm_ms": 1.0, "vllm-table_ms": 1.2, "bistat-entries_ms": 1.0,
                "invariant": {"vllm-table": True, "bistat-entries": True}}]
    ab = dict(_run("kernel-ab", "vllm-table", "kernel-ab"), arm=None, files=["kernel_ab.json"])
    det = [dict(_run("determinism", arm, f"determinism-{arm}-0"), files=[f"d-{arm}.xml"],
                argv=["python3", "-m", "pytest", "-p", "pytest_bistat_table", "-rA", "-q",
                      "--junitxml=/x.xml", "tests/v1/determinism/test_matmul_batch_invariant.py"])
           for arm in ("vllm-table", "bistat-table")]
    second = tmp_path / "call2"
    second.mkdir()
    (second / "manifest.json").write_text(json.dumps({"schema": device.SCHEMA, "gpu": _gpu(),
                                                      "runs": [ab, *det]}))
    for run in (ab, *det):
        (second / run["log"]).write_text("\n".join(run["plugin_lines"]))
    (second / "kernel_ab.json").write_text(json.dumps({"schema": kernel_ab.SCHEMA, "rows": ab_rows,
                                                       "summary": kernel_ab.summarise(ab_rows)}))
    for arm, failed in (("vllm-table", 0), ("bistat-table", 1)):
        cases = "".join(f'<testcase name="t{i}">{"<failure/>" if i < failed else ""}</testcase>'
                        for i in range(3)) + '<testcase name="s"><skipped/></testcase>'
        (second / f"d-{arm}.xml").write_text(f"<testsuites><testsuite>{cases}</testsuite>"
                                             f"</testsuites>")
    readme = build.build(ROOT, device_folders=[folder, str(second)])[build.README_OUT]
    assert "| 1 | 1.200 | 1.000 | 0.833 | 0.833 | vllm-table: True, bistat-entries: True |" \
        in readme
    assert "| bistat-table | `test_matmul_batch_invariant.py` | 2 | 1 | 0 | 1 |" in readme
    assert "| vllm-table | `test_matmul_batch_invariant.py` | 3 | 0 | 0 | 1 |" in readme
    assert "**Pending GPU run.**" not in readme
    assert "Node: NVIDIA H200 GPU-aaaa (serial 1)" in readme
    assert "bistat-table / vllm-table, avg_s: 0.7500." in readme
    assert "| bistat-table | 1.5000 | 1.5000 | 1.6000 |" in readme
    assert "`throughput`: pending (no run in the listed folders)." in readme
    assert "`vllm bench latency` and `vllm bench throughput` before/after" in readme  # pending
    committed = (ROOT / build.README_OUT).read_text()
    assert "**Pending GPU measurement.**" in committed and "0.7500" not in committed


@pytest.mark.parametrize("case, message", [
    ("missing", r"has no manifest.json \(the folder is missing"),
    ("file", r"names latency-vllm-table.json, which is not in"),
    ("two-gpus", r"ran on 2 GPUs \(GPU-aaaa, GPU-bbbb\).*needs one node"),
    ("no-plugin", r"the bistat-table arm's log has no 'tuned GEMM installed' line"),
    ("plugin-in-baseline", r"the vllm-table arm's log shows bistat's plugin installed"),
    ("one-arm", r"latency has only the vllm-table arm"),
])
def test_the_build_refuses_device_folders_it_cannot_stand_on(tmp_path, case, message):
    a = _run("latency", "vllm-table", "latency-vllm-table")
    b = _run("latency", "bistat-table", "latency-bistat-table")
    if case == "missing":
        folders = [str(tmp_path / "never-copied")]
    elif case == "file":
        folders = [_folder(tmp_path, "c", [a, b], results=LATENCY)]
        (tmp_path / "c" / "latency-vllm-table.json").unlink()
    elif case == "two-gpus":
        folders = [_folder(tmp_path, "c1", [a], results=LATENCY),
                   _folder(tmp_path, "c2", [_run("latency", "bistat-table", "latency-bistat-table",
                                                 uuid="GPU-bbbb")], uuid="GPU-bbbb",
                           results=LATENCY)]
    elif case == "no-plugin":
        folders = [_folder(tmp_path, "c", [a, _run("latency", "bistat-table",
                                                   "latency-bistat-table", plugin=False)],
                           results=LATENCY)]
    elif case == "plugin-in-baseline":
        folders = [_folder(tmp_path, "c", [_run("latency", "vllm-table", "latency-vllm-table",
                                                plugin=True), b], results=LATENCY)]
    else:
        folders = [_folder(tmp_path, "c", [a], results=LATENCY)]
    with pytest.raises(build.PackageError, match=message):
        build.build(ROOT, device_folders=folders)


def _sources_with(tmp_path: Path, edit) -> Path:
    text = edit((UPSTREAM / "sources.toml").read_text())
    path = tmp_path / "sources.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.replace('folders = []', 'folders = ["kernels/upstream/raw/device/none"]'),
     r"sources.toml \[device\] folders: 'kernels/upstream/raw/device/none' has no manifest"),
    (lambda t: re.sub(r'\[runs\.k11\]\nraw = "[^"]+"\nwhat = "[^"]+"\n', "", t),
     r"measured.source names kernels/results/k11/retune_raw_nvidia_h200.json, which no "
     r"\[runs.\*\] raw"),
    (lambda t: t.replace('table_sha256 = "3febfc', 'table_sha256 = "0000fc', 1),
     r"\[\[benches\]\] 'k12 main' ran the table with sha256 0000fc.*bench and probe the shipped "
     r"table"),
    (lambda t: t.replace('name = "k12 probe"\nraw = "kernels/results/probe_nvidia_h200.json"\n'
                         'table_sha256 = "3febfc', 'name = "k12 probe"\nraw = '
                         '"kernels/results/probe_nvidia_h200.json"\ntable_sha256 = "1111fc'),
     r"\[probe\] 'k12 probe' ran the table with sha256 1111fc"),
    (lambda t: t.replace('raw = "kernels/results/k9/', 'raw = "kernels/results/k10/'),
     r"vLLM's batch_invariant_configs.py had sha256 None, not \[vllm\] configs_sha256"),
    (lambda t: t.replace('version = "0.34.0"\n', ''), r"field vllm.version: Field required"),
])
def test_the_build_names_the_field_and_the_fix(tmp_path, edit, message):
    with pytest.raises(build.PackageError, match=message):
        build.build(ROOT, sources_path=_sources_with(tmp_path, edit))


def test_the_cli_reports_errors_without_a_traceback(tmp_path, capsys):
    assert build.main(["--device", str(tmp_path / "absent")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("Error: --device: ") and "Traceback" not in err


def test_kernel_ab_summary_and_merge_are_what_they_say():
    rows = [{"m": 1, "torch_mm_ms": 1.0, "vllm-table_ms": 2.0, "bistat-entries_ms": 1.0,
             "invariant": {"vllm-table": True, "bistat-entries": True}},
            {"m": 64, "torch_mm_ms": 1.0, "vllm-table_ms": 1.0, "bistat-entries_ms": 1.0,
             "invariant": {"vllm-table": True, "bistat-entries": False}}]
    s = kernel_ab.summarise(rows)
    assert s["all"]["vllm_table_over_mm"] == pytest.approx(2 ** 0.5)
    assert s["all"]["bistat_entries_over_vllm_table"] == pytest.approx(2 ** -0.5)
    assert s["decode"]["bistat_entries_over_vllm_table"] == pytest.approx(0.5)
    assert s["invariant"] == {"vllm-table": True, "bistat-entries": False}
    own = {"hopper": {(1, 2): "theirs", (3, 4): "theirs"}, "ada": {(1, 2): "ada"}}
    arms = kernel_ab.merged_tables(own, {"hopper": {(1, 2): "ours", (5, 6): "ours"}})
    assert arms["vllm-table"] == own
    assert arms["bistat-entries"] == {"hopper": {(1, 2): "ours", (3, 4): "theirs",
                                                 (5, 6): "ours"}, "ada": {(1, 2): "ada"}}


def test_the_pytest_plugin_installs_bistats_gemm_or_refuses(monkeypatch):
    plugin = _module("pytest_bistat_table", UPSTREAM / "pytest_bistat_table.py")
    from bistat_kernels import vllm_plugin

    monkeypatch.delenv("BISTAT_TUNED_GEMM", raising=False)
    plugin.pytest_configure(None)
    assert plugin.pytest_report_header(None).startswith("bistat tuned GEMM: off")
    target = vllm_plugin.TARGET_MODULES[0]
    hooked = types.ModuleType(target)
    plugins = types.ModuleType("vllm.plugins")
    plugins.load_general_plugins = lambda: None           # a vLLM that never loads bistat's
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.plugins", plugins)
    monkeypatch.setenv("BISTAT_TUNED_GEMM", "1")
    with pytest.raises(pytest.UsageError, match="did not install bistat's tuned GEMM"):
        plugin.pytest_configure(None)

    def load() -> None:                                    # one that does (the entry point's work)
        hooked._bistat_tuned_gemm = True
        monkeypatch.setitem(sys.modules, target, hooked)

    plugins.load_general_plugins = load
    plugin.pytest_configure(None)
    assert plugin.pytest_report_header(None) == (
        f"bistat tuned GEMM: installed as {target}.matmul_persistent (bistat_kernels.vllm_plugin)")


def test_the_device_scripts_own_folder_is_what_the_build_ingests(tmp_path, monkeypatch):
    """``upstream_bench.py run --steps latency,throughput`` on the CPU with stand-ins for
    nvidia-smi and for ``vllm bench`` (writing vLLM's output-json keys, and the plugin's log line
    when BISTAT_TUNED_GEMM=1): its folder goes through the build as a GPU session's would."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho '0, NVIDIA H200, GPU-cafe, 42, 580.1, 0:18:00.0, 143771 MiB, "
                   "1980 MHz, 700.00 W'\n")
    smi.chmod(0o755)
    fake = tmp_path / "fake_vllm.py"
    fake.write_text(
        "import json, os, sys\n"
        "args = sys.argv[1:]\n"
        "out = args[args.index('--output-json') + 1]\n"
        "tuned = os.environ.get('BISTAT_TUNED_GEMM') == '1'\n"
        "if tuned:\n"
        "    print('WARNING bistat_kernels: tuned GEMM installed as vllm.model_executor.'"
        "'determinism.batch_invariant.matmul_persistent (pid 1)')\n"
        "t = 1.2 if tuned else 1.6\n"
        "if args[1] == 'latency':\n"
        "    data = {'avg_latency': t, 'latencies': [t] * 30, 'percentiles': {'50': t, '90': t}}\n"
        "else:\n"
        "    data = {'elapsed_time': 10 * t, 'num_requests': 1000, 'total_num_tokens': 132000,\n"
        "            'requests_per_second': 100 / t, 'tokens_per_second': 13200 / t}\n"
        "    print(f'Throughput: {100 / t:.2f} requests/s, {13200 / t:.2f} total tokens/s, '\n"
        "          f'{10000 / t:.2f} output tokens/s')\n"
        "json.dump(data, open(out, 'w'))\n")
    monkeypatch.setenv("PATH", f"{bin_dir}:{__import__('os').environ['PATH']}")
    monkeypatch.setattr(device, "VLLM_CLI", (sys.executable, str(fake)))
    monkeypatch.setattr(device, "versions", lambda: {"vllm": "0.34.0", "torch": "2.14.0",
                                                     "plugin_entry_point": "x:register"})
    out = tmp_path / "call1"
    assert device.main(["run", "--out", str(out), "--steps", "latency,throughput",
                        "--budget-s", "600"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert [(r["step"], r["arm"], r["status"]) for r in manifest["runs"]] == [
        ("latency", "vllm-table", "ok"), ("latency", "bistat-table", "ok"),
        ("throughput", "vllm-table", "ok"), ("throughput", "bistat-table", "ok")]
    assert manifest["runs"][1]["env"] == {"VLLM_BATCH_INVARIANT": "1", "BISTAT_TUNED_GEMM": "1"}
    assert manifest["runs"][0]["gpu_before"][0]["serial"] == "42"
    readme = build.build(ROOT, device_folders=[str(out)])[build.README_OUT]
    assert "Node: NVIDIA H200 GPU-cafe (serial 42)" in readme
    assert "bistat-table / vllm-table, avg_s: 0.7500." in readme
    assert "bistat-table / vllm-table, requests_per_s: 1.3333." in readme
    assert "| bistat-table | 83.3333 | 11000.0000 | 8333.3300 |" in readme
    # the budget: a run that would not fit is skipped and recorded, not started
    assert device.main(["run", "--out", str(tmp_path / "call2"), "--steps", "latency",
                        "--budget-s", "60"]) == 0
    skipped = json.loads((tmp_path / "call2" / "manifest.json").read_text())["runs"]
    assert [r["status"] for r in skipped] == ["skipped", "skipped"]
    assert "60 s left of --budget-s, 170 s expected" in skipped[0]["why"]
