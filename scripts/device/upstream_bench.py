#!/usr/bin/env python3
"""The device side of kernels/upstream/: vLLM's own benchmarks and tests on one H200, with vLLM's
tuned GEMM table and with bistat's, one after the other on the same node.

Two arms, the same vLLM 0.34.0 payload (scripts/device/env.sh, ``VLLM_PAYLOAD=latest``):

``vllm-table``
    ``VLLM_BATCH_INVARIANT=1``, ``BISTAT_TUNED_GEMM=0``: vLLM's persistent GEMM with its own
    tuned table (``batch_invariant_configs.py``);
``bistat-table``
    ``VLLM_BATCH_INVARIANT=1``, ``BISTAT_TUNED_GEMM=1``: the bistat plugin (installed into the
    site by prepare.sh, loaded by vLLM from its ``vllm.general_plugins`` entry point) routes that
    GEMM through bistat's kernel and table (``kernels/bistat_kernels/tables/nvidia_h200.json``).

Steps, in this order (``--steps`` picks; each call of the device tool may run a few):

``gpu``          (always, first) the node: ``nvidia-smi`` identity (name, UUID, serial, driver,
                 bus id, clocks, power limit), versions (python, torch, triton, vLLM, pytest),
                 the bistat commit that travelled, the table's sha256, the plugin's entry point;
``kernel-ab``    ``kernels/device/upstream_kernel_ab.py``: vLLM's own kernel with its table and with
                 the exported entries merged in, beside torch.mm (what a change to vLLM's table
                 would do, without the plugin);
``latency``      ``vllm bench latency`` per arm (:data:`LATENCY`);
``throughput``   ``vllm bench throughput`` per arm (:data:`THROUGHPUT`);
``determinism``  vLLM 0.34.0's own ``tests/v1/determinism`` (:data:`DETERMINISM`, carried as
                 ``.dev/upstream/vllm034-tests.tar.xz``, see ``pack-tests``) per arm, kernel-level
                 tests through ``pytest -p pytest_bistat_table`` (kernels/upstream/).

Every run writes its raw stdout and stderr (``<step>-<arm>[-<round>].log``) and vLLM's own
``--output-json`` where it has one, and records in ``manifest.json`` (rewritten after every run):
the argv, the environment it added, start and end (UTC), wall time, return code, and the GPU's
UUID and serial read by ``nvidia-smi`` right before and right after it. ``--rounds 2`` runs each
step's arms A, B, then B, A. ``--budget-s`` skips (and records as skipped) a run that would not fit
in what is left of the call. ``kernels/upstream/build.py`` ingests the folders listed in
``kernels/upstream/sources.toml`` (``[device] folders``) and refuses folders from different GPUs.

Usage on the H200, after install.sh and prepare.sh (``SKIP_SYNTH=1`` is enough), from the
repository root::

    . scripts/device/env.sh && python3 scripts/device/upstream_bench.py run --out "$OUT" \\
        --steps gpu,kernel-ab --budget-s 540

Here, before a session that runs ``determinism`` (writes ``.dev/upstream/``, carried by that call)::

    python scripts/device/upstream_bench.py pack-tests --sdist vllm-0.34.0.tar.gz

``python scripts/device/upstream_bench.py commands`` prints the command lines (the package's
README quotes them from here).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

SCHEMA = "bistat_kernels.upstream_device/1"
REPO = Path(__file__).resolve().parents[2]
DETERMINISM_RAW = REPO / "kernels/upstream/raw/vllm034_determinism_tests.json"
EXPORT = REPO / "kernels/upstream/batch_invariant_configs_nvidia_h200.py"
TABLE = REPO / "kernels/bistat_kernels/tables/nvidia_h200.json"
PACKED = REPO / ".dev/upstream"
TESTS_TAR = "vllm034-tests.tar.xz"
TESTS_ROOT = "vllm-0.34.0"                # the sdist's top folder; tests/ under it
TESTS_DIR = Path("/tmp/upstream-vllm-tests")
TEST_DEPS = Path("/tmp/upstream-testdeps")
# vLLM's tests/conftest.py imports tblib (vLLM's test requirements pin 3.1.0); nothing else the
# selected tests import is missing from the payload (openai, transformers, PIL are carried)
TEST_WHEELS = ("tblib==3.1.0",)

# prepare.sh writes the Qwen3-8B configuration (36 layers, no weights: load_format dummy); vLLM's
# own Hopper table has its five shapes, so both arms run tuned tables. The config folder has no
# tokenizer: the latency bench sends token ids (--skip-tokenizer-init), the throughput bench needs
# a tokenizer to make its random prompts and takes SmolLM2's (install.sh; its ids are < 49152,
# inside Qwen3's vocabulary; outputs are not detokenized).
MODEL = "/tmp/model/qwen3-8b-config"
TOKENIZER = "/tmp/model/smollm2"
TEST_MODEL = "/tmp/model/smollm2"          # VLLM_TEST_MODEL for the determinism tests
VLLM_CLI = ("python3", "-m", "vllm.entrypoints.cli.main")   # the `vllm` console script's main

ARMS: dict[str, dict[str, str]] = {
    "vllm-table": {"VLLM_BATCH_INVARIANT": "1", "BISTAT_TUNED_GEMM": "0"},
    "bistat-table": {"VLLM_BATCH_INVARIANT": "1", "BISTAT_TUNED_GEMM": "1"},
}

ENGINE = ("--model", MODEL, "--load-format", "dummy", "--dtype", "bfloat16",
          "--max-model-len", "512", "--gpu-memory-utilization", "0.85", "--seed", "0")
#: ``vllm bench latency``: one batch of 8 x (128 prompt + 128 output) tokens, the workload of
#: the batch-8 latency studies; 5 warm-up and 30 timed iterations
LATENCY = ("bench", "latency", *ENGINE, "--skip-tokenizer-init", "--disable-detokenize",
           "--input-len", "128", "--output-len", "128", "--batch-size", "8",
           "--num-iters-warmup", "5", "--num-iters", "30")
#: ``vllm bench throughput``: 1000 random prompts of 32 tokens, 100 output tokens each (workload
#: (i)'s size, offline engine)
THROUGHPUT = ("bench", "throughput", *ENGINE, "--tokenizer", TOKENIZER, "--disable-detokenize",
              "--dataset-name", "random", "--random-input-len", "32", "--random-output-len", "100",
              "--num-prompts", "1000")
BENCHES: dict[str, tuple[str, ...]] = {"latency": LATENCY, "throughput": THROUGHPUT}

#: vLLM's tests run per arm, one pytest per entry (file under tests/v1/determinism, -k
#: expression or None): the two kernel-level files whole, then the end-to-end tests one at a time
#: (each starts its own engine: one per pytest keeps a run inside a device call and lets
#: --budget-s skip what does not fit) at one backend (FLASH_ATTN), the default RMSNorm
#: implementation and the first block size: six engine starts instead of 27. These are the raw
#: listing's ``selected`` tests.
E2E_SELECT = "FLASH_ATTN and not vllm_c and not 8-16"
DETERMINISM: tuple[tuple[str, str | None], ...] = (
    ("test_matmul_batch_invariant.py", None),
    ("test_rms_norm_batch_invariant.py", None),
    *(("test_batch_invariance.py", f"{test} and {E2E_SELECT}") for test in (
        "test_simple_generation",
        "test_logprobs_bitwise_batch_invariance_bs1_vs_bsN",
        "test_v1_generation_is_deterministic_across_batch_sizes_with_needle",
        "test_logprobs_bitwise_batch_invariance_ragged_chunked_prefill",
        "test_decode_logprobs_match_prefill_logprobs",
        "test_logprobs_without_batch_invariance_should_fail")),
)

STEPS = ("gpu", "kernel-ab", "latency", "throughput", "determinism")
#: seconds a run is expected to take on a warm H200 (engine start included), for --budget-s
EXPECTED_S = {"kernel-ab": 300, "latency": 170, "throughput": 160, "determinism": 180}
GPU_FIELDS = ("index", "name", "uuid", "serial", "driver_version", "pci.bus_id", "memory.total",
              "clocks.max.sm", "power.limit")


class DeviceScriptError(RuntimeError):
    """Something the run needs is missing; the message says what and how to provide it."""


def bench_argv(bench: str, output_json: str) -> list[str]:
    """The full command of one ``vllm bench`` run (``python3 -m vllm.entrypoints.cli.main`` is the
    ``vllm`` console script)."""
    return [*VLLM_CLI, *BENCHES[bench], "--output-json", output_json]


def shown(argv: list[str] | tuple[str, ...]) -> str:
    """The command as a person types it: ``vllm bench ...``."""
    argv = list(argv)
    if tuple(argv[:3]) == VLLM_CLI:
        argv = ["vllm", *argv[3:]]
    return shlex.join(argv)


def arm_order(arms: list[str], rounds: int) -> list[tuple[int, str]]:
    """(round, arm) in run order: A, B, then B, A, ... (ABBA), so drift hits both arms alike."""
    order = []
    for r in range(rounds):
        order += [(r + 1, a) for a in (arms if r % 2 == 0 else list(reversed(arms)))]
    return order


def parse_gpu_csv(text: str) -> list[dict[str, str]]:
    """``nvidia-smi --query-gpu=<GPU_FIELDS> --format=csv,noheader`` lines as dicts."""
    rows = []
    for line in text.strip().splitlines():
        values = [v.strip() for v in line.split(",")]
        if len(values) != len(GPU_FIELDS):
            raise DeviceScriptError(f"nvidia-smi printed {line!r}: expected {len(GPU_FIELDS)} "
                                    f"fields ({', '.join(GPU_FIELDS)})")
        rows.append(dict(zip(GPU_FIELDS, values)))
    return rows


def gpu_identity() -> list[dict[str, str]]:
    done = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(GPU_FIELDS)}",
                           "--format=csv,noheader"], capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise DeviceScriptError(f"nvidia-smi failed (rc {done.returncode}): {done.stderr.strip()}")
    return parse_gpu_csv(done.stdout)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def stop_group(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM to the run's process group (the one it leads), then SIGKILL after ``grace_s``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            continue


def utc() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class Recorder:
    """Runs commands, keeps their logs in ``out`` and the manifest current."""

    def __init__(self, out: Path, budget_s: float, argv: list[str]) -> None:
        self.out = out
        self.deadline = time.monotonic() + budget_s
        out.mkdir(parents=True, exist_ok=True)
        self.manifest: dict[str, Any] = {"schema": SCHEMA, "command": shown(argv),
                                         "started_utc": utc(), "gpu": [], "versions": {},
                                         "runs": []}

    def write(self) -> None:
        (self.out / "manifest.json").write_text(json.dumps(self.manifest, indent=1) + "\n")

    def left_s(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, step: str, arm: str | None, argv: list[str], env_add: dict[str, str],
            log_name: str, files: list[str], cwd: Path = REPO) -> dict[str, Any]:
        record: dict[str, Any] = {"step": step, "arm": arm, "argv": argv, "shown": shown(argv),
                                  "env": env_add, "cwd": str(cwd), "log": log_name,
                                  "files": files}
        expected = EXPECTED_S.get(step, 60)
        if self.left_s() < expected:
            record.update(status="skipped", why=f"{self.left_s():.0f} s left of --budget-s, "
                                                f"{expected} s expected")
            print(f"[upstream] {step} {arm or ''}: skipped ({record['why']})", flush=True)
            self.manifest["runs"].append(record)
            self.write()
            return record
        record["gpu_before"] = gpu_identity()
        record["start_utc"] = utc()
        t0 = time.monotonic()
        env = dict(os.environ, **env_add)
        print(f"[upstream] {step} {arm or ''}: {shown(argv)}", flush=True)
        with open(self.out / log_name, "w") as log:
            # its own process group: vLLM's engine core and workers are its children, and a run
            # stopped at the end of the budget must not leave them holding the GPU
            proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                record["returncode"] = proc.wait(timeout=max(30.0, self.left_s()))
            except subprocess.TimeoutExpired:
                stop_group(proc)
                record["returncode"] = None
                record["why"] = "stopped at the end of --budget-s"
        record["wall_s"] = round(time.monotonic() - t0, 1)
        record["end_utc"] = utc()
        record["gpu_after"] = gpu_identity()
        record["status"] = "ok" if record["returncode"] == 0 else "failed"
        text = (self.out / log_name).read_text(errors="replace")
        record["plugin_lines"] = [line for line in text.splitlines()
                                  if "bistat_kernels:" in line][:20]
        print(f"[upstream] {step} {arm or ''}: {record['status']} (rc {record['returncode']}, "
              f"{record['wall_s']} s); last line: {text.strip().splitlines()[-1:]}", flush=True)
        self.manifest["runs"].append(record)
        self.write()
        return record


def versions() -> dict[str, Any]:
    """What the arms ran on: the package versions (imported in a child, as the runs import them),
    the commit that travelled, the table's bytes, the plugin's entry point."""
    probe = ("import json, importlib.metadata as m\n"
             "out = {}\n"
             "for name in ('torch', 'triton', 'vllm', 'transformers', 'pytest'):\n"
             "    try: out[name] = m.version(name)\n"
             "    except Exception as e: out[name] = 'absent'\n"
             "import torch; out['cuda'] = torch.version.cuda\n"
             "try:\n"
             "    import vllm._version as v; out['vllm_commit'] = v.__commit_id__\n"
             "except Exception: out['vllm_commit'] = None\n"
             "eps = [e.value for e in m.entry_points(group='vllm.general_plugins')"
             " if e.name == 'bistat_tuned_gemm']\n"
             "out['plugin_entry_point'] = eps[0] if eps else None\n"
             "print(json.dumps(out))\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=300)
    if done.returncode != 0:
        raise DeviceScriptError(f"reading the versions failed: {done.stderr.strip()[-500:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    out.update(python=sys.version.split()[0],
               bistat_commit=os.environ.get("BISTAT_SOURCE_COMMIT"),
               table=str(TABLE.relative_to(REPO)), table_sha256=_sha256(TABLE),
               export_sha256=_sha256(EXPORT) if EXPORT.is_file() else None)
    return out


def step_gpu(rec: Recorder) -> None:
    rec.manifest["gpu"] = gpu_identity()
    rec.manifest["versions"] = versions()
    if not rec.manifest["versions"].get("plugin_entry_point"):
        raise DeviceScriptError("vLLM's plugin group has no bistat_tuned_gemm entry point: run "
                                "scripts/device/prepare.sh first (it installs bistat into $SITE)")
    rec.write()
    print(f"[upstream] gpu: {rec.manifest['gpu']}\n[upstream] versions: "
          f"{rec.manifest['versions']}", flush=True)


def step_kernel_ab(rec: Recorder) -> None:
    site = os.environ.get("SITE")
    if not site or not (Path(site) / "vllm").is_dir():
        raise DeviceScriptError("$SITE/vllm is missing: source scripts/device/env.sh after "
                                "install.sh (VLLM_PAYLOAD=latest)")
    argv = ["python3", "kernels/device/upstream_kernel_ab.py", "--vllm", f"{site}/vllm",
            "--export", str(EXPORT.relative_to(REPO)), "--out", str(rec.out / "kernel_ab.json")]
    env = {"PYTHONPATH": f"{REPO / 'kernels'}:{os.environ.get('PYTHONPATH', '')}"}
    rec.run("kernel-ab", None, argv, env, "kernel-ab.log", ["kernel_ab.json"])


def step_bench(rec: Recorder, bench: str, arms: list[str], rounds: int) -> None:
    for r, arm in arm_order(arms, rounds):
        stem = f"{bench}-{arm}" + (f"-{r}" if rounds > 1 else "")
        argv = bench_argv(bench, str(rec.out / f"{stem}.json"))
        rec.run(bench, arm, argv, ARMS[arm], f"{stem}.log", [f"{stem}.json"])


def unpack_tests(packed: Path = PACKED) -> Path:
    """vLLM 0.34.0's tests/ (carried as ``.dev/upstream/vllm034-tests.tar.xz``) into /tmp, checked
    against the sha256 ``pack-tests`` wrote; the wheels beside it into a private target."""
    tar, sums = packed / TESTS_TAR, packed / "SHA256SUMS"
    if not tar.is_file() or not sums.is_file():
        raise DeviceScriptError(f"{tar} (and SHA256SUMS) did not travel: run `python "
                                f"scripts/device/upstream_bench.py pack-tests --sdist ...` here "
                                f"and carry .dev/upstream with this call")
    expected = dict(line.split()[::-1] for line in sums.read_text().splitlines() if line.strip())
    if _sha256(tar) != expected.get(TESTS_TAR):
        raise DeviceScriptError(f"{tar}: sha256 differs from {sums}; pack it again")
    root = TESTS_DIR / TESTS_ROOT
    if not (root / "tests/v1/determinism").is_dir():
        TESTS_DIR.mkdir(parents=True, exist_ok=True)
        with tarfile.open(tar) as tf:
            tf.extractall(TESTS_DIR, filter="data")
    wheels = sorted((packed / "wheels").glob("*.whl"))
    if wheels and not TEST_DEPS.is_dir():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                        "--target", str(TEST_DEPS), *map(str, wheels)], check=True)
    return root


def step_determinism(rec: Recorder, arms: list[str]) -> None:
    root = unpack_tests()
    pythonpath = ":".join([str(REPO / "kernels/upstream"), str(REPO / "kernels"), str(TEST_DEPS),
                           os.environ.get("PYTHONPATH", "")])
    for arm in arms:
        for i, (name, select) in enumerate(DETERMINISM):
            stem = f"determinism-{arm}-{i}"
            argv = ["python3", "-m", "pytest", "-p", "pytest_bistat_table", "-rA", "-q",
                    f"--junitxml={rec.out / (stem + '.xml')}", f"tests/v1/determinism/{name}"]
            if select:
                argv += ["-k", select]
            env = dict(ARMS[arm], VLLM_TEST_MODEL=TEST_MODEL, PYTHONPATH=pythonpath)
            rec.run("determinism", arm, argv, env, f"{stem}.log", [f"{stem}.xml"], cwd=root)


def pack_tests(sdist: Path, out: Path, wheels: bool = True,
               recorded: str | None = None) -> list[Path]:
    """Here: vLLM 0.34.0's ``tests/`` out of its PyPI sdist (the wheel ships none) into
    ``out/vllm034-tests.tar.xz``, with ``SHA256SUMS``, and the test-only wheels into ``out/wheels``.
    Nothing of it is committed (``.dev/`` is ignored); the call that runs ``determinism`` carries
    ``.dev/upstream``. ``recorded``: the sdist's sha256 (default: the one the determinism listing
    was read from)."""
    recorded = recorded or json.loads(DETERMINISM_RAW.read_text())["source"]["sha256"]
    if not sdist.is_file():
        raise DeviceScriptError(f"{sdist} not found: `pip download` the sdist of vllm==0.34.0 "
                                f"(its URL is in {DETERMINISM_RAW.relative_to(REPO)})")
    if _sha256(sdist) != recorded:
        raise DeviceScriptError(f"{sdist}: sha256 {_sha256(sdist)} is not the one "
                                f"{DETERMINISM_RAW.relative_to(REPO)} was read from ({recorded})")
    out.mkdir(parents=True, exist_ok=True)
    tar = out / TESTS_TAR
    prefix = f"{TESTS_ROOT}/tests/"
    with tarfile.open(sdist) as src, tarfile.open(tar, "w:xz") as dst:
        for member in src:
            if member.name.startswith(prefix) and (member.isfile() or member.isdir()):
                dst.addfile(member, src.extractfile(member) if member.isfile() else None)
    (out / "SHA256SUMS").write_text(f"{_sha256(tar)}  {TESTS_TAR}\n")
    if wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d",
                        str(out / "wheels"), *TEST_WHEELS], check=True)
    return [tar, out / "SHA256SUMS", *sorted((out / "wheels").glob("*.whl"))]


def commands() -> str:
    lines = [f"# arm {arm}: {' '.join(f'{k}={v}' for k, v in env.items())}"
             for arm, env in ARMS.items()]
    for bench in BENCHES:
        lines.append(shown(bench_argv(bench, f"OUT/{bench}-ARM.json")))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="on the H200: run steps, write raw outputs under --out")
    run.add_argument("--out", type=Path, required=True)
    run.add_argument("--steps", default="gpu,latency,throughput",
                     help=f"comma-separated, from {', '.join(STEPS)}")
    run.add_argument("--arms", default=",".join(ARMS), help="comma-separated arms, in order")
    run.add_argument("--rounds", type=int, default=1, help="2: arms A, B, then B, A")
    run.add_argument("--budget-s", type=float, default=540.0,
                     help="this call's seconds; a run that would not fit is skipped")
    pack = sub.add_parser("pack-tests", help="here: vLLM 0.34.0's tests/ for carrying")
    pack.add_argument("--sdist", type=Path, required=True)
    pack.add_argument("--out", type=Path, default=PACKED)
    sub.add_parser("commands", help="print the vllm bench command lines")
    args = parser.parse_args(argv)
    try:
        if args.command == "commands":
            print(commands())
            return 0
        if args.command == "pack-tests":
            for path in pack_tests(args.sdist, args.out):
                print(f"{path} ({path.stat().st_size} bytes)")
            return 0
        steps = [s for s in args.steps.split(",") if s]
        arms = [a for a in args.arms.split(",") if a]
        bad = [s for s in steps if s not in STEPS] + [a for a in arms if a not in ARMS]
        if bad:
            parser.error(f"unknown {', '.join(bad)}: steps are {', '.join(STEPS)}, arms "
                         f"{', '.join(ARMS)}")
        called = ["python3", "scripts/device/upstream_bench.py",
                  *(argv if argv is not None else sys.argv[1:])]
        rec = Recorder(args.out.resolve(), args.budget_s, called)
        rec.manifest.update(steps=steps, arms=arms, rounds=args.rounds)
        # every call's folder names its node and stack, whatever steps it was given
        for step in ["gpu"] + [s for s in steps if s != "gpu"]:
            if step == "gpu":
                step_gpu(rec)
            elif step == "kernel-ab":
                step_kernel_ab(rec)
            elif step in BENCHES:
                step_bench(rec, step, arms, args.rounds)
            else:
                step_determinism(rec, arms)
        rec.manifest["ended_utc"] = utc()
        rec.write()
        failed = [r for r in rec.manifest["runs"] if r["status"] == "failed"]
        return 1 if failed else 0
    except DeviceScriptError as exc:
        print(f"upstream_bench: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
