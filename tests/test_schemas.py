"""The committed JSON Schemas: valid themselves, and every artifact the tests produce validates.

Schemas are versioned (``bistat.<kind>/1``) and changes are additive only: every object allows
fields it does not list, so a newer writer's extra fields keep old readers' schemas valid.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from helpers_explain import SCHEMAS, blas_run, invariant_run, validate, validate_run_dir

from bistat.analysis.summary import analyze_run, summary_to_dict
from bistat.analysis.anatomy import divergence_anatomy
from bistat.explain.diagnose import diagnose_run
from bistat.explain.doctor import doctor
from bistat.engines.registry import create_engine
from bistat.explain.inspect_run import inspect_run
from bistat.declare.prereg import load_registration
from bistat.analysis.probe_report import ProbeSettings
from bistat.analysis.probe_report import run_probe
from bistat.store.readers import read_header, read_jsonl

EXPECTED = {"anatomy", "diagnosis", "doctor", "environment", "events", "inspect", "metrics",
            "passes", "probe", "repro", "repro-environment", "repro-outputs", "repro-probes",
            "repro-prompt", "repro-settings", "responses", "run", "schedule", "verdict"}


def _schema(name):
    return json.loads((SCHEMAS / f"{name}.schema.json").read_text(encoding="utf-8"))


def test_the_schema_files_are_the_expected_ones_and_valid():
    assert {p.name[: -len(".schema.json")] for p in SCHEMAS.glob("*.schema.json")} == EXPECTED
    for name in sorted(EXPECTED):
        schema = _schema(name)
        jsonschema.Draft202012Validator.check_schema(schema)
        assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
        assert schema["additionalProperties"] is True, name
        assert "Changes are additive only" in schema["description"]


@pytest.mark.parametrize("which", ["blas", "invariant"])
def test_every_record_of_a_real_run_validates(tmp_path_factory, which):
    run = (blas_run if which == "blas" else invariant_run)(tmp_path_factory)
    assert validate_run_dir(run) > 200


def test_a_record_of_another_version_or_missing_a_field_fails(tmp_path_factory):
    run = blas_run(tmp_path_factory)
    rows, _ = read_jsonl(run / "responses.jsonl")
    row = dict(rows[0])
    validate({**row, "a_field_added_later": 1}, "responses.schema.json")   # additive: accepted
    with pytest.raises(jsonschema.ValidationError, match="'bistat.responses/2' does not match"):
        validate({**row, "schema": "bistat.responses/2"}, "responses.schema.json")
    del row["token_ids"]
    with pytest.raises(jsonschema.ValidationError, match="'token_ids' is a required property"):
        validate(row, "responses.schema.json")
    with pytest.raises(jsonschema.ValidationError):
        validate(read_header(run) | {"command": "bistat run"}, "run.schema.json")


def test_verdicts_anatomy_diagnosis_and_inspection_validate(tmp_path_factory):
    for run in (blas_run(tmp_path_factory), invariant_run(tmp_path_factory)):
        summary = analyze_run(run)
        for c in summary.comparisons:
            validate(c.verdict.to_dict(), "verdict.schema.json")
        for c in summary_to_dict(summary)["comparisons"]:
            validate(c["verdict"], "verdict.schema.json")
        validate(divergence_anatomy(run).to_dict(), "anatomy.schema.json")
        validate(diagnose_run(run).to_dict(), "diagnosis.schema.json")
        validate(inspect_run(run).to_dict(), "inspect.schema.json")
    validate(doctor().to_dict(), "doctor.schema.json")


def test_a_probe_report_validates(tmp_path_factory):
    run = blas_run(tmp_path_factory)
    exp = load_registration(read_header(run)["registration"]["path"]).experiment()
    report = run_probe(exp, settings=ProbeSettings(trials=1, min_fillers=2, max_fillers=4,
                                                   max_tokens=6),
                       engine_factory=create_engine)
    data = json.loads(json.dumps(report.to_json()))   # the file `bistat probe --output` writes
    validate(data, "probe.schema.json")
    assert [a["n_fillers_compared"] for a in data["arms"]] == [0] * len(data["arms"])  # 1 trial
    with pytest.raises(jsonschema.ValidationError):
        validate({**data, "outcome": "maybe"}, "probe.schema.json")
    bad_arm = {**data["arms"][0], "fillers_differing": "chat-0001"}
    with pytest.raises(jsonschema.ValidationError):
        validate({**data, "arms": [bad_arm]}, "probe.schema.json")
