"""Shared helpers of the explain-a-divergence tests (anatomy, diagnose, replay, schemas, inspect).

Runs are recorded with the real runner (``bistat.run.runner.start_run``) and the real embedded
adapter (``EmbeddedEngineAdapter``, from the engine registry) over a saved near-tie tiny model
(``helpers_embedded.near_tie_model``): in ``blas`` mode its greedy choices flip with the batch, in
``invariant`` mode they never do. The runner asks every request for ``workload.top_logprobs``
(default ``TOP_K`` = 5) alternatives, and the adapter records every engine step's batch size as a
metrics line with ``step_batch_size``.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jsonschema
from helpers_embedded import near_tie_model

from bistat.model.loader import save_model
from bistat.declare.prereg import register
from bistat.run.runner import start_run

TOP_K = 5  # workload.top_logprobs's default
SCHEMAS = Path(__file__).resolve().parents[1] / "src" / "bistat" / "schemas"


def save_near_tie(dest: Path) -> Path:
    """The near-tie model saved as a model folder (``engine.model`` may name a folder)."""
    if not (dest / "config.json").exists():
        save_model(near_tie_model(0, rel=3e-7), dest)
    return dest


def declaration_toml(name: str, model_dir: Path, arms: Sequence[tuple[str, str, str]], *,
                     n_prompts: int = 32, passes: int = 3, epsilon: float | None = None,
                     engine_args: str = "max_batch_size = 16, prefill_chunk = 8") -> str:
    arms_toml = "\n".join(
        f'[[arms]]\nname = "{n}"\nrole = "{role}"\nargs = {{ gemm = "{gemm}" }}\n'
        for n, role, gemm in arms)
    eps = "" if epsilon is None else f"near_tie_epsilon = {epsilon!r}\n"
    return f'''name = "{name}"
hypothesis = "The invariant arm's outputs match across passes; the blas arm's need not."

[engine]
kind = "embedded"
model = "{model_dir}"
args = {{ {engine_args} }}

{arms_toml}
[workload]
source = "builtin:chat"
n_prompts = {n_prompts}
max_tokens = 24
concurrency = 12
passes = {passes}
warmup_passes = 0
ignore_eos = true

[match]
unit = "token_ids"
{eps}
[validity]
min_mean_running = 1.0
same_gpu = false

[rule]
confidence_level = 0.95
otherwise = "reported as observed"

[[rule.labels]]
label = "working"
all = [ {{ criterion = "match_lower_bound", arm = "treatment", at_least = 0.5 }} ]
'''


def record_run(root: Path, name: str, arms: Sequence[tuple[str, str, str]], *,
               model_dir: Path | None = None, **kw: Any) -> Path:
    """Register a declaration under ``root`` and record its run with the real runner (over
    ``model_dir``, a saved model folder; default the near-tie model, saved under ``root``)."""
    model_dir = save_near_tie(root / "model") if model_dir is None else model_dir
    decl = root / "experiments" / f"{name}.toml"
    decl.parent.mkdir(parents=True, exist_ok=True)
    decl.write_text(declaration_toml(name, model_dir, arms, **kw), encoding="utf-8")
    reg, _ = register(decl, registrations_dir=root / "preregistrations")
    run_dir = root / "runs" / name
    outcome = start_run(reg.experiment(), reg.reference(), run_dir,
                        command=["bistat", "run", name])
    assert outcome.status == "complete", outcome
    return run_dir


BLAS_ARMS = (("blas", "control", "blas"), ("invariant", "treatment", "invariant"))
INVARIANT_ARMS = (("inv-a", "control", "invariant"), ("inv-b", "treatment", "invariant"))


@functools.lru_cache(maxsize=1)
def _registry():
    from referencing import Registry, Resource

    resources = []
    for path in sorted(SCHEMAS.glob("*.json")):
        schema = json.loads(path.read_text(encoding="utf-8"))
        resources.append((schema["$id"], Resource.from_contents(schema)))
    return Registry().with_resources(resources)


@functools.cache
def _validator(schema_file: str) -> jsonschema.Draft202012Validator:
    schema = json.loads((SCHEMAS / schema_file).read_text(encoding="utf-8"))
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema, registry=_registry())


def validate(instance: Any, schema_file: str) -> None:
    """Validate ``instance`` against ``src/bistat/schemas/<schema_file>`` (Draft 2020-12)."""
    _validator(schema_file).validate(instance)


def validate_run_dir(run_dir: Path) -> int:
    """Validate run.json and every line of every JSONL table; return the number of lines checked."""
    from bistat.store.format import TABLES
    from bistat.store.readers import read_jsonl

    validate(json.loads((run_dir / "run.json").read_text(encoding="utf-8")), "run.schema.json")
    n = 1
    for table in TABLES:
        rows, gaps = read_jsonl(run_dir / f"{table}.jsonl")
        assert not gaps, gaps
        for row in rows:
            validate(row, f"{table}.schema.json")
            n += 1
    return n


_RUNS: dict[str, Path] = {}


def cached_run(tmp_path_factory: Any, name: str, arms: Sequence[tuple[str, str, str]],
               **kw: Any) -> Path:
    """One recorded run per name for the whole test session (several test modules share it).

    Tests must not write into it; they copy it when they need to change it.
    """
    if name not in _RUNS:
        root = tmp_path_factory.getbasetemp() / "explain-runs"
        root.mkdir(exist_ok=True)
        _RUNS[name] = record_run(root, name, arms, **kw)
    return _RUNS[name]


def blas_run(tmp_path_factory: Any) -> Path:
    """Arms blas (control) and invariant (treatment): the blas arm diverges, invariant never."""
    return cached_run(tmp_path_factory, "blasrun", BLAS_ARMS)


def invariant_run(tmp_path_factory: Any) -> Path:
    """Both arms invariant: nothing diverges."""
    return cached_run(tmp_path_factory, "invrun", INVARIANT_ARMS)
