"""What ``bistat register`` checks beyond the schema (issue 20 items 1 and 3):
``prereg.registration_problems``, the embedded adapter's ``declaration_problems`` and
``model.loader.model_problem``."""

from __future__ import annotations

from bistat.declare.experiment import validate_experiment
from bistat.declare.prereg import registration_problems
from bistat.model.loader import model_problem
from bistat.model.registry import REGISTRY

from helpers_runner import declaration


def _embedded(tmp_path, **sections):
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "manifest.json").write_text("{}")
    data = declaration(**sections)
    data["engine"] = {"kind": "embedded", "model": str(model), "args": {"max_batch_size": 4}}
    data["arms"][0]["args"] = {"gemm": "blas"}
    data["arms"][1]["args"] = {"gemm": "invariant"}
    return data


def test_a_clean_embedded_declaration_has_no_problems(tmp_path):
    exp = validate_experiment(_embedded(tmp_path), source="x.toml")
    assert registration_problems(exp, "experiments/x.toml", tmp_path) == []


def test_every_problem_names_the_file_and_the_field(tmp_path):
    data = _embedded(tmp_path, workload={"passes": 1, "source": "file:prompts/none.jsonl"})
    data["engine"]["model"] = "no-such-model"
    data["engine"]["args"]["max_batch_sise"] = 2
    data["arms"][1]["args"]["gemm"] = "invarient"
    exp = validate_experiment(data, source="x.toml")
    problems = registration_problems(exp, "experiments/x.toml", tmp_path)
    fields = [p.split(": ")[1] for p in problems]
    assert fields == ["workload.passes", "engine.args.max_batch_sise", "arms[1].args.gemm",
                      "engine.model", "workload.source"]
    assert all(p.startswith("experiments/x.toml: ") for p in problems)
    assert "set passes = 2 or more" in problems[0]
    assert "unknown GEMM mode 'invarient'; expected 'blas' or 'invariant'" in problems[2]


def test_a_prompt_file_that_exists_is_accepted(tmp_path):
    (tmp_path / "p.jsonl").write_text('{"prompt": "hi"}\n')
    exp = validate_experiment(_embedded(tmp_path, workload={"source": "file:p.jsonl"}), source="x")
    assert registration_problems(exp, "x.toml", tmp_path) == []


def test_model_problem(tmp_path):
    name = sorted(REGISTRY)[0]
    assert model_problem(name) is None            # registered: fetched before the run if needed
    assert "unknown model 'nope'" in model_problem("nope")
    assert "no manifest.json here" in model_problem(str(tmp_path))
