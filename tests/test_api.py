"""The public API: ``from bistat import ...`` (docs/API.md) and the deprecated paths of bistat 0.1.

Each check that depends on what a process has imported (the cheap ``import bistat``, a warning
given once, ``bistat.classify`` rebound by an import of the old module) runs in a fresh
interpreter, so the order of the suite cannot decide it.
"""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import bistat
import fakes
import helpers_runner as h
from bistat.core import stats as core_stats
from bistat.core.deprecated import MOVED, REMOVED_IN

ROOT = Path(__file__).resolve().parents[1]
API_MD = ROOT / "docs" / "API.md"

#: The public names of bistat 0.1's modules (their ``__all__`` at 370809b, the last commit
#: before the stage folders), every one of which must still resolve at its old path.
OLD_PUBLIC = {
    "bistat.analysis": ["AnalysisError", "PassSummary", "Divergence", "ArmSummary",
                        "ArmEnvironment", "Comparison", "MetricsSeries", "RunSummary",
                        "analyze_run", "summary_to_dict"],
    "bistat.report": ["FindingFiles", "render_markdown", "write_finding",
                      "render_version_comparison"],
    "bistat.records": ["SCHEMA_VERSION", "RUN_SCHEMA", "TABLES", "RecordsError", "RunWriter",
                       "TableRead", "read_header", "read_jsonl", "read_table", "load_table",
                       "compact", "OUTPUTS_FILE", "OUTPUT_FIELDS", "OUTPUT_LENGTH", "TRIM_RULE",
                       "TRIM_SERVES", "trim_info", "check_trim", "COUNTING_STATUSES",
                       "pass_counts", "pass_states", "counted_passes", "ENGINE_LOGS_DIR",
                       "NOTES_FILE", "PROBE_FILE", "PROBE_GLOB", "token_sha256",
                       "logprob_sha256", "table_schema"],
    "bistat.stats": ["ALTERNATIVES", "CVResult", "Interval", "McNemarResult", "RatioResult",
                     "TostResult", "intervals_overlap", "match_fraction", "mcnemar_test",
                     "newcombe_difference", "pooled_cv", "ratio_of_geometric_means",
                     "throughput_ratio", "tost_ratio", "wilson_interval"],
    "bistat.classify": ["ActivationEvidence", "COST_SENTENCES", "CostOutcome", "CostVerdict",
                        "PairedCounts", "RatioSummary", "classify_cost", "format_decided",
                        "ArmStats", "ValidityCheck", "RunStatus", "CriterionResult",
                        "LabelResult", "Verdict", "SENTENCES", "classify"],
    # register_engine_kind is gone: a kind is registered with its adapter (register_adapter)
    "bistat.experiment": ["ENGINE_KINDS", "DeclarationError", "EngineSpec", "Arm", "Workload",
                          "Match", "Validity", "Design", "Experiment", "load_experiment",
                          "validate_experiment"],
    "bistat.prereg": ["SCHEMA", "RegistrationError", "Registration", "VerifyReport",
                      "canonical_json", "sha256_hex", "git_state", "registration_path",
                      "register", "amend", "load_registration", "find_recorded_runs", "verify",
                      "format_time", "parse_time"],
    "bistat.rule": ["Label", "DECLARABLE_LABELS", "MatchLowerBound", "MatchUpperBound",
                    "MatchIntervalsOverlap", "ThroughputRatio", "ThroughputSlower",
                    "ThroughputNotSlower", "LargeDriftsAtMost", "ControlDiverges",
                    "TreatmentBeatsControl", "ProbeConfirmed", "EngineLog", "CostRule",
                    "Criterion", "CRITERION_NAMES", "MATCH_CRITERIA", "THROUGHPUT_CRITERIA",
                    "ACTIVATION_CRITERIA", "DIRECT_ACTIVATION_CRITERIA", "LOG_MARKERS",
                    "LabelSpec", "Rule", "needs_repeat_passes"],
    "bistat.design_report": ["DesignError", "MatchDesign", "PowerAt", "ThroughputDesign",
                             "ActivationDesign", "CostDesign", "FalsePositive",
                             "LabelProbability", "DesignReport", "analyse_design", "cv_from_run",
                             "format_design"],
    "bistat.design": ["COST_OUTCOMES", "POWER_DRAWS", "POWER_SEED", "cost_outcome_probabilities",
                      "passes_to_decide", "power_mcnemar", "power_newcombe",
                      "prob_upper_bound_at_most", "expected_ratio_halfwidth",
                      "expected_ratio_interval_factor", "log_sd_from_cv",
                      "max_mismatches_tolerated", "min_passes_for_power",
                      "min_prompts_for_threshold", "power_ratio_interval_above",
                      "power_ratio_interval_below", "power_ratio_point_at_least",
                      "power_ratio_point_below", "power_tost", "prob_lower_bound_at_least",
                      "welch_df_equal_variances"],
    "bistat.version_compare": ["UpstreamChange", "ArmSide", "ArmChange", "VersionComparison",
                               "VersionCompareError", "load_upstream_changes",
                               "compare_versions"],
}


def _python(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                            text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    return result.stdout


def _documented() -> list[str]:
    return re.findall(r"^### `(\w+)`$", API_MD.read_text(encoding="utf-8"), flags=re.M)


def test_api_reference_is_current():
    result = subprocess.run([sys.executable, "-m", "cogapp", "--check", "docs/API.md"], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, (
        "docs/API.md is out of date; run `cog -r docs/API.md`\n" + result.stdout + result.stderr)


def test_import_bistat_loads_nothing_heavy():
    out = _python("""
        import sys
        import bistat
        names = dir(bistat)
        heavy = {"numpy", "pandas", "matplotlib", "scipy", "statsmodels", "pydantic", "click"}
        print(sorted({m.split(".")[0] for m in sys.modules} & heavy), "run" in names,
              sorted(m for m in sys.modules if m.startswith("bistat")))
        """)
    assert out.split() == ["[]", "True", "['bistat']"]


def test_every_documented_name_imports_and_is_its_home():
    documented = _documented()
    assert documented == [n for n in _sections_order() if n != "__version__"]
    assert set(documented) == set(bistat.__all__) - {"__version__"}
    assert len(documented) == len(set(documented))
    # the operations and the statistics a user needs are among them
    assert {"load", "register", "verify", "run", "resume", "analyze", "classify", "Rule",
            "Verdict", "Interval", "RunSummary", "Experiment", "Registration"} <= set(documented)
    assert set(core_stats.__all__) <= set(documented)
    for name in documented:
        namespace: dict = {}
        exec(f"from bistat import {name}", namespace)
        module, attribute = bistat._EXPORTS[name]
        home = importlib.import_module(module)
        assert namespace[name] is (home if attribute is None else getattr(home, attribute)), name
    assert bistat.load is importlib.import_module("bistat.declare.experiment").load_experiment
    assert bistat.analyze is importlib.import_module("bistat.analysis.summary").analyze_run
    assert bistat.wilson_interval is core_stats.wilson_interval
    with pytest.raises(AttributeError, match="module 'bistat' has no attribute 'nope'"):
        bistat.nope  # noqa: B018


def _sections_order() -> list[str]:
    """``__all__`` in the order the reference lists it: operations, statistics, types, errors."""
    def section(name: str) -> int:
        obj = getattr(bistat, name)
        if isinstance(obj, type) and issubclass(obj, BaseException):
            return 3
        if bistat._EXPORTS[name][0] == "bistat.core.stats":
            return 1
        return 2 if isinstance(obj, type) else 0
    names = [n for n in bistat.__all__ if n != "__version__"]
    return sorted(names, key=lambda n: (section(n), names.index(n)))


def test_the_statistics_give_their_values():
    # Wilson 95 % interval of 8/10: (0.4902, 0.9433) (Newcombe 1998, Table I)
    iv = bistat.wilson_interval(8, 10)
    assert (round(iv.low, 4), round(iv.high, 4), iv.method) == (0.4902, 0.9433, "wilson")
    assert isinstance(iv, bistat.Interval)


def test_the_example_in_the_reference_runs(tmp_path, monkeypatch):
    """docs/API.md's five calls, on the test suite's fake engine in place of the quickstart's, in
    a folder laid out as a fresh clone: its preregistrations/quickstart.json already there (the
    example's first line once failed on it: a registration is never overwritten)."""
    block = re.search(r"```python\n(import bistat\n.*?)```", API_MD.read_text(encoding="utf-8"),
                      flags=re.S).group(1)
    monkeypatch.chdir(tmp_path)
    fakes.install(fakes.FakeScript())
    (tmp_path / "experiments").mkdir()
    h.write_toml(tmp_path / "experiments" / "quickstart.toml",
                 {**h.declaration(), "name": "quickstart"})
    (tmp_path / "preregistrations").mkdir()
    (tmp_path / "preregistrations" / "quickstart.json").write_bytes(
        (ROOT / "preregistrations" / "quickstart.json").read_bytes())
    printed: list[tuple] = []
    namespace = {"print": lambda *args: printed.append(args)}
    exec(compile(block, "docs/API.md", "exec"), namespace)
    outcome, summary = namespace["outcome"], namespace["summary"]
    assert outcome.status == "complete" and outcome.passes_run == 10
    assert outcome.run_dir.parent == Path("runs")
    assert summary.run_id == outcome.run_dir.name
    assert printed == [("invariant", "reported as observed")]
    ledger = json.loads((tmp_path / "mine" / "quickstart.json").read_text())
    assert summary.registration_sha256 == ledger["sha256"]


def test_run_is_the_runner_package_and_calls_the_library_function():
    out = _python("""
        import inspect
        import bistat.run.runner          # the stage folder imported first
        from bistat import run
        import bistat.run.registered as registered
        print(run is bistat.run, callable(run), inspect.ismodule(run),
              inspect.signature(run) == inspect.signature(registered.run),
              run.runner is bistat.run.runner)
        """)
    assert out.split() == ["True"] * 5


def test_the_old_module_paths_warn_once_and_give_the_same_objects():
    out = _python(f"""
        import importlib, json, sys, warnings
        from bistat.core.deprecated import MOVED

        def at_home(old, name):
            moved = MOVED[old]
            if name in moved.renamed:
                module, _, attribute = moved.renamed[name].partition(":")
                return getattr(importlib.import_module(module), attribute)
            homes = [importlib.import_module(m) for m in moved.modules]
            return next(getattr(m, name) for m in homes if hasattr(m, name))

        report = {{}}
        for old, names in {OLD_PUBLIC!r}.items():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                __import__(old)   # as an import statement does (no frame of its own)
                module = sys.modules[old]
                values = [getattr(module, n) for n in names]
                values_again = [getattr(module, n) for n in names]
                __import__(old)
            report[old] = {{
                "warnings": [(w.category.__name__, str(w.message), w.filename) for w in caught],
                "not_home": [n for n, v in zip(names, values) if v is not at_home(old, n)],
                "same_twice": all(a is b for a, b in zip(values, values_again)),
            }}
        print(json.dumps(report))
        """)
    report = json.loads(out)
    for old, names in OLD_PUBLIC.items():
        moved = MOVED[old]
        warned = report[old]["warnings"]
        if old in ("bistat.analysis", "bistat.report"):   # packages now: one warning per name
            assert len(warned) == len(names), (old, warned)
            assert warned[0][1] == (f"{old}.{names[0]} is deprecated and is removed in bistat "
                                    f"{REMOVED_IN}; use {moved.modules[0]}.{names[0]} (the "
                                    "supported names: from bistat import ...)")
        else:   # one warning, at the import, naming the new home
            assert warned == [["DeprecationWarning",
                               f"{old} is deprecated and is removed in bistat {REMOVED_IN}; use "
                               f"{moved.home or moved.modules[0]} (the supported names: from "
                               "bistat import ...)", "<string>"]], (old, warned)
        assert {w[0] for w in warned} == {"DeprecationWarning"}
        assert {w[2] for w in warned} == {"<string>"}    # the line that imports or looks it up
        assert report[old]["not_home"] == [], old
        assert report[old]["same_twice"], old
    renamed = _python("""
        import warnings
        warnings.simplefilter("ignore", DeprecationWarning)
        from bistat.classify import RunStatus
        from bistat.analysis import Comparison
        from bistat.experiment import ENGINE_KINDS
        import bistat.core.classify, bistat.analysis.summary, bistat.engines.registry
        print(RunStatus is bistat.core.classify.RunTestable,
              Comparison is bistat.analysis.summary.ArmComparison,
              ENGINE_KINDS is bistat.engines.registry.ENGINE_KINDS)
        """)
    assert renamed.split() == ["True"] * 3


def test_bistat_classify_stays_callable_after_the_old_module_is_imported():
    """``bistat.classify`` is the function; importing the old module ``bistat.classify`` rebinds
    the package's attribute to the alias, which classifies when called."""
    out = _python("""
        import warnings
        warnings.simplefilter("ignore", DeprecationWarning)
        from bistat import classify as first
        from bistat.core.classify import ArmStats, classify as real
        from bistat.core.rule import Rule
        import bistat.classify as old
        from bistat import classify as after
        rule = Rule.model_validate({"labels": [{"label": "working", "all": [
            {"criterion": "match_lower_bound", "arm": "treatment", "at_least": 0.9}]}],
            "otherwise": "doubtful"})
        control = ArmStats("c", "control", 100, 80, ())
        treatment = ArmStats("t", "treatment", 100, 100, ())
        verdicts = {f(rule, control, treatment).label.value for f in (first, real, old, after)}
        print(first is real, after is old, old.classify is real, sorted(verdicts))
        """)
    assert out.strip() == "True True True ['working']"


def test_the_aliases_name_the_release_that_removes_them():
    for old in MOVED:
        if old in ("bistat.analysis", "bistat.report"):
            continue
        path = ROOT / "src" / Path(*old.split(".")).with_suffix(".py")
        assert f"removed in bistat {REMOVED_IN}" in " ".join(path.read_text().split()), path
