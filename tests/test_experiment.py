"""Declarations: loading, defaults, the resolved form, and error messages (file + field + fix)."""

from __future__ import annotations

import copy
import tomllib
from pathlib import Path

import pydantic
import pytest

from bistat.declare.experiment import (
    DeclarationError,
    Experiment,
    load_experiment,
    validate_experiment,
)
from bistat.engines.registry import ADAPTERS, ENGINE_KINDS, register_adapter
from bistat.core.rule import ThroughputNotSlower

ROOT = Path(__file__).resolve().parents[1]
DECL = Path(__file__).resolve().parent / "data" / "declarations"


def _errors(path: Path) -> list[str]:
    with pytest.raises(DeclarationError) as info:
        load_experiment(path)
    return info.value.messages


def test_quickstart_and_published_protocol_load():
    quick = load_experiment(ROOT / "experiments" / "quickstart.toml")
    assert quick.name == "quickstart"
    assert quick.control.name == "blas"
    assert [a.name for a in quick.treatments] == ["invariant"]
    assert quick.arm_args("invariant") == {"max_batch_size": 32, "max_model_len": 2048,
                                           "gemm": "invariant"}
    pub = load_experiment(ROOT / "experiments" / "published-protocol.toml")
    labels = pub.resolved()["rule"]["labels"]
    assert labels == [
        {"label": "working", "all": [
            {"criterion": "match_lower_bound", "arm": "treatment", "at_least": 0.99},
            {"criterion": "throughput_ratio", "statistic": "point", "below": 0.9,
             "at_least": None}]},
        {"label": "doubtful", "all": [
            {"criterion": "match_intervals_overlap", "expect": True},
            {"criterion": "throughput_ratio", "statistic": "point", "below": None,
             "at_least": 0.95}]},
    ]
    assert pub.rule.otherwise == "reported as observed"
    assert pub.rule.confidence_level == 0.95


def test_minimal_declaration_resolves_every_default():
    exp = load_experiment(DECL / "minimal.toml")
    r = exp.resolved()
    assert r["workload"] == {
        "source": "builtin:chat", "n_prompts": 400, "max_tokens": 16, "max_tokens_min": None,
        "concurrency": 8,
        "passes": 3, "warmup_passes": 1, "order": "abba", "seed": 0, "temperature": 0.0,
        "top_p": 1.0, "top_k": -1, "ignore_eos": False, "shuffle_within_pass": True,
        "retries": 2, "request_timeout_s": 600.0, "top_logprobs": 5,
    }
    assert r["match"] == {"unit": "token_ids", "multi_pass": "all", "near_tie_epsilon": 0.125}
    assert r["validity"] == {"min_mean_running": 1.5, "max_preemptions": None,
                             "same_gpu": True, "same_versions": True}
    assert r["design"] == {"assumed_match_rate": 0.999, "assumed_control_match_rate": 0.9,
                           "expected_cv": 0.05, "cv_from": None,
                           "true_ratios": [0.8, 0.9, 1.0], "power_target": 0.8,
                           "time_budget_s": None}
    assert r["rule"]["cost"] is None
    assert r["rule"]["confidence_level"] == 0.95
    assert r["rule"]["alternative"] == "two-sided"
    assert r["rule"]["tost_alpha"] == 0.05
    assert r["rule"]["otherwise"] == "reported as observed"
    assert r["arms"][0] == {"name": "blas", "role": "control", "env": {}, "args": {}}
    assert r["rule"]["labels"][0]["all"][0] == {"criterion": "match_lower_bound",
                                                "arm": "treatment", "at_least": 0.99}


def test_resolved_form_validates_back_to_itself():
    for path in (DECL / "minimal.toml", DECL / "multi-treatment-tp2.toml",
                 ROOT / "experiments" / "quickstart.toml"):
        r = load_experiment(path).resolved()
        assert validate_experiment(r).resolved() == r


def test_tensor_parallel_and_several_treatments_are_declarable():
    exp = load_experiment(DECL / "multi-treatment-tp2.toml")
    assert exp.engine.args["tensor_parallel_size"] == 2
    assert [a.name for a in exp.treatments] == ["bi", "bi-eager"]
    assert exp.arm_args("bi-eager") == {"tensor_parallel_size": 2,
                                        "enable_prefix_caching": False, "enforce_eager": True}
    assert exp.arms[1].env == {"VLLM_BATCH_INVARIANT": "1"}
    assert exp.design.cv_from == "runs/earlier"
    assert exp.resolved()["design"]["expected_cv"] is None
    assert exp.validity.min_mean_running == 8.0
    assert isinstance(exp.rule.labels[1].criteria[0], ThroughputNotSlower)


@pytest.mark.parametrize("name, expected", [
    ("bad-role", [
        "arms[1].role: 'treatmnt' is not allowed; expected one of 'control', 'treatment'"]),
    ("bad-engine", [
        "engine.kind: unknown engine 'vlm'; expected one of 'embedded', 'vllm-server', "
        "'vllm-offline', 'openai', 'sglang-server', 'command-server'"]),
    ("bad-arms", [
        "arms[1].role: a second control arm (arms[0] is already the control); declare exactly "
        "one control and make the others 'treatment'",
        "arms: no arm has role = 'treatment'; declare at least one",
        "arms[1].name: 'a' is already the name of arms[0]; arm names must be unique"]),
    ("bad-labels", [
        "rule.labels[0].label: 'untested' cannot be declared: bistat gives it when a run could "
        "not test the hypothesis; use one of 'working', 'doubtful', 'reported as observed'",
        "rule.otherwise: 'fine' is not allowed; expected one of 'working', 'doubtful', "
        "'reported as observed'"]),
    ("bad-criteria", [
        "rule.labels[0].all[1]: give exactly one of 'below' or 'at_least' (e.g. below = 0.90)",
        "rule.labels[0].all[2]: the equivalence margins [1.05, 1.2] must contain 1 "
        "(no difference)",
        "rule.labels[0].all[3]: each criterion needs a 'criterion' key, e.g. { criterion = "
        "\"match_lower_bound\", arm = \"treatment\", at_least = 0.99 }"]),
    ("bad-many", [
        "arms[1].env.VLLM_BATCH_INVARIANT: expected a string, got 1 (integer); quote it: \"1\"",
        "workload.max_tokens: expected an integer, got '4' (string)",
        "workload.passes: required field is missing; add it to [workload]",
        "workload.pases: unknown field 'pases'; did you mean 'passes'? allowed: source, "
        "n_prompts, max_tokens, max_tokens_min, concurrency, passes, warmup_passes, order, seed, temperature, "
        "top_p, top_k, ignore_eos, shuffle_within_pass, retries, request_timeout_s, top_logprobs",
        "rule.labels[0].all[0].at_least: must be less than 1.0, got 1.5",
        "rule.labels[0].all[1]: unknown criterion 'throughput_slowr'; expected one of "
        "'match_lower_bound', 'match_upper_bound', 'match_intervals_overlap', "
        "'throughput_ratio', 'throughput_slower', 'throughput_not_slower', "
        "'large_drifts_at_most', 'control_diverges', 'treatment_beats_control', "
        "'probe_confirmed', 'engine_log'"]),
    ("bad-missing", [
        "hypothesis: required field is missing; add it at the top of the file",
        "engine.model: required field is missing; add it to [engine]",
        "arms: required section is missing; add [[arms]] tables",
        "workload: required section is missing; add a [workload] table",
        "rule: required section is missing; add a [rule] table"]),
    ("bad-syntax", [
        "not valid TOML: Illegal character '\\n' (at line 2, column 27)"]),
])
def test_bad_declarations_name_file_field_and_fix(name, expected):
    path = DECL / f"{name}.toml"
    assert _errors(path) == [f"{path}: {line}" for line in expected]


def test_missing_file():
    assert _errors(DECL / "nope.toml") == [f"{DECL / 'nope.toml'}: no such file"]


def _base() -> dict:
    return tomllib.loads((DECL / "minimal.toml").read_text())


@pytest.mark.parametrize("mutate, expected", [
    (lambda d: d["workload"].update(top_k=0),
     "workload.top_k: 0 is ambiguous across engines; use -1 for off or a positive k"),
    (lambda d: d["workload"].update(order="abab"),
     "workload.order: 'abab' is not allowed; expected one of 'abba', 'random'"),
    (lambda d: d["workload"].update(temperature=True),
     "workload.temperature: expected a number, got true (boolean)"),
    (lambda d: d.update(name="Quick Start"),
     "name: 'Quick Start' is not a valid name; use lower-case letters, digits, '-' and '_', "
     "starting with a letter or digit"),
    (lambda d: d["workload"].update(source="s3://x"),
     "workload.source: 's3://x' is not a prompt source; expected 'builtin:chat', "
     "'builtin:token-ids' or 'file:PATH.jsonl'"),
    (lambda d: d.update(validity={"min_mean_running": 9}),
     "validity.min_mean_running: 9 can never be reached with workload.concurrency = 8; lower "
     "it or raise the concurrency"),
    (lambda d: d.update(design={"expected_cv": 0.1, "cv_from": "runs/x"}),
     "design: give either expected_cv or cv_from, not both"),
    (lambda d: d["match"] if False else d.update(match={"unit": "bytes"}),
     "match.unit: 'bytes' is not allowed; expected one of 'token_ids', 'text', "
     "'token_ids+logprobs'"),
    (lambda d: d["arms"][1].update(env={"1BAD": "x"}),
     "arms[1].env: '1BAD' is not a valid environment variable name (letters, digits and '_', "
     "not starting with a digit)"),
    (lambda d: d["rule"]["labels"][0]["all"][0].update(atleast=0.9),
     "rule.labels[0].all[0].atleast: unknown field 'atleast'; did you mean 'at_least'? "
     "allowed: criterion, arm, at_least"),
    (lambda d: d["rule"]["labels"].append({"label": "working", "all": [
        {"criterion": "throughput_slower", "bound": 0.9}]}),
     "rule.labels[1].label: 'working' is already declared at labels[0]; declare each label "
     "once"),
    (lambda d: d["rule"]["labels"][0].update(all=[]),
     "rule.labels[0].all: needs at least 1 entry, got 0"),
    (lambda d: d["rule"]["labels"][0]["all"].append(
        {"criterion": "throughput_not_slower", "margin_low": 0.9, "lower_at_least": 0.9}),
     "rule.labels[0].all[2]: give either margin_low and margin_high (TOST equivalence) or "
     "lower_at_least, not both"),
    (lambda d: d["rule"].update(alternative="less"),
     "rule.alternative: 'less' is not allowed; expected one of 'two-sided', 'greater'"),
    (lambda d: d["workload"].update(top_logprobs=0),
     "workload.top_logprobs: must be at least 1, got 0"),
    (lambda d: d["workload"].update(top_logprobs=21),
     "workload.top_logprobs: must be at most 20, got 21"),
    (lambda d: d.update(match={"near_tie_epsilon": -0.1}),
     "match.near_tie_epsilon: must be at least 0.0, got -0.1"),
    (lambda d: d.update(match={"near_tie_epsilon": "small"}),
     "match.near_tie_epsilon: expected a number, got 'small' (string)"),
])
def test_field_errors(mutate, expected):
    data = copy.deepcopy(_base())
    mutate(data)
    with pytest.raises(DeclarationError) as info:
        validate_experiment(data, source="experiments/x.toml")
    assert info.value.messages == [f"experiments/x.toml: {expected}"]


def test_engine_kinds_are_open_to_extension():
    data = _base()
    data["engine"]["kind"] = "sglang-test"
    with pytest.raises(DeclarationError):
        validate_experiment(data)
    register_adapter("sglang-test", "sglang_adapter:SGLangEngine", "a test engine")
    try:
        assert validate_experiment(data).engine.kind == "sglang-test"
    finally:
        del ENGINE_KINDS["sglang-test"], ADAPTERS["sglang-test"]
    with pytest.raises(ValueError, match="must match"):
        register_adapter("Bad Kind", "m:C", "x")


def test_models_are_immutable():
    exp = load_experiment(DECL / "minimal.toml")
    with pytest.raises(pydantic.ValidationError, match="Instance is frozen"):
        exp.name = "other"  # type: ignore[misc]
    assert exp.name == "minimal"


def test_near_tie_epsilon_and_top_logprobs_are_declarable():
    data = copy.deepcopy(_base())
    data["workload"]["top_logprobs"] = 20
    data["match"] = {"near_tie_epsilon": 1e-3}
    exp = validate_experiment(data)
    assert (exp.workload.top_logprobs, exp.match.near_tie_epsilon) == (20, 1e-3)
    data["match"] = {"near_tie_epsilon": 0}  # an integer is a number too (TOML writes 0, not 0.0)
    assert validate_experiment(data).match.near_tie_epsilon == 0.0


def test_a_registration_sealed_before_the_new_fields_still_verifies(tmp_path):
    """Registrations sealed without near_tie_epsilon / top_logprobs stay readable (additive)."""
    import json

    from bistat.declare.prereg import load_registration, register

    decl = tmp_path / "experiments" / "old.toml"
    decl.parent.mkdir()
    decl.write_text((DECL / "minimal.toml").read_text().replace('name = "minimal"',
                                                                'name = "old"'))
    reg, _ = register(decl, registrations_dir=tmp_path / "preregistrations")
    data = json.loads(reg.path.read_text())
    sealed = data["sealed"]
    del sealed["declaration"]["match"]["near_tie_epsilon"]
    del sealed["declaration"]["workload"]["top_logprobs"]
    # re-seal the older form the way prereg seals: sha256 of the canonical JSON
    from bistat.declare.prereg import sha256_hex

    sealed["declaration_sha256"] = sha256_hex(sealed["declaration"])
    data["sha256"] = sha256_hex(sealed)
    reg.path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    old = load_registration(reg.path)
    assert old.experiment().match.near_tie_epsilon == 0.125
    assert old.experiment().workload.top_logprobs == 5
