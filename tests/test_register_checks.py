"""What ``bistat register`` checks beyond the schema:
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
    (tmp_path / "p.jsonl").write_text("".join(f'{{"prompt": "hi {i}"}}\n' for i in range(12)))
    exp = validate_experiment(_embedded(tmp_path, workload={"source": "file:p.jsonl"}), source="x")
    assert registration_problems(exp, "x.toml", tmp_path) == []


def test_model_problem(tmp_path):
    name = sorted(REGISTRY)[0]
    assert model_problem(name) is None            # registered: fetched before the run if needed
    assert "unknown model 'nope'" in model_problem("nope")
    assert "no manifest.json here" in model_problem(str(tmp_path))


def _vllm(kind, required=None, **engine_args):
    data = declaration()
    data["engine"] = {"kind": kind, "model": "/tmp/model/smollm2", "args": dict(engine_args)}
    if required:
        data["engine"]["required_version"] = required
    return validate_experiment(data, source="x.toml")


def test_vllm_argument_names_are_checked_against_the_recorded_releases(tmp_path):
    """An engine-argument typo in a vLLM declaration is refused at registration,
    from the names recorded from each supported wheel (vLLM is not imported)."""
    ok = _vllm("vllm-server", max_num_seqs=64, enforce_eager=True, attention_backend="TRITON_ATTN",
               health_timeout_s=600, retries=2)
    assert registration_problems(ok, "experiments/x.toml", tmp_path) == []
    bad = _vllm("vllm-server", max_num_seqz=64)
    (problem,) = registration_problems(bad, "experiments/x.toml", tmp_path)
    assert problem.startswith("experiments/x.toml: engine.args.max_num_seqz: unknown vllm serve "
                              "argument 'max_num_seqz' in vLLM 0.25.0 or 0.33.0")
    assert problem.endswith("did you mean 'max_num_seqs'?")
    # offline: vllm.LLM keyword arguments, and the adapter's own keys
    off = _vllm("vllm-offline", "0.33.0", load_format="dummy", skip_tokenizer_init=True,
                start_timeout_s=900, gpu_memory_utilisation=0.3)
    (problem,) = registration_problems(off, "experiments/x.toml", tmp_path)
    assert "engine.args.gpu_memory_utilisation: unknown vllm.LLM keyword argument " \
           "'gpu_memory_utilisation' in vLLM 0.33.0" in problem
    assert problem.endswith("did you mean 'gpu_memory_utilization'?")


def test_the_recorded_names_follow_each_release():
    """A name one release added is known for it, not for the older one (0.33.0's
    ``EngineArgs`` grew fields 0.25.0 lacks), so a declaration requiring 0.25.0 is checked
    against 0.25.0."""
    from bistat.engines.vllm_args import known_names

    names = known_names()
    assert sorted(names) == ["0.25.0", "0.33.0"]
    only_new = names["0.33.0"]["offline"] - names["0.25.0"]["offline"]
    assert len(only_new) >= 30
    new = sorted(only_new)[0]
    assert registration_problems(_vllm("vllm-offline", "0.33.0", **{new: 1}), "x", ".") == []
    (problem,) = registration_problems(_vllm("vllm-offline", "0.25.0", **{new: 1}), "x", ".")
    assert f"unknown vllm.LLM keyword argument {new!r} in vLLM 0.25.0" in problem


def test_every_committed_vllm_declaration_passes_the_check():
    import glob

    from bistat.declare.experiment import load_experiment
    from bistat.engines.registry import declaration_problems

    root = __import__("pathlib").Path(__file__).resolve().parents[1]
    checked = 0
    for path in sorted(glob.glob(str(root / "experiments" / "*.toml"))):
        exp = load_experiment(path)
        if exp.engine.kind.startswith("vllm"):
            assert declaration_problems(exp) == [], path
            checked += 1
    assert checked >= 30


def test_the_names_are_derived_from_a_wheel_by_the_script(tmp_path):
    """scripts/vllm_arg_names.py reads EngineArgs' fields, LLM.__init__'s parameters, the
    frontend dataclasses' fields and every ``--flag`` under vllm/entrypoints."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("vllm_arg_names",
                                                  root / "scripts" / "vllm_arg_names.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    site = tmp_path / "site"
    (site / "vllm" / "engine").mkdir(parents=True)
    (site / "vllm" / "entrypoints" / "openai").mkdir(parents=True)
    (site / "vllm" / "engine" / "arg_utils.py").write_text(
        "class EngineArgs:\n    model: str = ''\n    max_num_seqs: int = 1\n")
    (site / "vllm" / "entrypoints" / "llm.py").write_text(
        "class LLM:\n    def __init__(self, model, *, seed=0, **kwargs):\n        pass\n")
    (site / "vllm" / "entrypoints" / "openai" / "cli_args.py").write_text(
        "class FrontendArgs:\n    port: int = 8000\n"
        "def add(p):\n    p.add_argument('--api-server-count')\n")
    assert mod.names(site) == {"offline": ["max_num_seqs", "model", "seed"],
                               "server": ["api_server_count", "max_num_seqs", "model", "port"]}
