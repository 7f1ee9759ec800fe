"""``bistat replay`` (probes around one prompt, repro pack) and ``bistat reproduce`` (the pack re-run)."""

from __future__ import annotations

import json
import struct

import click
import pytest
from click.testing import CliRunner
from helpers_explain import blas_run, validate

from bistat.analysis.anatomy import divergence_anatomy
from bistat.cli import cmd_replay
from bistat.engines.registry import create_engine
from bistat.explain.replay import ReplayError, replay_prompt, reproduce_pack, sweep_sizes


def _assert_prefill_verdict_matches_its_data(result):
    """The prefill-vs-decode status is what its recorded logprobs say, compared bitwise here: the
    blas arm may or may not differ (that depends on the BLAS kernels), but never disagree with
    the numbers it reports."""
    dec, pre = result.data["decode_logprobs"], result.data["prefill_logprobs"]
    assert len(dec) == len(pre) == result.data["positions"] > 0
    differing = [j for j, (a, b) in enumerate(zip(dec, pre))
                 if (a is None) != (b is None) or (a is not None and struct.pack("<d", a)
                                                   != struct.pack("<d", b))]
    assert result.data["first_differing_position"] == (differing[0] if differing else None)
    assert result.status == ("differs" if differing else "identical")
    assert result.data["max_abs_difference"] == max(
        (abs(a - b) for a, b in zip(dec, pre) if a is not None and b is not None), default=0.0)

PACK_SCHEMAS = {"manifest.json": "repro.schema.json", "prompt.json": "repro-prompt.schema.json",
                "settings.json": "repro-settings.schema.json",
                "outputs.json": "repro-outputs.schema.json",
                "environment.json": "repro-environment.schema.json",
                "probes.json": "repro-probes.schema.json"}


@pytest.fixture(scope="module")
def blas(tmp_path_factory):
    return blas_run(tmp_path_factory)


@pytest.fixture(scope="module")
def diverging(blas):
    return divergence_anatomy(blas).divergences[0]


@pytest.fixture(scope="module")
def pack(blas, diverging, tmp_path_factory):
    out = tmp_path_factory.mktemp("pack") / "pack"
    report = replay_prompt(blas, diverging.prompt_id, out_dir=out, max_fillers=16)
    return report


@pytest.fixture()
def cli():
    group = click.Group("bistat")
    cmd_replay.register(group)
    return group


def test_sweep_sizes():
    assert sweep_sizes(1) == [1]
    assert sweep_sizes(128) == [1, 2, 4, 8, 16, 32, 64, 128]
    with pytest.raises(ValueError, match=r"max_fillers \(0\) must be at least 1"):
        sweep_sizes(0)


def test_replay_of_a_diverging_blas_prompt(pack, diverging):
    assert pack.arm == "blas" and pack.prompt_id == diverging.prompt_id
    assert pack.alone_repeat_identical
    assert [p.n_fillers for p in pack.sweep] == [1, 2, 4, 8, 16]
    assert not all(p.identical for p in pack.sweep)      # blas: the batch changes the bits
    assert pack.reproduced_condition is not None
    _assert_prefill_verdict_matches_its_data(pack.prefill_decode)
    assert pack.prefix_cache.status == "not applicable"
    files = sorted(p.name for p in pack.pack_dir.iterdir())
    assert files == ["README.md", "environment.json", "manifest.json", "outputs.json",
                     "probes.json", "prompt.json", "reproduce.sh", "settings.json"]
    for name, schema in PACK_SCHEMAS.items():
        validate(json.loads((pack.pack_dir / name).read_text()), schema)
    outputs = json.loads((pack.pack_dir / "outputs.json").read_text())
    assert outputs["divergence"]["position"] == diverging.position
    assert outputs["divergence"]["label"] == "near-tie flip"
    ref, oth = outputs["recorded"]["reference"], outputs["recorded"]["other"]
    assert ref["token_ids"][diverging.position] != oth["token_ids"][diverging.position]
    assert [c["name"] for c in outputs["conditions"]] == [
        "alone", f"batch of {pack.reproduced_condition}"]
    prompt = json.loads((pack.pack_dir / "prompt.json").read_text())
    assert prompt["text"] and prompt["token_ids"]
    manifest = json.loads((pack.pack_dir / "manifest.json").read_text())
    assert manifest["commands"][0] == f"bistat reproduce {pack.pack_dir}"
    readme = (pack.pack_dir / "README.md").read_text()
    assert f"```sh\nbistat reproduce {pack.pack_dir}\n```" in readme
    assert (pack.pack_dir / "reproduce.sh").read_text().endswith(
        'bistat reproduce "$(dirname "$0")"\n')
    assert "copy it to the same path" in readme


def test_the_pack_reproduces_both_outputs(pack, cli):
    res = reproduce_pack(pack.pack_dir)
    assert res.reproduced and len(res.checks) == 2
    result = CliRunner().invoke(cli, ["reproduce", str(pack.pack_dir)], catch_exceptions=False)
    assert result.exit_code == 0
    assert result.output == (f"repro pack {pack.pack_dir}\n  alone: reproduced\n"
                             f"  batch of {pack.reproduced_condition}: reproduced\n"
                             "all conditions reproduced\n")


def test_a_pack_whose_outputs_do_not_reproduce_fails(pack, tmp_path, cli):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(pack.pack_dir, copy)
    data = json.loads((copy / "outputs.json").read_text())
    data["conditions"][0]["expected"]["token_sha256"] = "0" * 64
    (copy / "outputs.json").write_text(json.dumps(data))
    result = CliRunner().invoke(cli, ["reproduce", str(copy)], catch_exceptions=False)
    assert result.exit_code == 1
    assert result.output.splitlines()[1] == "  alone: NOT reproduced"


def test_a_pack_of_a_newer_schema_is_refused(pack, tmp_path, cli):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(pack.pack_dir, copy)
    data = json.loads((copy / "manifest.json").read_text())
    data["schema"] = "bistat.repro/2"
    (copy / "manifest.json").write_text(json.dumps(data))
    result = CliRunner().invoke(cli, ["reproduce", str(copy)])
    assert result.exit_code == 1
    assert result.output == (f"Error: {copy / 'manifest.json'}: field 'schema' is "
                             "'bistat.repro/2', expected 'bistat.repro/1'; upgrade bistat to "
                             "read newer packs\n")


def test_replay_of_the_invariant_arm_is_bitwise_stable(blas, diverging, tmp_path):
    rep = replay_prompt(blas, diverging.prompt_id, arm="invariant", out_dir=tmp_path / "p",
                        max_fillers=8)
    assert rep.alone_repeat_identical
    assert all(p.identical for p in rep.sweep)
    assert rep.reproduced_condition is None
    outputs = json.loads((tmp_path / "p" / "outputs.json").read_text())
    assert [c["name"] for c in outputs["conditions"]] == ["alone"]
    assert outputs["divergence"] is None and outputs["recorded"] == {}
    validate(outputs, "repro-outputs.schema.json")
    assert reproduce_pack(tmp_path / "p").reproduced


def test_replay_through_the_engine_protocol(blas, diverging, tmp_path):
    """Any engine: run_pass for the batches; prompt logprobs where the adapter offers them (the
    embedded adapter does: prefill of each prefix in the arm's GEMM mode)."""
    rep = replay_prompt(blas, diverging.prompt_id, out_dir=tmp_path / "p", max_fillers=2,
                        engine_factory=create_engine)
    _assert_prefill_verdict_matches_its_data(rep.prefill_decode)
    assert not rep.prefill_decode.detail.startswith("unsupported")
    assert rep.prefix_cache.status == "identical"
    assert rep.prefix_cache.detail.startswith("prefix caching off; the needle first after engine "
                                              "start (cold) and again (warm): bitwise identical")
    validate(json.loads((tmp_path / "p" / "probes.json").read_text()), "repro-probes.schema.json")


class _NoPromptLogprobs:
    """An adapter that offers no prompt logprobs: replay must say so, not fail."""

    def __init__(self, inner):
        self._inner = inner
        self.kind = inner.kind

    def __getattr__(self, name):
        if name == "prompt_logprobs":
            raise AttributeError(name)
        return getattr(self._inner, name)


def test_replay_reports_prefill_decode_unsupported_without_prompt_logprobs(blas, diverging,
                                                                           tmp_path):
    rep = replay_prompt(blas, diverging.prompt_id, out_dir=tmp_path / "p", max_fillers=2,
                        engine_factory=lambda exp, arm: _NoPromptLogprobs(create_engine(exp, arm)))
    assert rep.prefill_decode.status == "unsupported"
    assert rep.prefill_decode.detail.startswith("unsupported: engine kind 'embedded' returns no "
                                                "prompt logprobs through the Engine protocol")


def test_unknown_prompt_and_existing_pack_are_refused(blas, pack, cli):
    result = CliRunner().invoke(cli, ["replay", str(blas), "--prompt", "nope"])
    assert result.exit_code == 1
    assert result.output.startswith("Error: --prompt 'nope' is not a prompt of blasrun's "
                                    "workload (builtin:chat); e.g. chat-0000, chat-0001")
    with pytest.raises(ReplayError, match="already holds a repro pack; choose another --out"):
        replay_prompt(blas, pack.prompt_id, out_dir=pack.pack_dir, max_fillers=1)
    result = CliRunner().invoke(cli, ["replay", str(blas), "--prompt", pack.prompt_id,
                                      "--arm", "nope"])
    assert result.output == "Error: --arm 'nope' is not an arm of blasrun; arms: blas, invariant\n"


def test_replay_cli_writes_the_pack_in_the_working_directory(blas, diverging, cli, tmp_path,
                                                             monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli, ["replay", str(blas), "--prompt", diverging.prompt_id,
                                      "--max-fillers", "2"], catch_exceptions=False)
    assert result.exit_code == 0
    lines = result.output.splitlines()
    assert lines[0] == f"replay of prompt {diverging.prompt_id} (arm blas, run blasrun)"
    assert lines[1] == "  alone twice: identical"
    assert [ln.split(":")[0] for ln in lines[2:4]] == ["  with 1 filler(s)", "  with 2 filler(s)"]
    pack = tmp_path / "repro" / "blasrun" / f"{diverging.prompt_id}-blas"
    assert lines[-1].startswith(f"repro pack: {pack.relative_to(tmp_path)}")
    assert (pack / "manifest.json").exists()
    assert not (blas / "repro").exists()
