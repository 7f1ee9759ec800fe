"""Support for the fault acceptance tests and ``benchmarks/bench_faults.py``: bistat driven only
through its public surfaces (the CLI as a subprocess, ``bistat serve`` over HTTP, files on disk).

Nothing here imports ``bistat``: these checks must hold whatever its modules are called and
wherever they move. Shared pieces:

- `build_tiny_model`: a 2-layer, hidden-64 LLaMA model folder (the on-disk format `bistat model
  info` reads: ``manifest.json``, ``config.json``, ``tokenizer.json``, ``chat_template.jinja``,
  ``weights/*.npy``) with seeded random weights and SmolLM2's tokenizer copied from the cache, so
  an embedded pass of 8 prompts takes well under a second.
- `declaration`: an ``experiments/NAME.toml`` for the embedded engine or ``openai`` engine.
- `bistat`: run ``python -m bistat ...`` and return (exit code, stdout + stderr).
- `Server`: ``bistat serve`` in a subprocess on a free port.
- `ENOSPC_SITECUSTOMIZE`: a ``sitecustomize.py`` that makes writes under one folder fail with
  ``OSError(ENOSPC)`` after a byte budget (a full disk without root or a small tmpfs).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

#: The environment of every subprocess: the caller's (OPENBLAS_* presets included, untouched),
#: with the package-index check off as the suite's conftest sets it.
def env(**extra: str) -> dict[str, str]:
    e = os.environ.copy()
    e.setdefault("BISTAT_PACKAGE_INDEX", "off")
    e.update(extra)
    return e


def bistat(*args: str, cwd: Path, timeout: float = 180, extra_env: dict[str, str] | None = None
           ) -> tuple[int, str]:
    """``python -m bistat ARGS`` in ``cwd``: (exit code, stdout followed by stderr)."""
    proc = subprocess.run([sys.executable, "-m", "bistat", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env=env(**(extra_env or {})))
    return proc.returncode, proc.stdout + proc.stderr


def smollm2_folder() -> Path | None:
    """The cached SmolLM2 folder (``bistat model path``), or None when it is not cached."""
    proc = subprocess.run([sys.executable, "-m", "bistat", "model", "path", "smollm2-135m"],
                          capture_output=True, text=True, env=env(), timeout=120)
    if proc.returncode != 0:
        return None
    folder = Path(proc.stdout.strip().splitlines()[-1])
    return folder if (folder / "tokenizer.json").is_file() else None


def build_tiny_model(dest: Path, source: Path, seed: int = 0) -> Path:
    """Write a tiny random LLaMA model folder at ``dest`` using ``source``'s tokenizer files.

    Weights as ``bistat.model.testing.tiny_random_model`` draws them (embeddings N(0, 1), linear
    N(0, 1/in), norms 1 + N(0, 0.1²)); the manifest lists every file's sha256 and the content hash
    (sha256 of the canonical JSON of that list), as the loader checks.
    """
    dest = Path(dest)
    (dest / "weights").mkdir(parents=True, exist_ok=True)
    cfg = json.loads((source / "config.json").read_text())
    d, f, layers = 64, 128, 2
    cfg.update(hidden_size=d, intermediate_size=f, num_hidden_layers=layers, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rope_theta=10000.0,
               tie_word_embeddings=True)
    files: dict[str, str] = {}

    def put(rel: str, data: bytes) -> None:
        (dest / rel).write_bytes(data)
        files[rel] = hashlib.sha256(data).hexdigest()

    put("config.json", (json.dumps(cfg, indent=2, sort_keys=True) + "\n").encode())
    put("tokenizer.json", (source / "tokenizer.json").read_bytes())
    put("chat_template.jinja", (source / "chat_template.jinja").read_bytes())
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg["vocab_size"], d)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (d,), p + "self_attn.q_proj.weight": (64, d),
            p + "self_attn.k_proj.weight": (32, d), p + "self_attn.v_proj.weight": (32, d),
            p + "self_attn.o_proj.weight": (d, 64), p + "post_attention_layernorm.weight": (d,),
            p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
            p + "mlp.down_proj.weight": (d, f)})
    shapes["model.norm.weight"] = (d,)
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            w = 1.0 + 0.1 * rng.standard_normal(shape)
        elif "embed_tokens" in name:
            w = rng.standard_normal(shape)
        else:
            w = rng.standard_normal(shape) / np.sqrt(shape[1])
        buf = io.BytesIO()
        np.save(buf, w.astype(np.float32), allow_pickle=False)
        rel = f"weights/{name}.npy"
        put(rel, buf.getvalue())
        tensors[name] = {"file": rel, "shape": list(shape), "dtype": "float32"}
    content = hashlib.sha256(json.dumps(files, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    manifest = {"schema": "bistat.model-cache/1", "name": "tiny-faults", "sha256": content,
                "created_utc": "2026-01-01T00:00:00Z", "bistat_version": "0", "source": {},
                "tensors": tensors, "files": files}
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return dest


DECLARATION = """\
name = "{name}"
hypothesis = "The invariant GEMM gives bitwise-identical outputs whatever the batch; blas need not."

[engine]
kind = "{kind}"
model = "{model}"
args = {{ {engine_args} }}

[[arms]]
name = "blas"
role = "control"
args = {{ {blas_args} }}

[[arms]]
name = "invariant"
role = "treatment"
args = {{ {invariant_args} }}

[workload]
source = "{source}"
n_prompts = {n_prompts}
max_tokens = {max_tokens}
concurrency = {concurrency}
passes = {passes}
warmup_passes = {warmup_passes}
order = "abba"
seed = 3
ignore_eos = true

[validity]
min_mean_running = false
{extra}
[rule]
otherwise = "reported as observed"

[[rule.labels]]
label = "working"
all = [ {working} ]
"""


def declaration(name: str, model: str, *, kind: str = "embedded", **fields: object) -> str:
    """The TOML of a small two-arm experiment (blas control, invariant treatment). ``extra``:
    whole sections put before ``[rule]``; ``working``: the one label's criteria, TOML inline
    tables separated by commas."""
    values: dict[str, object] = {
        "name": name, "kind": kind, "model": model, "source": "builtin:chat", "n_prompts": 8,
        "max_tokens": 4, "concurrency": 4, "passes": 3, "warmup_passes": 0, "extra": "",
        "working": '{ criterion = "match_lower_bound", arm = "treatment", at_least = 0.5 }'}
    if kind == "embedded":
        values.update(engine_args="max_batch_size = 4", blas_args='gemm = "blas"',
                      invariant_args='gemm = "invariant"')
    values.update(fields)
    return DECLARATION.format(**values)


#: A cost rule on paired passes, appended to :func:`declaration`'s text (its last table).
PAIRED_COST = """
[rule.cost]
metric = "throughput"
margin = 0.5
confidence_level = 0.95
interval = "paired"
"""


def cut_records(run_dir: Path, after_seq: int, answered: int = 0) -> None:
    """Leave what SIGKILL leaves after schedule position ``after_seq`` ended: every record of the
    passes up to it, and of the next pass its start line and its first ``answered`` responses
    (none: killed between the two passes); no Parquet copy (a killed run is never compacted)."""
    for p in run_dir.glob("*.parquet"):
        p.unlink()
    for table in ("schedule", "passes", "responses", "metrics"):
        path = run_dir / f"{table}.jsonl"
        kept, partial = [], 0
        for line in (path.read_text().splitlines(True) if path.exists() else []):
            r = json.loads(line)
            seq = r.get("seq", 0)
            if seq == after_seq + 1 and answered:
                if table == "schedule" and r["event"] == "start":
                    kept.append(line)
                elif table == "responses" and partial < answered:
                    kept.append(line)
                    partial += 1
            elif seq <= after_seq:
                kept.append(line)
        path.write_text("".join(kept))


def write_declaration(root: Path, name: str, text: str) -> str:
    (root / "experiments").mkdir(parents=True, exist_ok=True)
    (root / "experiments" / f"{name}.toml").write_text(text)
    return f"experiments/{name}.toml"


def read_jsonl(path: Path) -> list[dict]:
    """Every parseable line of a JSONL table (a line cut by a crash is skipped)."""
    out = []
    if not path.exists():
        return out
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


def canonical_sha256(obj: object) -> str:
    """SHA-256 of the canonical JSON bistat seals (sorted keys, no whitespace, UTF-8)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                                     allow_nan=False).encode("utf-8")).hexdigest()


def reseal(path: Path, edit) -> None:
    """Forge a registration as a user could: ``edit(declaration)`` in place, then
    recompute ``declaration_sha256`` and the seal, keeping every time field."""
    data = json.loads(path.read_text())
    sealed = data["sealed"]
    edit(sealed["declaration"])
    sealed["declaration_sha256"] = canonical_sha256(sealed["declaration"])
    data["sha256"] = canonical_sha256(sealed)
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``bistat serve`` in a subprocess; its stderr goes to a file (``log_text``)."""

    def __init__(self, model: str, log: Path, *, port: int | None = None, gemm: str = "blas",
                 max_batch_size: int = 4, extra: tuple[str, ...] = ()) -> None:
        import httpx

        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self._fh = open(log, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bistat", "serve", "--model", model, "--gemm", gemm,
             "--max-batch-size", str(max_batch_size), "--port", str(self.port), *extra],
            stdout=self._fh, stderr=subprocess.STDOUT, env=env())
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"bistat serve never became healthy: {self.log_text()[-2000:]}")
            time.sleep(0.2)

    def metrics(self) -> dict[str, float]:
        import httpx

        text = httpx.get(self.url + "/metrics", timeout=5).text
        out = {}
        for m in re.finditer(r"^vllm:(\w+)\{[^}]*\} ([0-9.eE+-]+)$", text, re.M):
            out[m.group(1)] = float(m.group(2))
        return out

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=3)   # one that does not stop on SIGTERM is killed
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._fh.close()


#: Runs as a process of its own (``python -c SERVER_DRIVER SPEC``): start one server through its
#: adapter (SPEC: JSON ``{"adapter": "module:Class", "args": [...], "kwargs": {...}, "report":
#: PATH}``), append each process the adapter reports to PATH (JSON lines), print "ready", then
#: wait to be killed, as ``bistat run`` holds its servers.
SERVER_DRIVER = """
import importlib, json, sys, time
spec = json.loads(sys.argv[1])
module, cls = spec["adapter"].split(":")
engine = getattr(importlib.import_module(module), cls)(*spec["args"], **spec["kwargs"])
with open(spec["report"], "a") as out:
    engine.report_processes(lambda p: (out.write(json.dumps(dict(p)) + "\\n"), out.flush()))
    engine.start()
    print("ready", flush=True)
    time.sleep(600)
"""

#: ``bistat serve`` as a command-server template
SERVE = [sys.executable, "-m", "bistat", "serve", "--port", "{port}", "--model", "{model}",
         "--gemm", "{gemm}", "--max-batch-size", "4"]


def server_spec(kind: str, model: str, tmp: Path, tests: Path, src: Path) -> dict:
    """:data:`SERVER_DRIVER`'s SPEC for one server of ``kind`` that runs here: ``command-server``
    with ``bistat serve``, ``vllm-server`` against tests/helpers_serve.py (a stand-in that also
    starts a child in its process group), ``sglang-server`` against tests/sglang_standin.py;
    its log in ``tmp``."""
    log = str(tmp / "server.log")
    if kind == "command-server":
        return {"adapter": "bistat.engines.command_server:CommandServerEngine", "args": [model],
                "kwargs": {"command": SERVE, "values": {"gemm": "blas"}, "stop_grace_s": 5,
                           "log_path": log}}
    if kind == "vllm-server":
        site = tmp / "site" / "vllm"
        site.mkdir(parents=True)
        (site / "__init__.py").write_text('__version__ = "0.25.0"\n')
        env = {"PYTHONPATH": os.pathsep.join([str(site.parent), str(tests), str(src)]),
               "FAKE_VLLM_CHILD": "1", "FAKE_VLLM_PIDFILE": str(tmp / "pid")}
        return {"adapter": "bistat.engines.vllm_server:VLLMServerEngine", "args": ["smol"],
                "kwargs": {"command": [sys.executable, str(tests / "helpers_serve.py"), "serve"],
                           "env": env, "health_timeout_s": 60, "stop_grace_s": 5,
                           "log_path": log}}
    return {"adapter": "bistat.engines.sglang_server:SGLangServerEngine", "args": [model],
            "kwargs": {"command": [sys.executable, str(tests / "sglang_standin.py")],
                       "health_timeout_s": 90, "stop_grace_s": 5, "log_path": log}}


def group_alive(pgid: int) -> list[int]:
    """The live processes of process group ``pgid`` (``/proc``; zombies excluded)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rfind(")") + 2:].split()
            if fields[0] != "Z" and int(fields[2]) == pgid:
                out.append(int(entry))
    return out


def gone_within(pgids: list[int], seconds: float) -> bool:
    """Whether every process of the groups ``pgids`` is gone within ``seconds``."""
    deadline = time.monotonic() + seconds
    while any(group_alive(g) for g in pgids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def run_until(root: Path, name: str, run: str, responses: int, timeout: float = 180,
              **extra: str) -> subprocess.Popen:
    """``bistat run preregistrations/NAME.json --run-dir runs/RUN`` in the background, returned
    once ``responses`` responses are recorded (AssertionError if it ends or times out first)."""
    proc = subprocess.Popen([sys.executable, "-m", "bistat", "run", f"preregistrations/{name}.json",
                             "--run-dir", f"runs/{run}", "--no-progress"], cwd=root,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env(**extra))
    deadline = time.monotonic() + timeout
    while len(read_jsonl(root / "runs" / run / "responses.jsonl")) < responses:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"bistat run ended or stalled before {responses} responses: "
                                 f"{proc.communicate()[0][-2000:]}")
        time.sleep(0.01)
    return proc


def recorded_servers(run_dir: Path) -> list[dict]:
    """The servers a run recorded as started (``events.jsonl``, event ``server``) and not (yet)
    as stopped."""
    up: dict[int, dict] = {}
    for r in read_jsonl(run_dir / "events.jsonl"):
        if r.get("event") == "server":
            if r["process"]["state"] == "started":
                up[r["process"]["pid"]] = r["process"]
            else:
                up.pop(r["process"]["pid"], None)
    return list(up.values())


#: Injected with PYTHONPATH into a ``bistat run`` subprocess: once more than
#: ``$FAULTS_ENOSPC_AFTER`` bytes have been written to files opened for writing under
#: ``$FAULTS_ENOSPC_DIR`` (through ``open``/``io.open``, which the run writer uses), every further
#: write raises ``OSError(ENOSPC, "No space left on device")``, as a full disk does.
ENOSPC_SITECUSTOMIZE = '''
import builtins, errno, io, os
_DIR = os.environ.get("FAULTS_ENOSPC_DIR")
_LEFT = [int(os.environ.get("FAULTS_ENOSPC_AFTER", "0"))]
if _DIR:
    _DIR = os.path.realpath(_DIR)
    _open = io.open

    class _Full:
        def __init__(self, fh):
            self._fh = fh
        def write(self, data):
            n = len(data)
            if n > _LEFT[0]:
                _LEFT[0] = 0
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            _LEFT[0] -= n
            return self._fh.write(data)
        def __getattr__(self, name):
            return getattr(self._fh, name)
        def __enter__(self):
            return self
        def __exit__(self, *exc):
            return self._fh.__exit__(*exc)
        def __iter__(self):
            return iter(self._fh)

    def _patched(file, mode="r", *args, **kwargs):
        fh = _open(file, mode, *args, **kwargs)
        if isinstance(file, (str, bytes, os.PathLike)) and any(c in mode for c in "wax+"):
            path = os.path.realpath(os.fsdecode(file))
            if path.startswith(_DIR + os.sep):
                return _Full(fh)
        return fh

    builtins.open = _patched
    io.open = _patched
'''


def enospc_env(site_dir: Path, target: Path, after_bytes: int) -> dict[str, str]:
    """The extra environment that makes writes under ``target`` fail after ``after_bytes``."""
    site_dir.mkdir(parents=True, exist_ok=True)
    (site_dir / "sitecustomize.py").write_text(ENOSPC_SITECUSTOMIZE)
    path = os.pathsep.join([str(site_dir)] + ([os.environ["PYTHONPATH"]]
                                               if os.environ.get("PYTHONPATH") else []))
    return {"PYTHONPATH": path, "FAULTS_ENOSPC_DIR": str(target),
            "FAULTS_ENOSPC_AFTER": str(after_bytes)}
