"""``bistat new NAME`` through CliRunner: the commented declaration with the default rule, which
validates, registers and is never overwritten."""

from __future__ import annotations

import datetime as dt
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner

from bistat.declare import prereg
from bistat.cli import cli
from bistat.declare.experiment import load_experiment
from bistat.declare.template import DEFAULT_RULE_TOML, default_rule


@pytest.fixture
def work(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(prereg, "_utcnow",
                        lambda: dt.datetime(2026, 12, 2, 9, 0, tzinfo=dt.timezone.utc))
    return tmp_path


def test_new_writes_a_declaration_that_registers_under_the_default_rule(work):
    result = CliRunner().invoke(cli, ["new", "my-study"], catch_exceptions=False)
    assert result.exit_code == 0
    assert result.output == ("wrote experiments/my-study.toml\n"
                             "next: bistat design experiments/my-study.toml  (then: bistat "
                             "register experiments/my-study.toml)\n")
    text = Path("experiments/my-study.toml").read_text()
    assert text.startswith("# my-study: written by `bistat new my-study`.")
    assert text.endswith(DEFAULT_RULE_TOML)   # the rule verbatim, its comments included
    exp = load_experiment("experiments/my-study.toml")
    assert exp.name == "my-study" and exp.rule == default_rule()
    # the hypothesis assumes no cost: [rule.cost] measures it (the invariant GEMM was faster
    # than BLAS in recorded runs, so "costs throughput" was a claim the data refute)
    assert "costs throughput" not in text
    assert exp.hypothesis.endswith("What the invariant GEMM does to throughput is not assumed: "
                                   "[rule.cost] measures it (it depends on the machine's BLAS "
                                   "and load).")
    assert tomllib.loads(text)["rule"]["cost"] == {"metric": "throughput", "margin": 0.1,
                                                   "confidence_level": 0.95, "interval": "hac",
                                                   "hac_kernel": "cosine",
                                                   "hac_bandwidth": "llsw"}
    result = CliRunner().invoke(cli, ["register", "experiments/my-study.toml"],
                                catch_exceptions=False)
    assert result.exit_code == 0
    assert "Registered 'my-study' in preregistrations/my-study.json" in result.output
    assert "Activation criteria (288 prompts" in result.output
    sealed = prereg.load_registration("preregistrations/my-study.json")
    assert sealed.declaration["rule"]["cost"]["margin"] == 0.1
    assert [fp["scenario"] for fp in sealed.design["false_positives"]] == ["A/A"]


def test_new_never_overwrites_and_refuses_bad_names(work):
    assert CliRunner().invoke(cli, ["new", "x"]).exit_code == 0
    again = CliRunner().invoke(cli, ["new", "x"])
    assert again.exit_code == 1
    assert again.output == ("Error: experiments/x.toml already exists; a declaration is never "
                            "overwritten: choose another NAME or edit the file\n")
    bad = CliRunner().invoke(cli, ["new", "Bad Name"])
    assert bad.exit_code == 1
    assert bad.output == ("Error: 'Bad Name' is not a valid name; use lower-case letters, "
                          "digits, '-' and '_', starting with a letter or digit\n")
    other = CliRunner().invoke(cli, ["new", "y", "--experiments-dir", "decl"])
    assert other.exit_code == 0 and Path("decl/y.toml").is_file()


def test_the_template_names_every_engine_kind_a_declaration_accepts(work):
    """The comment beside ``kind`` lists the kinds ``engine.kind`` accepts, each once, in the
    registry's order (it once stopped at ``openai``, without sglang-server and command-server)."""
    from bistat.engines.registry import ENGINE_KINDS

    assert CliRunner().invoke(cli, ["new", "kinds"]).exit_code == 0
    line = next(line for line in Path("experiments/kinds.toml").read_text().splitlines()
                if line.startswith("kind = "))
    listed = line.split("#", 1)[1].strip().split(" | ")
    assert listed == list(ENGINE_KINDS)
    assert {"embedded", "vllm-server", "vllm-offline", "openai", "sglang-server",
            "command-server"} <= set(listed)
