"""The committed quickstart runs (examples/quickstart/) regenerate their committed findings byte for
byte, and hold what the README says they hold: the first quickstart (`bash scripts/main.sh` on a
fresh clone, 2-core CPU machine, published rule's improved form) and quickstart-r2 (the quickstart
re-registered under the default rule; its NOTES.md says the CPU was shared)."""

from pathlib import Path

import pytest

from bistat.analysis.summary import analyze_run
from bistat.declare.prereg import verify
from finding_seal import assert_regenerates

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "examples" / "quickstart" / "quickstart-20261129T113548Z"
RUN_R2 = ROOT / "examples" / "quickstart" / "quickstart-r2-20261202T132827Z"


@pytest.fixture(autouse=True)
def _repo_root(monkeypatch, tmp_path):
    """In the checkout, with the registrations' run ledgers (local, never committed) out of
    sight: a committed finding regenerates from committed files, whatever this machine has run
    under the same registration (``bash scripts/main.sh`` runs quickstart-r2 again)."""
    import bistat.analysis.summary as summary
    import bistat.declare.prereg as prereg

    monkeypatch.chdir(ROOT)
    elsewhere = lambda reg_path: tmp_path / f".{Path(reg_path).stem}.runs"  # noqa: E731
    monkeypatch.setattr(prereg, "ledger_path", elsewhere)
    monkeypatch.setattr(summary, "ledger_path", elsewhere)


@pytest.mark.parametrize("name, run", [("quickstart", RUN), ("quickstart-r2", RUN_R2)])
def test_the_quickstart_run_follows_its_registration(name, run):
    report = verify(ROOT / "preregistrations" / f"{name}.json", [run])
    assert report.ok, report.problems


def test_the_quickstart_finding_regenerates_and_says_what_the_readme_says(tmp_path):
    summary = analyze_run(RUN.relative_to(ROOT))
    assert {a.name: (a.n_prompts, a.n_matched) for a in summary.arms} == {
        "blas": (256, 247), "invariant": (256, 256)}
    (comparison,) = summary.comparisons
    assert str(getattr(comparison.verdict.label, "value", comparison.verdict.label)) == "working"
    assert_regenerates(summary, RUN.relative_to(ROOT), None, ROOT / "findings" / "quickstart.md",
                       tmp_path)


def test_quickstart_r2_is_working_by_the_default_rule_and_regenerates(tmp_path):
    """288/288 invariant, 278/288 blas (10 prompts' outputs moved between passes); McNemar 0 / 10
    discordant (p = 0.002): working. Recorded on a machine to itself (NOTES.md): the invariant
    mode's throughput is 1.33x the blas mode's, interval 1.13-1.57, so the cost is "faster"."""
    summary = analyze_run(RUN_R2.relative_to(ROOT))
    assert {a.name: (a.n_prompts, a.n_matched) for a in summary.arms} == {
        "blas": (288, 278), "invariant": (288, 288)}
    (c,) = summary.comparisons
    assert (c.mcnemar.b, c.mcnemar.c) == (0, 10)
    assert c.verdict.label.value == "working"
    assert c.verdict.cost.outcome.value == "faster"
    assert c.verdict.cost.interval.low > 1.0 and round(c.verdict.cost.ratio, 2) == 1.33
    assert summary.operator_notes.startswith("Recorded with `bistat run preregistrations/"
                                             "quickstart-r2.json`")
    assert_regenerates(summary, RUN_R2.relative_to(ROOT), None, ROOT / "findings" / "quickstart-r2.md",
                       tmp_path)
