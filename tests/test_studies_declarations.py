"""The H200 study declarations and the tensor-parallel ones load, validate with the real schema,
have the arms and environments the study design needs, and get a design analysis.

Every declaration is loaded exactly as written, including ``builtin:token-ids?length=..&vocab=..``
sources and ``workload.max_tokens_min`` (per-prompt output lengths uniform in [min, max],
workload (i)).
"""

from __future__ import annotations

import json
import tomllib

import sys
from pathlib import Path

import pytest

from bistat.declare.design_report import analyse_design
from bistat.declare.experiment import DeclarationError, load_experiment, validate_experiment
from bistat.run.fingerprint import same_node
from bistat.run.workload import load_prompts

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
EXP = ROOT / "experiments"
MATCH = ["h200-match-smollm2", "h200-match-smollm2-improved", "h200-match-smollm2-r2",
         "h200-match-smollm2-r2-improved", "h200-match-qwen3-8b-synth",
         "h200-match-qwen3-8b-synth-improved"]
#: Registrations whose front end was set up after the first attempt (docs/STUDIES.md): two API
#: servers, no access log, top-2 logprobs, a running-batch floor of 16.
FRONT_END_FIXED = ["h200-match-smollm2-r2", "h200-match-smollm2-r2-improved",
                   "h200-match-qwen3-8b-synth", "h200-match-qwen3-8b-synth-improved",
                   "tp1-match", "tp2-match"]
COST = ["h200-cost-qwen3-8b-throughput", "h200-cost-qwen3-8b-throughput-goal",
        "h200-cost-qwen3-8b-throughput-r2", "h200-cost-qwen3-8b-throughput-r2-goal",
        "h200-cost-qwen3-8b-latency-b8", "h200-cost-qwen3-8b-latency-b32",
        "h200-cost-qwen3-1_7b-latency-b8"]
TP = ["tp2-match", "tp1-match"]
ALL = MATCH + COST + TP
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}


def _raw(name: str) -> dict:
    return tomllib.loads((EXP / f"{name}.toml").read_text(encoding="utf-8"))


def _validated(name: str):
    """The declaration validated by the real schema (from its parsed TOML)."""
    return validate_experiment(_raw(name), source=f"experiments/{name}.toml")


@pytest.mark.parametrize("name", ALL)
def test_declaration_loads_as_written(name):
    exp = load_experiment(EXP / f"{name}.toml")
    assert exp.name == name


#: Small runs recorded as test fixtures (tests/data/vllm-h200/), not studies.
FIXTURES = ["h200-fixture-smollm2", "h200-fixture-triton-attn"]
#: Declarations for ``bistat probe`` only (registered, never ``bistat run``).
PROBES = ["h200-plugin-probe-qwen3-8b-synth"]


#: Registered tests of a mechanism (docs/STUDIES.md), beside the studies.
MECHANISM = ["h200-fa3-kv128-smollm2"]


#: The default rule applied, after the data, to every committed H200 run: exploratory.
EXPLORATORY = [f"{n}-exploratory" for n in (
    "h200-match-smollm2", "h200-cost-qwen3-8b-latency-b8", "h200-cost-qwen3-8b-throughput",
    "h200-match-qwen3-8b-synth", "h200-fa3-kv128-smollm2", "h200-match-smollm2-r2",
    "h200-cost-qwen3-8b-throughput-r2", "h200-cost-qwen3-8b-latency-b32",
    "h200-cost-qwen3-1_7b-latency-b8", "tp1-match", "h200-fixture-smollm2",
    "h200-fixture-triton-attn")]


#: The rule that decides each committed study's cost with the HAC interval, registered after the
#: data (scripts/hac_declarations.py): NAME-hac -> the registration whose rule it varies.
HAC = {f"{run}-hac": base for run, base in {
    **{n: f"{n}-exploratory" for n in (
        "h200-cost-qwen3-8b-latency-b8", "h200-cost-qwen3-8b-throughput",
        "h200-match-qwen3-8b-synth", "h200-fa3-kv128-smollm2", "h200-match-smollm2-r2",
        "h200-cost-qwen3-8b-throughput-r2", "h200-cost-qwen3-8b-latency-b32",
        "h200-cost-qwen3-1_7b-latency-b8", "tp1-match")},
    **{n: n for n in (
        "h200-v033-match-smollm2", "h200-v033-i23-latency-qwen3-8b-b8",
        "h200-v033-i23-latency-qwen3-17b-b8", "h200-v034-i23-latency-qwen3-8b-b8-compiled",
        "h200-v034-i23-latency-qwen3-8b-b32-compiled",
        "h200-v034-i23-latency-qwen3-17b-b8-compiled",
        "h200-v034-i23-throughput-qwen3-8b-serial-compiled",
        "h200-v034-i23-throughput-qwen3-8b-concurrent-compiled",
        "h200-v034-i23-throughput-qwen3-8b-paired", "h200-v034-match-smollm2")}}.items()}


#: The re-runs on the newest vLLM, registered under the default rule before
#: their data, each with its vLLM 0.25.0 counterpart.
NEWEST = {"h200-v033-match-smollm2": "h200-match-smollm2-r2",
          "h200-v033-match-qwen3-8b-synth": "h200-match-qwen3-8b-synth",
          "h200-v033-cost-qwen3-8b-latency-b8": "h200-cost-qwen3-8b-latency-b8",
          "h200-v033-cost-qwen3-8b-throughput": "h200-cost-qwen3-8b-throughput-r2"}


#: The tuned GEMM's end-to-end goals on vLLM 0.33.0 (the ``-i23-`` studies: the tuned GEMM against
#: the default; cost margin 0.05), each with the vLLM 0.33.0 Study 2 declaration it follows and
#: what it changes.
TUNED_GEMM_V033 = {"h200-v033-i23-latency-qwen3-8b-b8": ("h200-v033-cost-qwen3-8b-latency-b8", {}),
           "h200-v033-i23-latency-qwen3-8b-b32": ("h200-v033-cost-qwen3-8b-latency-b8",
                                                  {"n_prompts": 32, "concurrency": 32}),
           "h200-v033-i23-latency-qwen3-17b-b8": ("h200-v033-cost-qwen3-8b-latency-b8", {}),
           "h200-v033-i23-throughput-qwen3-8b-serial": ("h200-v033-cost-qwen3-8b-throughput",
                                                        {"passes": 16})}
#: The tuned GEMM's batch-8 latency goal with a third arm, the tuned GEMM with torch.compile
#: forced on.
TUNED_GEMM_V033_COMPILED = {"h200-v033-i23-latency-qwen3-8b-b8-compiled": (
    "h200-v033-i23-latency-qwen3-8b-b8", {"passes": 90})}
#: The same study on vLLM 0.34.0 (the newest release), on an H200 and, for a lent H100, its twin
#: with the H200's table named in the tuned arms (BISTAT_GEMM_TABLE).
TUNED_GEMM_V034 = {"h200-v034-i23-latency-qwen3-8b-b8-compiled": {},
                "h100-v034-i23-latency-qwen3-8b-b8-compiled": {"BISTAT_GEMM_TABLE": "nvidia_h200"}}
#: The tuned GEMM's other goals on vLLM 0.34.0, registered after the batch-8 run:
#: the batch-8 study at batch 32 and on the Qwen3-1.7B shape (three arms each), and workload (i)
#: with one engine resident at a time, the compiled tuned arm against the default.
TUNED_GEMM_V034_NEXT = {
    "h200-v034-i23-latency-qwen3-8b-b32-compiled": (
        "h200-v034-i23-latency-qwen3-8b-b8-compiled", {"n_prompts": 32, "concurrency": 32}, None),
    "h200-v034-i23-latency-qwen3-17b-b8-compiled": (
        "h200-v034-i23-latency-qwen3-8b-b8-compiled", {}, "/tmp/model/qwen3-1.7b-config"),
    "h200-v034-i23-throughput-qwen3-8b-serial-compiled": (
        "h200-v033-i23-throughput-qwen3-8b-serial", {"passes": 24}, None)}
#: Workload (i) again after the serial run could not fit a session (its pilot): the engines up
#: together, the passes and the time budget from the design analysis on the pilot.
TUNED_GEMM_V034_CONCURRENT = {"h200-v034-i23-throughput-qwen3-8b-concurrent-compiled":
                           "h200-v034-i23-throughput-qwen3-8b-serial-compiled"}
#: ... and again after that one could not fit beside the payload's staging (its pilot): 32 passes
#: per arm, its cost interval paired by pass, planned from the pilot's pairs.
TUNED_GEMM_V034_PAIRED = {"h200-v034-i23-throughput-qwen3-8b-paired":
                       "h200-v034-i23-throughput-qwen3-8b-concurrent-compiled"}


#: The SGLang 0.5.23 studies and the vLLM twin each mirrors (its workload, match, validity
#: and rule), with what differs on purpose. h200-v034-match-smollm2 (vLLM 0.34.0's Study 1(a)) is
#: listed here as a twin; no other set holds it.
SGLANG_STUDIES = {
    "h200-sglang-match-smollm2": ("h200-v034-match-smollm2", {}),
    "h200-sglang-match-qwen3-8b-synth": ("h200-match-qwen3-8b-synth", {}),
    "h200-sglang-latency-qwen3-8b-b8": ("h200-v034-i23-latency-qwen3-8b-b8-compiled",
                                        {"passes": 60}),
    "h200-sglang-throughput-qwen3-8b": ("h200-v034-i23-throughput-qwen3-8b-paired", {}),
}


#: H100 twins registered before their data when the device tool lent an H100: each twin's H200
#: study, and what the twin changes (fewer passes, to fit one session beside the payload)
def _h200_table_arms(study: str) -> list[dict]:
    """The H200 study's arms with its tuned-GEMM arm naming the H200's table, as its H100 twin."""
    return [{**a, "env": {**a["env"], "BISTAT_GEMM_TABLE": "nvidia_h200"}}
            if a["env"].get("BISTAT_TUNED_GEMM") == "1" else a
            for a in tomllib.loads((EXP / f"{study}.toml").read_text())["arms"]]


H100_TWINS = {
    "h100-sglang-match-smollm2": ("h200-sglang-match-smollm2",
                                  {("workload", "passes"): 4, ("design", "time_budget_s"): 900}),
    "h100-sglang-match-qwen3-8b-synth": ("h200-sglang-match-qwen3-8b-synth", {}),
    # vLLM beside SGLang's S1 twin on one card type: its passes, and the tuned arm on the H200 table
    "h100-v034-match-smollm2": (
        "h200-v034-match-smollm2",
        {("workload", "passes"): 4, ("design", "time_budget_s"): 1100,
         ("arms",): _h200_table_arms("h200-v034-match-smollm2")}),
    # two 36-layer servers resident on 80 GB: a larger static share, the KV pool capped
    "h100-sglang-latency-qwen3-8b-b8": (
        "h200-sglang-latency-qwen3-8b-b8",
        {("engine", "args"): {**tomllib.loads((EXP / "h200-sglang-latency-qwen3-8b-b8.toml")
                                              .read_text())["engine"]["args"],
                              "mem_fraction_static": 0.5, "max_total_tokens": 32768}}),
    # vLLM 0.34.0's tax studies and Study 1(b): the tuned arm on the H200 table, nothing else
    **{f"h100-{rest}": (f"h200-{rest}", {("arms",): _h200_table_arms(f"h200-{rest}")})
       for rest in ("v034-tax-qwen3-8b-b8", "v034-tax-qwen3-8b-b32", "v034-tax-qwen3-17b-b8",
                    "v034-match-qwen3-8b-synth")},
}


#: vLLM 0.34.0, the newest release, the whole picture. Study 1(a) (run 2026-12-04, a twin
#: of SGLang's S1 above), Study 1(b), and the determinism tax as users meet it at four workloads:
#: each with the twin whose engine, model, workload and validity it keeps, and what it changes.
V034_STUDIES = {
    "h200-v034-match-qwen3-8b-synth": ("h200-v033-match-qwen3-8b-synth", {"passes": 8}),
    "h200-v034-tax-qwen3-8b-b8": ("h200-v034-i23-latency-qwen3-8b-b8-compiled", {"passes": 60}),
    "h200-v034-tax-qwen3-8b-b32": ("h200-v034-i23-latency-qwen3-8b-b32-compiled",
                                   {"passes": 60}),
    "h200-v034-tax-qwen3-17b-b8": ("h200-v034-i23-latency-qwen3-17b-b8-compiled",
                                   {"passes": 120}),
    "h200-v034-tax-qwen3-8b-throughput": ("h200-v034-i23-throughput-qwen3-8b-paired",
                                          {"passes": 36}),
}
#: the arms' settings of the tax studies: the default, the mode as shipped, bistat's plugin
TAX_ARMS = {"default": {"VLLM_BATCH_INVARIANT": "0", "BISTAT_TUNED_GEMM": "0"},
            "batch-invariant": {"VLLM_BATCH_INVARIANT": "1", "BISTAT_TUNED_GEMM": "0"},
            "bi-plugin": {"VLLM_BATCH_INVARIANT": "1", "BISTAT_TUNED_GEMM": "1",
                          "BISTAT_FA3_PIN": "1", "VLLM_USE_BREAKABLE_CUDAGRAPH": "0"}}


@pytest.mark.parametrize("name", sorted(V034_STUDIES))
def test_each_v034_study_requires_0_34_and_keeps_its_twin_but_for_its_arms_and_passes(name):
    """vLLM 0.34.0 required; the twin's engine kind, model, workload (but the passes), match unit
    and validity; the default rule's labels; the cost decided on the HAC interval; the tax studies'
    three arms exactly (the default, VLLM_BATCH_INVARIANT=1 alone, bistat's whole plugin); and a
    design analysis that runs from the twin's recorded data where it was recorded."""
    twin_name, differs = V034_STUDIES[name]
    d, twin = _raw(name), _raw(twin_name)
    assert d["engine"]["required_version"] == "0.34.0"
    assert {k: v for k, v in d["engine"].items() if k not in ("required_version", "args",
                                                               "engines_concurrent")} == {
        k: v for k, v in twin["engine"].items() if k not in ("required_version", "args",
                                                             "engines_concurrent")}
    assert {k: v for k, v in d["workload"].items() if k not in differs} == {
        k: v for k, v in twin["workload"].items() if k not in differs}
    assert {k: d["workload"][k] for k in differs} == differs
    assert d["match"]["unit"] == twin["match"]["unit"] and d["validity"] == twin["validity"]
    assert d["rule"]["labels"] == _raw("h200-v034-match-smollm2")["rule"]["labels"]
    assert (d["rule"]["cost"]["interval"], d["rule"]["cost"]["hac_bandwidth"]) == ("hac", "llsw")
    if name.startswith("h200-v034-tax-"):
        arms = {a["name"]: {k: a["env"][k] for k in a["env"] if k.startswith(("VLLM_B", "VLLM_U",
                                                                              "BISTAT_"))
                            and k != "VLLM_USE_FLASHINFER_SAMPLER"} for a in d["arms"]}
        assert arms == TAX_ARMS
        assert all(NO_MULTICAST.items() <= a["env"].items() for a in d["arms"])
    report = analyse_design(_validated(name), base_dir=ROOT)
    assert report.cost is not None and report.duration is not None


def test_the_declarations_are_the_whole_set():
    names = ({p.stem for p in EXP.glob("h[12]00-*.toml")}
             | {p.stem for p in EXP.glob("tp*-match*.toml")})
    assert names == (set(ALL) | set(FIXTURES) | set(PROBES) | set(MECHANISM) | set(EXPLORATORY)
                     | set(NEWEST) | set(TUNED_GEMM_V033) | set(TUNED_GEMM_V033_COMPILED)
                     | set(TUNED_GEMM_V034) | set(TUNED_GEMM_V034_NEXT)
                     | set(TUNED_GEMM_V034_CONCURRENT) | set(TUNED_GEMM_V034_PAIRED)
                     | set(SGLANG_STUDIES) | set(HAC)
                     | set(V034_STUDIES)
                     | {twin for twin, _ in SGLANG_STUDIES.values()} | set(H100_TWINS))


@pytest.mark.parametrize("name", sorted(H100_TWINS))
def test_each_h100_twin_is_its_h200_study_but_for_what_it_names(name):
    """The same engine, arms, workload, match, validity and rule as the H200 study; only the
    fields named differ (and the name and hypothesis, which say which card and why)."""
    twin_name, differs = H100_TWINS[name]
    d, twin = _raw(name), _raw(twin_name)
    for key, value in differs.items():
        if len(key) == 1:                      # a top-level entry ("arms",)
            (field,) = key
            assert d[field] == value and twin[field] != value, field
            del d[field], twin[field]
            continue
        table, field = key
        assert d[table][field] == value and twin[table][field] != value, (table, field)
        del d[table][field], twin[table][field]
    assert d["name"] == name and "H100" in d["hypothesis"]
    for key in ("name", "hypothesis"):
        del d[key], twin[key]
    assert d == twin


@pytest.mark.parametrize("name", sorted(SGLANG_STUDIES))
def test_each_sglang_study_mirrors_its_vllm_twin(name):
    """SGLang 0.5.23 required, one server per arm, the control SGLang's default, every treatment
    arm --enable-deterministic-inference on a named backend SGLang supports in that mode; the
    workload (but the listed differences), match and validity of the vLLM twin; the default
    decision rule; a design analysis planned from recorded data."""
    twin_name, differs = SGLANG_STUDIES[name]
    d, twin = _raw(name), _raw(twin_name)
    assert (d["engine"]["kind"], d["engine"]["required_version"]) == ("sglang-server", "0.5.23")
    assert d["engine"]["model"] == twin["engine"]["model"]
    control, *treatments = d["arms"]
    assert control["role"] == "control" and "args" not in control
    assert treatments and all(a["role"] == "treatment" and a["args"]["enable_deterministic_inference"]
                              is True and a["args"]["attention_backend"] in ("fa3", "triton",
                                                                             "flashinfer")
                              for a in treatments)
    assert {k: v for k, v in d["workload"].items() if k not in differs} == {
        k: v for k, v in twin["workload"].items() if k not in differs}
    assert {k: d["workload"][k] for k in differs} == differs
    assert (d["match"], d["validity"]) == (twin["match"], twin["validity"])
    assert d["rule"]["labels"] == _raw("h200-v034-match-smollm2")["rule"]["labels"]
    assert (ROOT / d["design"]["cv_from"]).is_dir()
    exp = load_experiment(EXP / f"{name}.toml")
    from bistat.engines.registry import declaration_problems

    assert declaration_problems(exp) == []
    report = analyse_design(exp, base_dir=ROOT)
    assert report.cv_source.startswith(f"pairs of {d['design']['cv_from']}") or \
        d["design"]["cv_from"] in report.cv_source, report.cv_source


@pytest.mark.parametrize("name", sorted(TUNED_GEMM_V033))
def test_each_tuned_gemm_study_is_its_study2_declaration_with_two_arms_and_a_five_percent_margin(
        name):
    """The arms default and bi-tuned-gemm of the Study 2 declaration on 0.33.0, the same engine
    arguments and rule but for the cost margin (0.05: the tuned GEMM's goals), the workload changed
    only where the table says; registered before any data (its runs, if any, postdate it)."""
    from bistat.declare.prereg import load_registration

    base, workload_changes = TUNED_GEMM_V033[name]
    mine, theirs = load_experiment(EXP / f"{name}.toml"), load_experiment(EXP / f"{base}.toml")
    assert [(a.name, a.role, a.env) for a in mine.arms] == [
        (a.name, a.role, a.env) for a in theirs.arms if a.name in ("default", "bi-tuned-gemm")]
    assert mine.engine.required_version == "0.33.0"
    assert mine.engine.args == theirs.engine.args and mine.engine.kind == theirs.engine.kind
    assert mine.engine.model == ("/tmp/model/qwen3-1.7b-config" if "17b" in name
                                 else theirs.engine.model)
    assert (mine.engine.engines_concurrent is False) == name.endswith("-serial")
    w_mine, w_theirs = mine.workload.model_dump(), theirs.workload.model_dump()
    assert {k: v for k, v in w_mine.items() if w_theirs[k] != v} == workload_changes
    assert mine.rule.labels == theirs.rule.labels and mine.rule.cost.margin == 0.05
    assert mine.rule.cost.metric == theirs.rule.cost.metric
    reg = load_registration(ROOT / "preregistrations" / f"{name}.json")
    assert reg.experiment().resolved() == mine.resolved()
    # sealed with the package-index check off (BISTAT_PACKAGE_INDEX=off): the seal says so; the
    # newest release was checked later (test_each_tuned_gemm_release_was_checked_after_its_seal)
    release = reg.sealed["engine_release"]
    assert (release["package"], release["index"], release["newest"]) == ("vllm", "off", None)
    assert "BISTAT_PACKAGE_INDEX=off" in release["error"]


@pytest.mark.parametrize("name", sorted(TUNED_GEMM_V033_COMPILED))
def test_the_compiled_tuned_gemm_study_adds_one_arm_that_opts_out_of_breakable_graphs(name):
    """Its base study with a third arm: bi-tuned-gemm's environment plus
    VLLM_USE_BREAKABLE_CUDAGRAPH=0 (torch.compile, as the default arm); more passes (its design
    analysis at the prior CV); sealed with the newest release checked on PyPI."""
    from bistat.declare.prereg import load_registration

    base, workload_changes = TUNED_GEMM_V033_COMPILED[name]
    mine, theirs = load_experiment(EXP / f"{name}.toml"), load_experiment(EXP / f"{base}.toml")
    tuned = next(a for a in theirs.arms if a.name == "bi-tuned-gemm")
    assert [(a.name, a.role, a.env) for a in mine.arms] == [
        *[(a.name, a.role, a.env) for a in theirs.arms],
        ("bi-tuned-gemm-compiled", "treatment", {**tuned.env, "VLLM_USE_BREAKABLE_CUDAGRAPH": "0"})]
    assert mine.engine == theirs.engine and mine.rule == theirs.rule
    w_mine, w_theirs = mine.workload.model_dump(), theirs.workload.model_dump()
    assert {k: v for k, v in w_mine.items() if w_theirs[k] != v} == workload_changes
    assert mine.design.expected_cv == 0.1
    reg = load_registration(ROOT / "preregistrations" / f"{name}.json")
    assert reg.experiment().resolved() == mine.resolved()
    release = reg.sealed["engine_release"]
    assert (release["package"], release["index"], release["error"]) == (
        "vllm", "https://pypi.org/pypi", None)
    assert release["newest"] == "0.34.0"  # one release past the 0.33.0 the study requires


@pytest.mark.parametrize("name", sorted(TUNED_GEMM_V034))
def test_the_034_studies_are_the_033_compiled_study_on_the_newest_release(name):
    """h200-v033-i23-latency-qwen3-8b-b8-compiled with only the required release changed to
    0.34.0 (and, in the H100 twin, the H200's table named in both tuned arms); sealed with PyPI
    checked, its newest release the one required: the finding will say it ran on the newest."""
    from bistat.declare.prereg import load_registration

    mine = load_experiment(EXP / f"{name}.toml")
    theirs = load_experiment(EXP / "h200-v033-i23-latency-qwen3-8b-b8-compiled.toml")
    assert mine.engine.required_version == "0.34.0"
    assert mine.engine.model_dump() == {**theirs.engine.model_dump(), "required_version": "0.34.0"}
    extra = TUNED_GEMM_V034[name]
    assert [(a.name, a.role, a.env) for a in mine.arms] == [
        (a.name, a.role, {**a.env, **(extra if a.env["BISTAT_TUNED_GEMM"] == "1" else {})})
        for a in theirs.arms]
    assert mine.workload == theirs.workload and mine.rule == theirs.rule
    assert mine.design == theirs.design and mine.validity == theirs.validity
    reg = load_registration(ROOT / "preregistrations" / f"{name}.json")
    assert reg.experiment().resolved() == mine.resolved()
    release = reg.sealed["engine_release"]
    assert (release["package"], release["index"], release["error"], release["newest"]) == (
        "vllm", "https://pypi.org/pypi", None, "0.34.0")

@pytest.mark.parametrize("name", sorted(TUNED_GEMM_V034_NEXT))
def test_the_next_034_studies_change_their_base_only_where_stated(name):
    """Each is its base declaration on 0.34.0 with the workload (and model) changed only where the
    table says; the latency ones keep the batch-8 study's three arms, the throughput one the
    default against the compiled tuned arm; sealed with PyPI checked, the newest 0.34.0."""
    from bistat.declare.prereg import load_registration

    base, workload_changes, model = TUNED_GEMM_V034_NEXT[name]
    mine, theirs = load_experiment(EXP / f"{name}.toml"), load_experiment(EXP / f"{base}.toml")
    assert mine.engine.model_dump() == {**theirs.engine.model_dump(), "required_version": "0.34.0",
                                        "model": model or theirs.engine.model}
    b8 = load_experiment(EXP / "h200-v034-i23-latency-qwen3-8b-b8-compiled.toml")
    arms = [(a.name, a.role, a.env) for a in b8.arms]
    expected = arms if "latency" in name else [arms[0], arms[2]]
    assert [(a.name, a.role, a.env) for a in mine.arms] == expected
    w_mine, w_theirs = mine.workload.model_dump(), theirs.workload.model_dump()
    assert {k: v for k, v in w_mine.items() if w_theirs[k] != v} == workload_changes
    assert mine.rule == theirs.rule and mine.validity == theirs.validity
    reg = load_registration(ROOT / "preregistrations" / f"{name}.json")
    assert reg.experiment().resolved() == mine.resolved()
    release = reg.sealed["engine_release"]
    assert (release["index"], release["error"], release["newest"]) == (
        "https://pypi.org/pypi", None, "0.34.0")

@pytest.mark.parametrize("name", sorted(TUNED_GEMM_V034_CONCURRENT))
def test_the_concurrent_workload_i_study_is_the_serial_one_with_its_engines_up_together(name):
    """Registered 2026-12-03 after the serial run (a pilot: 25 engine starts could not fit a
    session): the same engine, arms, workload and rule but the engines up together and 66 passes,
    which the design analysis on the pilot's timings and CV puts within the declared budget."""
    from bistat.declare.design_report import analyse_design
    from bistat.declare.prereg import load_registration

    base = TUNED_GEMM_V034_CONCURRENT[name]
    mine, theirs = load_experiment(EXP / f"{name}.toml"), load_experiment(EXP / f"{base}.toml")
    assert mine.engine.model_dump() == {**theirs.engine.model_dump(), "engines_concurrent": True}
    assert [(a.name, a.role, a.env) for a in mine.arms] == [
        (a.name, a.role, a.env) for a in theirs.arms]
    w_mine, w_theirs = mine.workload.model_dump(), theirs.workload.model_dump()
    assert {k: v for k, v in w_mine.items() if w_theirs[k] != v} == {"passes": 66}
    assert mine.rule == theirs.rule and mine.validity == theirs.validity
    assert (mine.design.cv_from, mine.design.time_budget_s) == (f"data/h200-v034/{base}", 1350)
    report = analyse_design(mine, base_dir=ROOT)
    # the pilot's 11 pairs of passes (by round of the schedule; by pass index, as planned when
    # it was sealed, 6: too few to check) put Welch's interval at risk; the seal keeps what was
    # planned then, no warning
    (warning,) = report.warnings
    assert round(report.cv, 3) == 0.101 and report.cost.serial.pairs == 11
    assert warning.startswith("rule.cost (") and "the welch interval assumes each arm's " \
        "passes independent" in warning and "covers about 79 %" in warning
    d = report.duration
    assert (d.engines_concurrent, d.engine_starts, d.engines_per_start, d.passes) == (
        True, 1, 2, 134)
    assert d.fits is True and 1100 < d.seconds < 1200
    reg = load_registration(ROOT / "preregistrations" / f"{name}.json")
    assert reg.experiment().resolved() == mine.resolved()
    assert reg.sealed["design"]["warnings"] == []
    release = reg.sealed["engine_release"]
    assert (release["index"], release["error"], release["newest"]) == (
        "https://pypi.org/pypi", None, "0.34.0")
    # sealed before any data of its own: its one recorded run (a pilot, stopped at 110 of 134
    # passes) was created after the seal
    run = json.loads((ROOT / "data" / "h200-v034" / name / "run.json").read_text())
    assert reg.sealed_utc < run["created_utc"] == "2026-12-03T15:30:59.080775Z"


@pytest.mark.parametrize("name", sorted(TUNED_GEMM_V034_PAIRED))
def test_the_paired_workload_i_study_is_the_concurrent_one_sized_to_fit_with_its_passes_paired(
        name):
    """Registered 2026-12-03 after the concurrent run's pilot (110 of 134 passes in the time a
    session leaves after staging): the same engine, arms, workload, match, validity and labels,
    32 passes per arm, and a cost rule that pairs the passes; the design analysis plans the cost
    from the pilot's pairs and puts the run within the declared budget."""
    from bistat.declare.design_report import analyse_design, paired_cv_from_run
    from bistat.declare.prereg import load_registration

    base = TUNED_GEMM_V034_PAIRED[name]
    mine, theirs = load_experiment(EXP / f"{name}.toml"), load_experiment(EXP / f"{base}.toml")
    assert mine.engine == theirs.engine and mine.match == theirs.match
    assert [(a.name, a.role, a.env) for a in mine.arms] == [
        (a.name, a.role, a.env) for a in theirs.arms]
    w_mine, w_theirs = mine.workload.model_dump(), theirs.workload.model_dump()
    assert {k: v for k, v in w_mine.items() if w_theirs[k] != v} == {"passes": 32}
    assert mine.validity == theirs.validity and mine.rule.labels == theirs.rule.labels
    assert mine.rule.cost.model_dump() == {**theirs.rule.cost.model_dump(), "interval": "paired"}
    assert (mine.design.cv_from, mine.design.time_budget_s) == (f"data/h200-v034/{base}", 1000)
    report = analyse_design(mine, base_dir=ROOT)
    assert report.warnings == ()
    pilot = ROOT / "data" / "h200-v034" / base
    assert report.cost.cv == pytest.approx(paired_cv_from_run(pilot)[0])
    at_one = dict(report.cost.outcomes)[1.0]
    # sealed at 0.975 by a plan that gave the paired t Welch's degrees of freedom (about 2n - 2);
    # with the paired t's n - 1 (2026-12-03, later) the same pairs plan 0.971: still above the
    # power target, and the seal keeps what was planned then
    assert round(at_one["no measurable cost"], 3) == 0.971
    d = report.duration
    assert (d.engines_concurrent, d.engine_starts, d.passes, d.fits) == (True, 1, 66, True)
    assert 790 < d.seconds < 810
    reg = load_registration(ROOT / "preregistrations" / f"{name}.json")
    assert reg.experiment().resolved() == mine.resolved()
    sealed_at_one = dict((r, p) for r, p in reg.sealed["design"]["cost"]["outcomes"])[1.0]
    assert sealed_at_one["no measurable cost"] == 0.975235
    release = reg.sealed["engine_release"]
    assert (release["index"], release["error"], release["newest"]) == (
        "https://pypi.org/pypi", None, "0.34.0")
    # recorded after its seal (2026-12-04, elsewhere, imported: its NOTES.md), in data/h200-v034 only
    assert [folder for folder in ("h200", "h200-v033", "h200-v034")
            if (ROOT / "data" / folder / name).exists()] == ["h200-v034"]


@pytest.mark.parametrize("name", sorted(TUNED_GEMM_V033))
def test_each_tuned_gemm_release_was_checked_after_its_seal(name):
    """`bistat check-release` asked PyPI after the runs (the seal's check was off): one line in
    NAME.releases.jsonl beside the untouched seal, and each finding states that release with
    its time, after the run's first record, never as known at registration."""
    import json

    from bistat.declare.prereg import load_registration, release_log_checks, verify
    from bistat.declare.release_log import release_log_path

    reg = load_registration(ROOT / "preregistrations" / f"{name}.json")
    (line,) = release_log_checks(reg)
    assert (line.by, line.registration_sha256) == ("check-release", reg.sha256)
    assert (line.check.package, line.check.newest, line.check.index, line.check.error) == (
        "vllm", "0.34.0", "https://pypi.org/pypi", None)
    assert "2026-12-02T14:51:00Z" < line.check.checked_utc < "2026-12-02T14:52:00Z"
    assert verify(reg.path, runs_dirs=()).release_checks == 1
    assert release_log_path(reg.path).read_text().count("\n") == 1
    finding = ROOT / "findings" / "h200" / f"{name}.md"
    if not finding.exists():   # registered, not run (findings/not-run.toml)
        return
    run = json.loads((ROOT / "data" / "h200-v033" / name / "run.json").read_text())
    assert run["created_utc"] < line.check.checked_utc
    assert (f"vllm 0.33.0 (g4ba787ec9) is older than the newest release known, 0.34.0 "
            f"(https://pypi.org/pypi, checked {line.check.checked_utc} by `bistat check-release`, "
            f"after the run's first record ({run['created_utc']})); the newest release was "
            "unknown at registration and when the run started.") in finding.read_text()


@pytest.mark.parametrize("name", sorted(NEWEST))
def test_each_newest_vllm_rerun_is_its_earlier_study_on_0_33_under_the_default_rule(name):
    """Same engine, model and workload as the 0.25.0 study (passes aside), vLLM 0.33.0 required,
    the default rule with its cost rule, registered before any data."""
    from bistat.declare.prereg import load_registration
    from bistat.declare.template import default_rule

    mine = load_experiment(EXP / f"{name}.toml")
    theirs = load_experiment(EXP / f"{NEWEST[name]}.toml")
    assert mine.engine.required_version == "0.33.0"
    assert (mine.engine.kind, mine.engine.model, mine.engine.args) == (
        theirs.engine.kind, theirs.engine.model, theirs.engine.args)
    w_mine, w_theirs = mine.workload.model_dump(), theirs.workload.model_dump()
    for w in (w_mine, w_theirs):
        w.pop("passes"), w.pop("warmup_passes")
    assert w_mine == w_theirs
    assert (mine.match, mine.validity) == (theirs.match, theirs.validity)
    labels = [spec.label for spec in mine.rule.labels]
    assert labels == [spec.label for spec in default_rule().labels]
    assert mine.rule.labels == default_rule().labels and mine.rule.cost is not None
    reg = load_registration(ROOT / "preregistrations" / f"{name}.json")
    assert reg.experiment().resolved() == mine.resolved()
    assert reg.sealed["engine_release"]["newest"] == "0.33.0"


@pytest.mark.parametrize("name", EXPLORATORY)
def test_each_exploratory_declaration_is_its_runs_declaration_with_the_default_rule(name):
    """Sealed after the run's data, a sibling of the registration the run was recorded under:
    the same resolved declaration but for the name and the rule, which is the default rule."""
    import json

    from bistat.declare.prereg import load_registration
    from bistat.declare.template import default_rule

    base = name.removesuffix("-exploratory")
    from bistat.core.rule import CostRule

    mine = load_registration(ROOT / "preregistrations" / f"{name}.json")
    theirs = load_registration(ROOT / "preregistrations" / f"{base}.json")
    # sealed before the default cost interval became "hac": the default rule with Welch's, which
    # the seal keeps
    welch_default = default_rule().model_copy(update={"cost": CostRule(margin=0.10)})
    assert mine.experiment().rule == welch_default
    a, b = mine.experiment().resolved(), theirs.experiment().resolved()
    for data in (a, b):
        del data["name"], data["rule"]
    assert a == b
    runs = [ROOT / "data" / "h200" / base, ROOT / "data" / "h200-tp" / base,
            ROOT / "tests" / "data" / "vllm-h200" / base]
    (run,) = [r for r in runs if r.is_dir()]
    created = json.loads((run / "run.json").read_text())["created_utc"]
    assert mine.sealed_utc > created > theirs.sealed_utc


@pytest.mark.parametrize("name", sorted(HAC))
def test_each_hac_declaration_is_its_runs_declaration_with_the_cost_interval_hac(name):
    """Sealed after the run's data, a sibling of the registration the run was recorded under: the
    same resolved declaration but for the name and the rule, which is the rule that decides the
    study's cost (its own, or the default rule applied after the data) with interval = "hac"
    (cosine, "llsw"), and nothing else changed; the rule it varies keeps its own interval."""
    import json

    from bistat.declare.prereg import load_registration

    run_name, base = name.removesuffix("-hac"), HAC[name]
    mine = load_registration(ROOT / "preregistrations" / f"{name}.json")
    theirs = load_registration(ROOT / "preregistrations" / f"{run_name}.json")
    varied = load_registration(ROOT / "preregistrations" / f"{base}.json").experiment().rule
    assert varied.cost is not None and varied.cost.interval in ("welch", "paired")
    rule = mine.experiment().rule
    assert rule.cost.model_dump() == {**varied.cost.model_dump(), "interval": "hac",
                                      "hac_kernel": "cosine", "hac_bandwidth": "llsw"}
    assert rule.model_copy(update={"cost": varied.cost}) == varied
    a, b = mine.experiment().resolved(), theirs.experiment().resolved()
    for data in (a, b):
        del data["name"], data["rule"]
    assert a == b
    assert mine.experiment().resolved() == load_experiment(EXP / f"{name}.toml").resolved()
    (run,) = [r for r in (ROOT / "data").glob(f"*/{run_name}") if r.is_dir()]
    created = json.loads((run / "run.json").read_text())["created_utc"]
    assert mine.sealed_utc > created > theirs.sealed_utc
    assert mine.sealed["git"]["declaration_state"] == "clean"


def test_the_kv128_test_keeps_every_token_within_one_128_key_tile():
    """The longest chat prompt SmolLM2's template made in the pilot (52 tokens) plus the last of
    max_tokens outputs reads at most 128 keys; the arms are the pilot's FlashAttention-3 pair
    against the TRITON_ATTN reference, on the r2 study's engine settings."""
    from bistat.store.readers import read_table

    exp = _validated("h200-fa3-kv128-smollm2")
    pilot = read_table(ROOT / "data" / "h200" / "h200-match-smollm2", "responses", ["n_prompt_tokens"])
    longest = int(pilot["n_prompt_tokens"].max())
    assert longest == 52 and longest + exp.workload.max_tokens - 1 <= 128
    assert [(a.name, a.role) for a in exp.arms] == [
        ("bi-triton-attn", "control"), ("default", "treatment"), ("batch-invariant", "treatment")]
    assert exp.arm_args("bi-triton-attn")["attention_backend"] == "TRITON_ATTN"
    assert [a.env["VLLM_BATCH_INVARIANT"] for a in exp.arms] == ["1", "0", "1"]
    assert all({k: a.env[k] for k in NO_MULTICAST} == NO_MULTICAST for a in exp.arms)
    r2 = _validated("h200-match-smollm2-r2")
    assert exp.engine.args == r2.engine.args and exp.workload.source == r2.workload.source
    assert exp.workload.n_prompts == 541 and exp.workload.passes >= 4
    assert "129 or more" in r2.hypothesis   # the contrast states the same mechanism's prediction


def test_plugin_probe_holds_attention_fixed_and_swaps_only_the_gemm():
    exp = _validated("h200-plugin-probe-qwen3-8b-synth")
    assert exp.engine.kind == "vllm-offline" and "enforce_eager" not in exp.engine.args
    assert [(a.name, a.role) for a in exp.arms] == [
        ("default", "control"), ("bi-triton-attn", "treatment"), ("bi-tuned-triton-attn", "treatment")]
    assert [exp.arm_args(a.name).get("attention_backend") for a in exp.arms] == [
        None, "TRITON_ATTN", "TRITON_ATTN"]
    assert [(a.env["VLLM_BATCH_INVARIANT"], a.env["BISTAT_TUNED_GEMM"]) for a in exp.arms] == [
        ("0", "0"), ("1", "0"), ("1", "1")]
    assert all({k: a.env[k] for k in NO_MULTICAST} == NO_MULTICAST for a in exp.arms)


@pytest.mark.parametrize("base", ["h200-cost-qwen3-8b-throughput", "h200-cost-qwen3-8b-throughput-goal"])
def test_throughput_second_attempt_differs_only_as_stated(base):
    """r2 = the first attempt but for name, hypothesis (the first attempt's result added), the
    memory fraction (0.32 -> 0.29: the first ran out of memory) and the design CV (observed)."""
    first, second = _validated(base).resolved(), _validated(base.replace("throughput", "throughput-r2")).resolved()
    assert second["hypothesis"].startswith(first["hypothesis"].removesuffix("(Study 1 is)."))
    assert "0.881 (95 % interval 0.810-0.959)" in second["hypothesis"]
    for data in (first, second):
        del data["name"], data["hypothesis"]
    assert (first["engine"]["args"].pop("gpu_memory_utilization"),
            second["engine"]["args"].pop("gpu_memory_utilization")) == (0.32, 0.29)
    assert (first["design"].pop("expected_cv"), second["design"].pop("expected_cv")) == (0.04, 0.08)
    assert first == second


@pytest.mark.parametrize("name", ALL)
def test_everything_else_validates_and_the_design_is_computed(name):
    exp = _validated(name)
    assert exp.name == name
    report = analyse_design(exp)
    assert report.name == name and report.passes_per_arm == exp.workload.passes >= 4
    assert report.throughput, "every study has a throughput criterion to plan for"
    assert report.to_dict()["cv"] == exp.design.expected_cv


@pytest.mark.parametrize("name", ALL)
def test_every_vllm_process_has_multicast_off_and_no_flashinfer_sampler(name):
    exp = _validated(name)
    assert exp.engine.kind in ("vllm-server", "vllm-offline")
    assert exp.engine.args["enable_prefix_caching"] is False
    for arm in exp.arms:
        assert {k: arm.env.get(k) for k in NO_MULTICAST} == NO_MULTICAST, arm.name
        assert arm.env["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
        assert arm.env["VLLM_BATCH_INVARIANT"] == ("0" if arm.role == "control" else "1"), arm.name
    assert exp.validity.same_gpu and exp.validity.same_versions
    assert exp.validity.max_preemptions == 0


@pytest.mark.parametrize("name", MATCH)
def test_matching_study_arms_and_workload(name):
    exp = _validated(name)
    assert [a.name for a in exp.arms] == ["default", "batch-invariant", "bi-tuned-gemm",
                                          "bi-triton-attn"]
    env = {a.name: a.env for a in exp.arms}
    assert env["bi-tuned-gemm"]["BISTAT_TUNED_GEMM"] == "1"
    assert all(env[a]["BISTAT_TUNED_GEMM"] == "0" for a in ("default", "batch-invariant",
                                                             "bi-triton-attn"))
    assert exp.arm_args("bi-triton-attn")["attention_backend"] == "TRITON_ATTN"
    assert all("attention_backend" not in exp.arm_args(a) for a in ("default", "batch-invariant",
                                                                    "bi-tuned-gemm"))
    wl = exp.workload
    assert (wl.n_prompts >= 541, wl.max_tokens, wl.concurrency, wl.temperature) == (True, 256, 64, 0.0)
    assert (wl.warmup_passes, wl.order, wl.shuffle_within_pass) == (1, "abba", True)
    assert exp.engine.args.get("tensor_parallel_size", 1) == 1
    assert exp.match.unit == "token_ids+logprobs"
    floor = 16 if name in FRONT_END_FIXED else 32
    assert exp.validity.min_mean_running == floor
    assert "Prior" in exp.hypothesis


@pytest.mark.parametrize("name", FRONT_END_FIXED)
def test_front_end_settings_after_the_first_attempt(name):
    exp = _validated(name)
    assert (exp.engine.args["api_server_count"], exp.engine.args["disable_uvicorn_access_log"]) == (2, True)
    assert exp.workload.top_logprobs == 2
    assert exp.validity.min_mean_running == 16


def test_second_attempt_differs_from_the_first_only_as_stated():
    """h200-match-smollm2-r2 = h200-match-smollm2 but for name, hypothesis, the front-end
    settings, top_logprobs, the running-batch floor and the design CV (docs/STUDIES.md)."""
    first, second = _validated("h200-match-smollm2").resolved(), _validated("h200-match-smollm2-r2").resolved()
    assert "first attempt" in second["hypothesis"] and "107/541" in second["hypothesis"]
    for data in (first, second):
        del data["name"], data["hypothesis"]
        data["engine"]["args"].pop("api_server_count", None)
    assert second["engine"]["args"].pop("disable_uvicorn_access_log") is True
    assert (first["workload"].pop("top_logprobs"), second["workload"].pop("top_logprobs")) == (5, 2)
    assert (first["validity"].pop("min_mean_running"), second["validity"].pop("min_mean_running")) == (32.0, 16.0)
    assert (first["design"].pop("expected_cv"), second["design"].pop("expected_cv")) == (0.1, 0.05)
    assert first == second


@pytest.mark.parametrize("base", ["h200-match-smollm2", "h200-match-smollm2-r2", "h200-match-qwen3-8b-synth",
                                  "h200-cost-qwen3-8b-throughput", "h200-cost-qwen3-8b-throughput-r2"])
def test_rule_pairs_differ_only_in_name_and_rule(base):
    sibling = base + ("-goal" if "cost" in base else "-improved")
    a, b = _validated(base).resolved(), _validated(sibling).resolved()
    assert a["rule"] != b["rule"]
    for data in (a, b):
        del data["name"], data["rule"]
    assert a == b
    published = _validated(base).rule
    kinds = [[c.criterion for c in lab.criteria] for lab in published.labels]
    assert kinds == [["match_lower_bound", "throughput_ratio"],
                     ["match_intervals_overlap", "throughput_ratio"]]
    assert [c.statistic for lab in published.labels for c in lab.criteria
            if c.criterion == "throughput_ratio"] == ["point", "point"]


def test_improved_rule_uses_the_ratio_interval():
    rule = _validated("h200-match-qwen3-8b-synth-improved").rule
    assert [(lab.label, [c.criterion for c in lab.criteria]) for lab in rule.labels] == [
        ("working", ["match_lower_bound", "throughput_slower"]),
        ("doubtful", ["match_intervals_overlap", "throughput_not_slower"])]
    assert rule.labels[0].criteria[1].bound == 0.90
    assert rule.labels[1].criteria[1].lower_at_least == 0.95


def test_synthetic_prompts_are_valid_qwen3_token_ids():
    raw = _raw("h200-match-qwen3-8b-synth")["workload"]
    prompts = load_prompts(raw["source"], raw["n_prompts"], raw["seed"])
    assert len(prompts) == 541 and all(len(p.prompt) == 64 for p in prompts)
    assert min(min(p.prompt) for p in prompts) >= 3 and max(max(p.prompt) for p in prompts) < 151936
    assert _validated("h200-match-qwen3-8b-synth").engine.args["skip_tokenizer_init"] is True


def test_cost_workloads():
    thr = _raw("h200-cost-qwen3-8b-throughput")["workload"]
    assert (thr["n_prompts"], thr["concurrency"], thr["max_tokens_min"], thr["max_tokens"],
            thr["ignore_eos"]) == (1000, 1000, 90, 110, True)
    for name, b in (("h200-cost-qwen3-8b-latency-b8", 8), ("h200-cost-qwen3-8b-latency-b32", 32),
                    ("h200-cost-qwen3-1_7b-latency-b8", 8)):
        exp = _validated(name)
        wl = exp.workload
        # one batch of B requests per pass, the same batch every pass
        assert (wl.n_prompts, wl.concurrency, wl.max_tokens, wl.shuffle_within_pass) == (b, b, 128, False)
        assert _raw(name)["workload"]["source"].startswith("builtin:token-ids?length=128&vocab=151936&")
        assert exp.validity.min_mean_running == 0.0  # no floor: one batch per pass
        assert [c.criterion for lab in exp.rule.labels for c in lab.criteria] == ["throughput_not_slower"]
    for name in COST:
        exp = _validated(name)
        assert exp.engine.kind == "vllm-offline"
        assert exp.engine.args["load_format"] == "dummy" and exp.engine.args["skip_tokenizer_init"]
        assert [a.name for a in exp.arms] == ["default", "batch-invariant", "bi-tuned-gemm"]


#: Ran with its engines together and ran out of GPU memory (data/h200/h200-cost-qwen3-8b-throughput/
#: NOTES.md); the concurrency rule now keeps room per engine and would run it one engine at a time.
OUT_OF_MEMORY = ["h200-cost-qwen3-8b-throughput", "h200-cost-qwen3-8b-throughput-goal"]


def test_engines_of_every_study_fit_one_gpu_together():
    from bistat.declare.concurrency import resolve_engines_concurrent

    for name in ALL:
        together, why = resolve_engines_concurrent(_validated(name))
        assert together is (name not in OUT_OF_MEMORY), f"{name}: {why}"


def test_tp_declarations():
    tp2, tp1 = _validated("tp2-match"), _validated("tp1-match")
    assert tp2.engine.args["tensor_parallel_size"] == 2 and tp1.engine.args["tensor_parallel_size"] == 1
    for exp in (tp2, tp1):
        assert [(a.name, a.role) for a in exp.arms] == [("default", "control"),
                                                         ("batch-invariant", "treatment")]
        for arm in exp.arms:
            assert arm.env["VLLM_ALLREDUCE_USE_SYMM_MEM"] == "0"
        assert exp.workload.passes >= 4
    a, b = tp2.resolved(), tp1.resolved()
    for data in (a, b):
        del data["name"], data["hypothesis"]
        del data["engine"]["args"]["tensor_parallel_size"]
    assert a == b


def test_vllm_server_flags_for_tp2_and_the_triton_arm():
    pytest.importorskip("httpx")
    from bistat.engines.vllm_server import VLLMServerEngine, cli_args

    exp = _validated("tp2-match")
    args = dict(exp.arm_args("batch-invariant"))
    tp = args.pop("tensor_parallel_size")
    prefix = args.pop("enable_prefix_caching")
    eng = VLLMServerEngine(exp.engine.model, args=args, env=exp.arms[1].env,
                           tensor_parallel_size=tp, enable_prefix_caching=prefix)
    argv = eng.argv(8000)
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    assert "--no-enable-prefix-caching" in argv and "--skip-tokenizer-init" in argv
    assert {k: eng.child_env()[k] for k in NO_MULTICAST} == NO_MULTICAST
    flags = cli_args(_validated("h200-match-smollm2").arm_args("bi-triton-attn"))
    assert flags[flags.index("--attention-backend") + 1] == "TRITON_ATTN"


def _fp(*uuids: str | None) -> dict:
    return {"gpus": [{"name": "NVIDIA H200", "uuid": u, "serial": None, "driver": "580.159.04"}
                     for u in uuids], "host": "h"}


def test_same_gpu_check_with_two_gpus_per_arm():
    two = _fp("GPU-aaaa", "GPU-bbbb")
    assert same_node([two, _fp("GPU-aaaa", "GPU-bbbb")])
    assert same_node([two, _fp("GPU-bbbb", "GPU-aaaa")])       # order of devices is irrelevant
    assert not same_node([two, _fp("GPU-aaaa", "GPU-cccc")])   # one GPU swapped
    assert not same_node([two, _fp("GPU-aaaa")])               # a TP=1 arm is not the same set
    assert not same_node([two, _fp("GPU-aaaa", None)])         # an unreadable UUID fails


@pytest.mark.parametrize("name", COST)
def test_cost_studies_record_one_logprob_per_token(name):
    """Amended before data: token ids are compared, so the lightest logprob setting."""
    assert _validated(name).workload.top_logprobs == 1


def test_registration_warns_when_engines_would_restart_per_block():
    first = analyse_design(_validated("h200-cost-qwen3-8b-throughput")).warnings
    restarts, starts = [w for w in first if w.startswith("engine.engines_concurrent")]
    assert restarts == (
        "engine.engines_concurrent (auto: arms' GPU memory fractions sum to 0.96, + 3 × 0.03 "
        "headroom = 1.05 > 1; one engine at a time): every block of passes restarts its engine and "
        "repeats the warm-ups; to keep the arms' engines up together, lower gpu_memory_utilization "
        "(engine.args or each arm's args) until the fractions plus 0.03 per engine add up to at "
        "most 1, or declare engines_concurrent = false to accept the restarts")
    # and its cost rule's intervals would treat passes of one engine start as independent
    assert starts.startswith("engine.engines_concurrent: one engine at a time, so the passes of "
                             "each block share one engine start")
    second = analyse_design(_validated("h200-cost-qwen3-8b-throughput-r2")).warnings
    assert not [w for w in second if w.startswith("engine.engines_concurrent")]


def test_the_qwen3_1_7b_latency_study_differs_from_the_8b_one_only_in_model_and_hypothesis():
    """The study plan's "Qwen3-1.7B shapes too": the same workload, arms, validity and rule as the
    registered batch-8 study, on the config `scripts/device/prepare.sh` writes (28 layers)."""
    small, big = _raw("h200-cost-qwen3-1_7b-latency-b8"), _raw("h200-cost-qwen3-8b-latency-b8")
    assert small["engine"].pop("model") == "/tmp/model/qwen3-1.7b-config"
    assert big["engine"].pop("model") == "/tmp/model/qwen3-8b-config"
    for d in (small, big):
        del d["name"], d["hypothesis"]
    assert small == big
    prepare = (ROOT / "scripts" / "device" / "prepare.sh").read_text()
    assert ("--arch qwen3-1.7b --layers 28 --config-only --out /tmp/model/qwen3-1.7b-config"
            in prepare)
