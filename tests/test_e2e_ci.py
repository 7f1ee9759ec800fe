"""The whole job end to end, as a user runs it: register -> run -> analyze, on the real SmolLM2 model,

(a) with the embedded engine in-process, and (b) over HTTP through two ``bistat serve`` processes
(one per GEMM mode) driven by the ``openai`` engine. A smaller cousin of ``experiments/quickstart.toml``
(the README's main job), so CI exercises every layer of it on every change.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from bistat.analysis.summary import analyze_run
from bistat.cli import cli
from faults_support import declaration

pytestmark = pytest.mark.model

ROOT = Path(__file__).resolve().parents[1]

# The acceptance tests' two-arm template at this job's size, with a [match] unit, a [design]
# and a throughput criterion beside the match bound in its label.
JOB = dict(model="smollm2-135m", n_prompts=12, max_tokens=6, concurrency=6, passes=2,
           warmup_passes=1, extra='\n[match]\nunit = "token_ids+logprobs"\n\n[design]\n'
                                  'expected_cv = 0.1\n',
           working='{ criterion = "match_lower_bound", arm = "treatment", at_least = 0.7 },\n'
                   '        { criterion = "throughput_slower", bound = 1.0 }')


@pytest.fixture(autouse=True)
def _model_cached():
    from bistat.model import load_model
    from bistat.model.errors import ModelError
    try:
        load_model("smollm2-135m")
    except ModelError as exc:
        pytest.skip(f"smollm2-135m not cached (run `bistat model fetch smollm2-135m`): {exc}")


def _job(tmp_path: Path, monkeypatch, name: str, **fields: str) -> Path:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "experiments").mkdir()
    (tmp_path / "experiments" / f"{name}.toml").write_text(
        declaration(name, **{**JOB, **fields}))
    runner = CliRunner()
    for args in (["register", f"experiments/{name}.toml"],
                 ["run", f"preregistrations/{name}.json", "--run-dir", f"runs/{name}",
                  "--no-progress"],
                 ["analyze", f"runs/{name}", "--out", "findings"]):
        result = runner.invoke(cli, args, catch_exceptions=False)
        assert result.exit_code == 0, (args, result.output)
    return tmp_path / "runs" / name


def _check(run_dir: Path, name: str) -> None:
    summary = analyze_run(run_dir)
    arms = {a.name: a for a in summary.arms}
    # The invariant arm is bitwise invariant: every prompt matches across passes.
    assert (arms["invariant"].n_prompts, arms["invariant"].n_matched) == (12, 12)
    assert arms["blas"].n_prompts == 12
    finding = (run_dir.parents[1] / "findings" / f"{name}.md").read_text()
    assert "### invariant (treatment) vs blas (control): **" in finding


def test_in_process(tmp_path, monkeypatch):
    run_dir = _job(tmp_path, monkeypatch, "ci-embedded", kind="embedded",
                   engine_args="max_batch_size = 8", blas_args='gemm = "blas"',
                   invariant_args='gemm = "invariant"')
    _check(run_dir, "ci-embedded")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def servers():
    procs, urls = [], {}
    try:
        for gemm in ("blas", "invariant"):
            port = _free_port()
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "bistat", "serve", "--model", "smollm2-135m", "--gemm", gemm,
                 "--max-batch-size", "8", "--port", str(port)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=os.environ.copy()))
            urls[gemm] = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        for url in urls.values():
            while True:
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, f"bistat serve at {url} never became healthy"
                time.sleep(0.5)
        yield urls
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()


def test_over_http_through_bistat_serve(tmp_path, monkeypatch, servers):
    run_dir = _job(tmp_path, monkeypatch, "ci-http", kind="openai", engine_args="retries = 1",
                   blas_args=f'url = "{servers["blas"]}"',
                   invariant_args=f'url = "{servers["invariant"]}"')
    _check(run_dir, "ci-http")
    # the finding names the servers measured, as they declare themselves, not the client
    finding = (tmp_path / "findings" / "ci-http.md").read_text()
    assert "Engine: openai → bistat serve 0.1.0 · " in finding
    assert ("| server declares | engine=embedded, gemm=blas, max_batch_size=8, max_model_len=2048, "
            "model=smollm2-135m, owned_by=bistat, root=smollm2-135m | engine=embedded, "
            "gemm=invariant, max_batch_size=8, max_model_len=2048, model=smollm2-135m, "
            "owned_by=bistat, root=smollm2-135m |") in finding
    assert "`server gemm=invariant (control's server: blas)`" in finding
    assert "same settings as the control" not in finding
