"""The attention-remedies table (src/bistat/data/attention_remedies.toml) and the advice words."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bistat.explain.remedies import (ModelShape, Remedy, RemedyTable, RemedyTableError, advice_lines,
                             load_table, model_shape, parse_table, remedies_for, remedy_words)

ROOT = Path(__file__).resolve().parents[1]
TABLE = load_table()


def test_every_working_remedy_names_a_finding_whose_arm_showed_it():
    working = [r for r in TABLE.remedies if r.status == "working"]
    assert working
    for r in working:
        text = (ROOT / r.finding).read_text(encoding="utf-8")
        # the arm's row of the finding's match table: every prompt identical in every pass
        row = next(line for line in text.splitlines() if line.startswith(f"| {r.arm} ("))
        assert "| 541 / 541 prompts |" in row, (r.finding, row)
        assert r.evidence.startswith("541/541 prompts bitwise identical")
        gpu = re.search(r"GPU-[0-9a-f]{8}", r.measured).group(0)
        version = re.search(r"vLLM (\d+\.\d+\.\d+)", r.measured).group(1)
        assert gpu in text and f"vLLM {version}" in text, (r.finding, version)
    r2 = (ROOT / "findings/h200/h200-match-smollm2-r2.md").read_text(encoding="utf-8")
    # "against 83-84/541 for the FlashAttention-3 arms"
    assert {re.search(rf"^\| {arm} \(.*\| (\d+) / 541 prompts \|", r2, re.M).group(1)
            for arm in ("default", "batch-invariant", "bi-tuned-gemm")} == {"83", "84"}


def test_the_fa3_pin_is_working_by_its_registered_study_on_the_newest_vllm():
    pin = next(r for r in TABLE.remedies if "BISTAT_FA3_PIN=1" in r.setting)
    assert (pin.status, pin.finding, pin.arm, pin.backend, pin.head_sizes) == (
        "working", "findings/h200/h200-v033-match-smollm2.md", "bi-fa3-pin", "FLASH_ATTN (FA3)", (64,))
    text = (ROOT / pin.finding).read_text(encoding="utf-8")
    # "against 83/541 for batch-invariant mode without the pin"; the pin's arm working by the rule
    assert re.search(r"^\| batch-invariant \(.*\| 83 / 541 prompts \|", text, re.M)
    assert "| bi-fa3-pin | default | vllm-server, FLASH_ATTN (FA3) | *working* | 541 / 541 |" in text


def test_the_model_shapes_agree_with_the_configs_bistat_builds():
    from bistat.model.synth import ARCHITECTURES

    by_path = {m.engine_model: m for m in TABLE.models}
    smol = by_path["/tmp/model/smollm2"]
    assert (smol.head_size, smol.query_heads, smol.kv_heads) == (64, 9, 3)
    for path, arch in (("/tmp/model/qwen3-8b-synth-l8", "qwen3-8b"),
                       ("/tmp/model/qwen3-8b-config", "qwen3-8b"),
                       ("/tmp/model/qwen3-1.7b-config", "qwen3-1.7b")):
        cfg = ARCHITECTURES[arch]
        assert (by_path[path].head_size, by_path[path].query_heads, by_path[path].kv_heads) == (
            cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]), path


@pytest.mark.model
def test_smollm2s_shape_is_its_config():
    from helpers_embedded import real_model_or_skip

    cfg = real_model_or_skip().config
    smol = model_shape("/tmp/model/smollm2", TABLE)
    assert (cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        smol.head_size, smol.query_heads, smol.kv_heads)


def test_a_model_is_found_by_its_path_or_its_folder_name_only():
    assert model_shape("/tmp/model/smollm2", TABLE).name == "SmolLM2-135M-Instruct"
    assert model_shape("/data/models/smollm2/", TABLE).name == "SmolLM2-135M-Instruct"
    assert model_shape("HuggingFaceTB/SmolLM2-135M-Instruct", TABLE) is None
    assert model_shape(None, TABLE) is None


def test_remedies_are_chosen_by_backend_and_head_size_working_first():
    fa3 = remedies_for("FLASH_ATTN (FA3)", 64, TABLE)
    assert [r.status for r in fa3] == ["working", "working", "working"]
    assert remedies_for("FLASH_ATTN (FA3)", 128, TABLE) == ()
    assert remedies_for("TRITON_ATTN", 64, TABLE) == ()
    assert len(remedies_for("FLASH_ATTN (FA3)", None, TABLE)) == 3
    # a remedy not yet measured comes after the working ones, whatever the table's order
    later = Remedy("FLASH_ATTN (FA3)", (64,), "`Y=1`", "not yet measured", plan="a plan")
    mixed = _table(later, *fa3)
    assert [r.status for r in remedies_for("FLASH_ATTN (FA3)", 64, mixed)] == [
        "working", "working", "working", "not yet measured"]


def _table(*remedies, models=()):
    return RemedyTable(tuple(models), tuple(remedies))


def test_advice_words():
    shape = ModelShape("/m/small", "Small", 64, 8, 2, "its config")
    works = Remedy("FLASH_ATTN (FA3)", (64,), "`X=1`", "working", "10/10 identical",
                   "findings/x.md", "x", "H200")
    plan = Remedy("FLASH_ATTN (FA3)", (64,), "`Y=1`", "not yet measured", plan="study y")
    table = _table(plan, works, models=[shape])
    assert remedy_words(works) == "`X=1`: working — 10/10 identical (`findings/x.md`, arm x; H200)"
    assert advice_lines({"a": ("FLASH_ATTN (FA3)",), "b": ("FLASH_ATTN (FA3)",), "c": ()},
                        "/m/small", table) == [
        "arm c: attention backend not in an engine log; head size 64 (Small: 8 query heads, 2 KV "
        "heads; its config)",
        "arms a, b: attention backend FLASH_ATTN (FA3) (engine log), head size 64 (Small: 8 query "
        "heads, 2 KV heads; its config)",
        "remedy for FLASH_ATTN (FA3) at head size 64: `X=1`: working — 10/10 identical "
        "(`findings/x.md`, arm x; H200)",
        "remedy for FLASH_ATTN (FA3) at head size 64: `Y=1`: not yet measured (study y)"]
    assert advice_lines({"a": ("FLASHINFER",)}, "/elsewhere/big", table) == [
        "arm a: attention backend FLASHINFER (engine log), head size not known to bistat (engine "
        "model '/elsewhere/big' is not in `src/bistat/data/attention_remedies.toml`)",
        "no remedy for FLASHINFER is in `src/bistat/data/attention_remedies.toml` yet: an arm "
        "with an attention backend of a fixed tile is the test"]


@pytest.mark.parametrize("change,message", [
    ({"schema": "x/2"}, "t.toml: field 'schema' is 'x/2', expected 'bistat.attention-remedies/1'"),
    ({"remedy": [{"backend": "B", "head_sizes": [64], "setting": "s", "status": "maybe"}]},
     "t.toml: remedy[0].status: 'maybe'; expected one of 'working', 'not yet measured'"),
    ({"remedy": [{"backend": "B", "head_sizes": [64], "setting": "s", "status": "working"}]},
     "t.toml: remedy[0]: a working remedy needs finding, evidence and measured (the study that "
     "showed it)"),
    ({"remedy": [{"backend": "B", "head_sizes": [64], "setting": "s",
                  "status": "not yet measured"}]}, "t.toml: remedy[0].plan: missing"),
    ({"remedy": [{"backend": "B", "head_sizes": 64, "setting": "s", "status": "working"}]},
     "t.toml: remedy[0].head_sizes: expected list, got int 64"),
    ({"model": [{"engine_model": "m", "name": "n", "head_size": 64, "query_heads": 1,
                 "kv_heads": 1, "source": "s", "heads": 2}]},
     "t.toml: model[0]: unknown field(s) heads; expected engine_model, name, head_size, "
     "query_heads, kv_heads, source"),
])
def test_a_malformed_table_names_the_file_the_entry_and_the_field(change, message):
    with pytest.raises(RemedyTableError) as err:
        parse_table({"schema": "bistat.attention-remedies/1", **change}, "t.toml")
    assert str(err.value).startswith(message)


def test_the_shipped_table_is_package_data(tmp_path):
    assert load_table(ROOT / "src" / "bistat" / "data" / "attention_remedies.toml") == TABLE
    bad = tmp_path / "t.toml"
    bad.write_text("schema = [", encoding="utf-8")
    with pytest.raises(RemedyTableError, match=rf"^{re.escape(str(bad))}: not valid TOML \("):
        load_table(bad)
