"""README.md is a product page: its sections in order, under 200 lines, its two commands the
real ones, and every number in it taken from a committed finding: the verdict example is quoted
from the finding, and the results at a glance are what `bistat index --readme` writes from the
findings and registrations (regenerate: `bash scripts/regenerate_findings.sh`, last line)."""

import re
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

SECTIONS = ["Two commands", "What a verdict looks like", "Results at a glance", "A declaration",
            "Commands", "Install extras", "The tuned GEMM on your GPU", "Links"]


@pytest.fixture(scope="module")
def text():
    return README.read_text(encoding="utf-8")


def _section(text: str, title: str) -> str:
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def test_the_readme_is_short_and_has_its_sections_in_order(text):
    lines = text.splitlines()
    assert len(lines) <= 200
    assert lines[0] == "# bistat"
    assert lines[2].startswith("**Does batch invariance hold on your GPU, engine release and "
                               "workload, and what does it cost?**")
    assert [line[3:] for line in lines if line.startswith("## ")] == SECTIONS


def test_the_first_two_commands_are_the_main_job_and_the_tests(text):
    commands = re.findall(r"^(bash \S+)", text, flags=re.M)
    assert commands[:2] == ["bash scripts/main.sh", "bash scripts/test.sh"]
    # what the two lines say they do is what the scripts do
    main = (ROOT / "scripts" / "main.sh").read_text()
    assert "bistat model fetch smollm2-135m" in main and "bistat run preregistrations/" \
        "quickstart-r2.json" in main and "bistat analyze" in main and "bash scripts/setup.sh" in main
    import json

    reg = json.loads((ROOT / "preregistrations" / "quickstart-r2.json").read_text())
    assert reg["sealed"]["declaration"]["engine"]["kind"] == "embedded"
    assert "python -m pytest" in (ROOT / "scripts" / "test.sh").read_text()
    assert "\nbash scripts/test.sh\n" in (ROOT / ".ci" / "run").read_text()
    assert "findings/local/quickstart-r2.md" in text and "findings/local" in main


def test_the_main_job_prints_each_result_once():
    """``bistat run`` ends with the analysis's summary (the verdicts); the ``bistat analyze`` that
    writes the finding from the same records prints nothing then (its summary would repeat it),
    and the script names the finding."""
    main = (ROOT / "scripts" / "main.sh").read_text()
    commands = [line for line in main.splitlines() if line.startswith("bistat ")]
    assert [c.split()[1] for c in commands] == ["model", "verify", "run", "analyze"]
    run, analyze = commands[2], commands[3]
    assert ">" not in run and analyze.endswith(" > /dev/null")
    assert main.rstrip().endswith('echo "finding: findings/local/quickstart-r2.md"')


def test_what_the_quickstart_must_reproduce_is_what_the_committed_run_shows(text):
    """The invariant arm's 288/288 and *working* must reproduce; the BLAS arm and the cost are
    the machine's (the committed run's numbers, quoted from its finding)."""
    two = _section(text, "Two commands")
    assert "invariant arm's **288/288**" in two and "verdict *working*" in two
    assert "BLAS 278/288, invariant mode 1.33× faster" in two
    assert "BLAS 0/288, cost undecidable at ratio 1.99, interval 0.39–10.04" in two.replace(
        "\n", " ")
    finding = (ROOT / "findings" / "quickstart-r2.md").read_text()
    assert "0.9791 (278 of 288 matched" in finding and "(ratio 1.33, 95 % interval" in finding
    assert "| invariant | blas | embedded, gemm invariant | *working* | 288 / 288 |" in finding


def test_the_verdict_example_is_quoted_from_its_finding(text):
    section = _section(text, "What a verdict looks like")
    quoted = [line[2:] for line in section.splitlines() if line.startswith("> ")]
    assert len(quoted) >= 4 and quoted[0].startswith("Verdict: **working**")
    finding = (ROOT / "findings" / "quickstart-r2.md").read_text().splitlines()
    assert [line for line in quoted if line not in finding] == []
    assert "`findings/quickstart-r2.md`" in section


def test_the_results_at_a_glance_are_current(text):
    """What `bistat index findings --registrations preregistrations --readme README.md` writes."""
    from bistat.report.index import (answers, load_registrations, newest_releases, read_findings,
                                     readme_with_glance, tax_rows)

    findings, _ = read_findings(ROOT / "findings")
    registrations = load_registrations(ROOT / "preregistrations")
    newest = newest_releases(registrations)
    fresh = readme_with_glance(README, answers(findings, registrations),
                               ROOT / "findings" / "README.md", newest,
                               tax_rows(findings, registrations, newest))
    assert fresh == text, ("README.md's results at a glance are out of date; run `bistat index "
                           "findings --registrations preregistrations --reasons "
                           "findings/not-run.toml --readme README.md`")


def test_the_results_at_a_glance_answer_in_at_most_twelve_rows(text):
    from bistat.report.index import GLANCE_ROWS

    section = _section(text, "Results at a glance")
    # the glance's rows (the tax table below it starts each row with a study's link)
    rows = [line for line in section.splitlines()
            if line.startswith("| ") and not line.startswith(("| engine |", "| [", "| study |"))]
    assert GLANCE_ROWS == 12 and 1 <= len(rows) <= GLANCE_ROWS
    assert "/tmp/" not in section
    assert "vLLM rows ran on 0.34.0 (the newest release); the newest release is 0.34.0" in section
    assert "SGLang rows ran on 0.5.23 (the newest release)" in section
    # each engine's newest release has its rows: SGLang's deterministic mode on all three backends
    # at head size 64, on fa3 and triton at 128 under changing batches, and its one-batch latency
    assert [r.split(" | ")[3:5] for r in rows if r.startswith("| SGLang 0.5.23")] == [
        ["64, fa3, deterministic", "541 prompts, 64 at a time, ≤ 256 tokens"],
        ["64, flashinfer, deterministic", "541 prompts, 64 at a time, ≤ 256 tokens"],
        ["64, triton, deterministic", "541 prompts, 64 at a time, ≤ 256 tokens"],
        ["128, fa3, deterministic", "one batch of 8, 128 tokens"],
        ["128, fa3, deterministic", "541 prompts, 64 at a time, ≤ 256 tokens"],
        ["128, triton, deterministic", "541 prompts, 64 at a time, ≤ 256 tokens"]]
    # what the mode costs in one batch is a row of its own beside the verdict under load
    assert any(r.startswith("| SGLang 0.5.23") and "costs (latency): 1.2117 [1.1983, 1.2254]" in r
               for r in rows)
    # Study 1(a) on the newest release replaced its 0.33.0 rows: TRITON_ATTN holds there; of two
    # runs of one release with the same prompts and both costs undecidable, the newer (the H100's)
    assert ("| vLLM 0.34.0 | NVIDIA H100 80GB HBM3 | SmolLM2-135M-Instruct | 64, TRITON_ATTN | 541 "
            "prompts, 64 at a time, ≤ 256 tokens | `VLLM_BATCH_INVARIANT=1` + `--attention-backend "
            "TRITON_ATTN` | [*working*, 541 / 541](findings/h100/h100-v034-match-smollm2.md) | "
            "undecidable (throughput): 0.9955 [0.8468, 1.1702] |") in rows
    # ...but a decided cost outranks a newer undecidable one: the mode as shipped on FA3 keeps
    # the H200's row (8 counted passes decided it), not the H100 twin's (4, undecidable)
    assert ("| vLLM 0.34.0 | NVIDIA H200 | SmolLM2-135M-Instruct | 64, FLASH_ATTN (FA3) | 541 "
            "prompts, 64 at a time, ≤ 256 tokens | `VLLM_BATCH_INVARIANT=1` | [*doubtful*, 82 / "
            "541](findings/h200/h200-v034-match-smollm2.md); probe: violated | no measurable cost "
            "(throughput): 1.0948 [1.0205, 1.1745] |") in rows
    # the kv-sweep probe with its negative control confirmed SGLang's deterministic arms
    assert all(r.split(" | ")[6].endswith("; probe: confirmed") for r in rows
               if r.startswith("| SGLang 0.5.23") and "541 prompts" in r and "64, " in r)
    # naming the H200's GEMM table on an H100 makes no row of its own: bistat's whole plugin
    # shows once (the H100 twin's, the newer of two undecidable costs)
    plugin = [r for r in rows if "`BISTAT_TUNED_GEMM=1` + `VLLM_USE_BREAKABLE_CUDAGRAPH=0`" in r
              and "541 prompts" in r and "SmolLM2" in r]
    assert len(plugin) == 1 and "`BISTAT_GEMM_TABLE=nvidia_h200`" in plugin[0]
    # SGLang's deterministic mode at head size 128 under load keeps its row
    assert any(r.startswith("| SGLang 0.5.23") and "no measurable cost (throughput): 0.9591" in r
               for r in rows)
    assert "[findings/README.md](findings/README.md)" in section
    for link in re.findall(r"\]\(([^)]+)\)", section):
        assert (ROOT / link).is_file(), link


def test_the_declaration_example_is_valid(text, tmp_path):
    """The example registers as it stands: bistat's loader and register's own checks accept it,
    and it asks what the results at a glance answer."""
    from bistat.declare.prereg import load_declaration, registration_problems

    section = _section(text, "A declaration")
    (toml,) = re.findall(r"```toml\n(.*?)```", section, flags=re.S)
    assert 12 <= len(toml.splitlines()) <= 20
    name = re.search(r'^name = "([^"]+)"', toml, flags=re.M)[1]
    path = tmp_path / f"{name}.toml"
    path.write_text(toml)
    exp = load_declaration(path)
    assert registration_problems(exp, path) == []
    assert [(a.name, a.role, a.env, a.args) for a in exp.arms] == [
        ("default", "control", {"VLLM_BATCH_INVARIANT": "0"}, {}),
        ("bi-triton", "treatment", {"VLLM_BATCH_INVARIANT": "1"},
         {"attention_backend": "TRITON_ATTN"})]
    assert [label.label for label in exp.rule.labels] == ["working", "doubtful"]
    assert exp.rule.cost is not None and exp.rule.cost.margin == 0.10


def test_the_links_lead_somewhere(text):
    section = _section(text, "Links")
    links = re.findall(r"\]\(([^)]+)\)", section)
    assert links[:1] == ["docs/STUDIES.md"]
    for needed in ["docs/STUDIES.md", "docs/ARCHITECTURE.md", "docs/DECLARATION.md",
                   "docs/CLI.md", "docs/RECORDS.md", "kernels/README.md", "findings/README.md",
                   "benchmarks/RESULTS.md"]:
        assert needed in links
    assert [link for link in links if not (ROOT / link).is_file()] == []


def test_a_readme_without_its_markers_is_refused_by_name(tmp_path):
    from bistat.report.index import readme_with_glance

    copy = tmp_path / "README.md"
    shutil.copy(README, copy)
    copy.write_text(copy.read_text().replace("<!-- end of the results at a glance -->\n", ""))
    with pytest.raises(ValueError, match=re.escape(f"{copy}: needs one line")):
        readme_with_glance(copy, [], ROOT / "findings" / "README.md", {})
