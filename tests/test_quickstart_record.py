"""The committed quickstart runs (examples/quickstart/) regenerate their committed findings byte for
byte, and hold what the README says they hold: the first quickstart (`bash scripts/main.sh` on a
fresh clone, 2-core CPU machine, published rule's improved form) and quickstart-r2 (the quickstart
re-registered under the default rule; its NOTES.md says the CPU was shared). Each is analysed with
the registration's run ledger unread (``run_ledger=False``, ``bistat analyze --no-run-ledger``), as
scripts/regenerate_findings.sh analyses it: the ledger is this machine's, and a run recorded here
again under the registration (``bash scripts/main.sh`` runs quickstart-r2) never enters the
committed finding."""

from pathlib import Path

import pytest

from bistat.analysis.summary import analyze_run
from bistat.declare.prereg import verify
from finding_seal import assert_regenerates

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "examples" / "quickstart" / "quickstart-20261129T113548Z"
RUN_R2 = ROOT / "examples" / "quickstart" / "quickstart-r2-20261202T132827Z"


@pytest.fixture(autouse=True)
def _repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)


@pytest.mark.parametrize("name, run", [("quickstart", RUN), ("quickstart-r2", RUN_R2)])
def test_the_quickstart_run_follows_its_registration(name, run):
    report = verify(ROOT / "preregistrations" / f"{name}.json", [run])
    assert report.ok, report.problems


def test_the_quickstart_finding_regenerates_and_says_what_the_readme_says(tmp_path):
    summary = analyze_run(RUN.relative_to(ROOT), run_ledger=False)
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
    summary = analyze_run(RUN_R2.relative_to(ROOT), run_ledger=False)
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


def test_a_run_recorded_here_again_never_enters_the_committed_finding(tmp_path, monkeypatch):
    """As after ``bash scripts/main.sh``: this machine's run ledger of quickstart-r2 lists a run
    recorded here. Read, it lists that run in the finding; ``bistat analyze --no-run-ledger``
    (what scripts/regenerate_findings.sh runs) writes the committed finding all the same."""
    import shutil

    from click.testing import CliRunner

    import bistat.analysis.summary as summary_module
    import bistat.declare.run_ledger as run_ledger
    from bistat.cli import cli
    from finding_seal import assert_same_finding

    local = tmp_path / "runs" / "quickstart-r2-20261207T075143Z"
    shutil.copytree(RUN_R2, local)
    ledger = tmp_path / ".quickstart-r2.runs"
    ledger.write_text(f"{local}\n")
    monkeypatch.setattr(run_ledger, "ledger_path", lambda reg_path: ledger)
    monkeypatch.setattr(summary_module, "ledger_path", lambda reg_path: ledger)

    read = analyze_run(RUN_R2.relative_to(ROOT))
    assert [(r.found_in, r.this) for r in read.registration_runs] == [
        ("this run", True), ("the run ledger", False)]
    assert read.runs_ledger_found is True

    out = tmp_path / "findings"
    result = CliRunner().invoke(cli, ["analyze", str(RUN_R2.relative_to(ROOT)), "--out", str(out),
                                      "--no-run-ledger"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    fresh = (out / "quickstart-r2.md").read_text()
    assert str(local) not in fresh
    assert_same_finding(fresh, (ROOT / "findings" / "quickstart-r2.md").read_text(),
                        "quickstart-r2.md")


def test_regenerate_findings_analyses_committed_files_alone(tmp_path):
    """Every analysis in scripts/regenerate_findings.sh leaves the run ledgers unread, and the
    script stops before writing anything where a folder of runs holds a file git does not
    track (here in a repository of its own, holding the script and one such file)."""
    import subprocess

    script = (ROOT / "scripts" / "regenerate_findings.sh").read_text()
    commands = [c for c in script.replace("\\\n", " ").splitlines()
                if c.lstrip().startswith("bistat analyze ")]
    assert len(commands) == 2 and all("--no-run-ledger" in c for c in commands)

    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    (repo / "scripts" / "regenerate_findings.sh").write_text(script)
    (repo / "data" / "h200" / "NAME-local").mkdir(parents=True)
    (repo / "data" / "h200" / "NAME-local" / "run.json").write_text("{}")
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    done = subprocess.run(["bash", "scripts/regenerate_findings.sh"], cwd=repo,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr.endswith("move them out, or git add them first:\n"
                                "data/h200/NAME-local/run.json\n")
    assert not (repo / "findings").exists()
