import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from bistat.cli import cli
from bistat.report.index import read_finding

ROOT = Path(__file__).resolve().parents[1]



def _latest_vllm_check() -> tuple[str, str]:
    """The latest PyPI check of vLLM any sealed registration recorded, read from the files here
    (not through the index's code): (checked_utc, the registration's name; of registrations
    checked at the same second, the first by path)."""
    checks = []
    for path in sorted((ROOT / "preregistrations").glob("*.json")):
        release = json.loads(path.read_text())["sealed"].get("engine_release") or {}
        if release.get("package") == "vllm" and release.get("newest"):
            checks.append((release["checked_utc"], path.stem))
    latest = max(c for c, _ in checks)
    return latest, next(name for c, name in checks if c == latest)

def _finding(name: str, rule: str, analysis: str, rows: list[str], engine: str = "vLLM 0.25.0",
             gpu: str = "NVIDIA H200", run: str = "r1") -> str:
    """A finding as bistat.report.finding writes its head, Summary and verdict headings."""
    title = f"# Finding: {name}" + (" — exploratory analysis, not a test of the hypothesis"
                                    if analysis == "exploratory" else "")
    heads = "".join(f"### {r.split(' | ')[0].strip('| ')} (treatment) vs "
                    f"{r.split(' | ')[1]} (control): **{r.split(' | ')[3].strip('*')}**\n\n"
                    for r in rows)
    return (f"{title}\n\nVerdict: ...\n\n## Hypothesis\n\n> It holds.\n\n## Summary\n\n"
            f"Engine: {engine} · GPU: {gpu} · model: `m` · run: `{run}` · rule: "
            f"`preregistrations/{rule}.json` ({analysis})\n\n"
            "| treatment | control | backend | invariant? | matched / compared | 95 % interval | "
            "cost | ratio | interval |\n|---|---|---|---|---|---|---|---|---|\n"
            + "\n".join(rows) + f"\n\n## Verdict\n\n{heads}")


def test_index_has_one_table_per_engine_and_gpu_with_the_rule_in_each_row(tmp_path):
    sub = tmp_path / "h200"
    sub.mkdir()
    bi = ("| bi | default | vllm-server, TRITON_ATTN | *{label}* | 541 / 541 | [0.9929, 1.0000] | "
          "{cost} | {ratio} | {iv} |")
    (sub / "s.md").write_text(_finding("s", "s", "confirmatory", [bi.format(
        label="reported as observed", cost="— (no cost rule)", ratio="0.9690",
        iv="[0.8780, 1.0690]")]))
    (sub / "s-exploratory.md").write_text(_finding("s-exploratory", "s-exploratory",
                                                   "exploratory", [bi.format(
        label="working", cost="undecidable (throughput)", ratio="0.9690",
        iv="[0.8780, 1.0690]")]))
    (tmp_path / "q.md").write_text(_finding(
        "q", "q", "confirmatory", ["| inv | blas | embedded, gemm invariant | *working* | "
                                   "288 / 288 | [0.9868, 1.0000] | costs (throughput) | 0.7400 | "
                                   "[0.6900, 0.8000] |"], engine="embedded 0.1.0", gpu="no GPU",
        run="q1"))
    (sub / "b.md").write_text(
        "# Finding: b\n\n## Hypothesis\n\n> It holds.\n\n## Verdict\n\n"
        "### x (treatment) vs c (control): **untested**\n\n"
        "### y (treatment) vs c (control): **reported as observed**\n")
    result = CliRunner().invoke(cli, ["index", str(tmp_path)], catch_exceptions=False)
    assert result.exit_code == 0
    lines = (tmp_path / "README.md").read_text().splitlines()
    body = lines[lines.index("## embedded 0.1.0 on no GPU"):]
    assert body == [
        "## embedded 0.1.0 on no GPU", "",
        "| run | model | arm vs control | backend | invariant? | matched / compared | interval | "
        "cost | ratio | interval | rule |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        "| `q1` | `m` | inv vs blas | embedded, gemm invariant | *working* | 288 / 288 | "
        "[0.9868, 1.0000] | costs (throughput) | 0.7400 | [0.6900, 0.8000] | [q](q.md) "
        "(confirmatory) |", "",
        "## vLLM 0.25.0 on NVIDIA H200", "",
        "| run | model | arm vs control | backend | invariant? | matched / compared | interval | "
        "cost | ratio | interval | rule |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        "| `r1` | `m` | bi vs default | vllm-server, TRITON_ATTN | *reported as observed* | "
        "541 / 541 | [0.9929, 1.0000] | — (no cost rule) | 0.9690 | [0.8780, 1.0690] | "
        "[s](h200/s.md) (confirmatory) |",
        "|  | `m` | bi vs default | vllm-server, TRITON_ATTN | *working* | 541 / 541 | "
        "[0.9929, 1.0000] | undecidable (throughput) | 0.9690 | [0.8780, 1.0690] | "
        "[s-exploratory](h200/s-exploratory.md) (exploratory) |", "",
        "## Findings without a summary", "",
        "Written before findings carried a Summary section; their verdicts as headed.", "",
        "| finding | treatment vs control | verdict |",
        "|---|---|---|",
        "| [b](h200/b.md) | x vs c | *untested* |",
        "|  | y vs c | *reported as observed* |"]
    assert read_finding(sub / "b.md").hypothesis == "It holds."
    assert read_finding(sub / "s-exploratory.md").name == "s-exploratory"
    assert read_finding(sub / "s-exploratory.md").summary.analysis == "exploratory"


def test_a_file_without_verdicts_is_refused(tmp_path):
    (tmp_path / "notes.md").write_text("# Notes\n")
    result = CliRunner().invoke(cli, ["index", str(tmp_path)])
    assert result.exit_code == 1
    assert result.output == (f"Error: {tmp_path / 'notes.md'}: no verdict heading found; is it a "
                             "finding written by `bistat analyze`?\n")


@pytest.fixture(scope="module")
def regs(tmp_path_factory):
    """Sealed registrations of the quickstart declaration named done, later and silent."""
    import tomllib

    from bistat.declare.prereg import register

    tmp = tmp_path_factory.mktemp("regs")
    regs = tmp / "preregistrations"
    regs.mkdir()
    text = (ROOT / "experiments" / "quickstart.toml").read_text()
    for name in ["done", "later", "silent"]:
        decl = tmp / f"{name}.toml"
        decl.write_text(text.replace('name = "quickstart"', f'name = "{name}"'))
        assert tomllib.loads(decl.read_text())["name"] == name
        register(decl, registrations_dir=regs)
    return regs


def _findings(tmp_path, regs):
    """A findings folder holding a finding named done, beside a copy of ``regs``."""
    import shutil

    findings = tmp_path / "findings"
    findings.mkdir()
    (findings / "a.md").write_text(
        "# Finding: done\n\n## Verdict\n\n### x (treatment) vs c (control): **working**\n")
    shutil.copytree(regs, tmp_path / "preregistrations")
    return findings, tmp_path / "preregistrations"


def test_registrations_without_a_finding_are_listed_with_their_reasons(tmp_path, regs):
    findings, regs = _findings(tmp_path, regs)
    reasons = tmp_path / "not-run.toml"
    reasons.write_text('[not_run]\nlater = "device time"\n')
    result = CliRunner().invoke(cli, ["index", str(findings), "--registrations", str(regs),
                                      "--reasons", str(reasons)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    lines = (findings / "README.md").read_text().splitlines()
    tail = lines[lines.index("## Registered, no finding yet"):]
    # the reasons file named from the folder above the findings, however it was given
    assert tail[2] == ("Sealed before any data and not run (or not analysed) so far; the reason as "
                       "stated by the people running the studies (`not-run.toml`).")
    assert [row.split(" | ")[0::2] for row in tail[6:]] == [
        ["| [later](../preregistrations/later.json)", "device time |"],
        ["| [silent](../preregistrations/silent.json)", "*no reason stated* |"]]
    # without options: the options the index records, so it is written whole again
    written = (findings / "README.md").read_text()
    result = CliRunner().invoke(cli, ["index", str(findings)], catch_exceptions=False)
    assert result.output.startswith(f"with the options {findings}/README.md was written with: "
                                    "--registrations ")
    assert (findings / "README.md").read_text() == written


@pytest.mark.parametrize("toml, message", [
    ('[not_run]\ndone = "x"\n', "not_run.done is stated, but done has a finding; remove the line"),
    ('[not_run]\nnope = "x"\n', "not_run.nope names no registration in {regs}; fix the name or "
                                "remove the line"),
    ('[not_run]\nlater = ""\n', "field not_run.later must be a non-empty string"),
    ('later = "x"\n', "expected one table [not_run] of NAME = \"reason\" lines, got later"),
    ("[not_run\n", "not a readable TOML file"),
])
def test_bad_reasons_name_the_file_and_the_field(tmp_path, regs, toml, message):
    findings, regs = _findings(tmp_path, regs)
    reasons = tmp_path / "not-run.toml"
    reasons.write_text(toml)
    result = CliRunner().invoke(cli, ["index", str(findings), "--registrations", str(regs),
                                      "--reasons", str(reasons)])
    assert result.exit_code == 1
    assert result.output.startswith(f"Error: {reasons.as_posix()}: ")
    assert message.format(regs=regs) in result.output


def _mirror(tmp_path: Path) -> Path:
    """The repository's findings, README.md and not-run reasons copied into ``tmp_path``, its
    registrations linked: a tree ``bistat index`` may write into."""
    shutil.copytree(ROOT / "findings", tmp_path / "findings",
                    ignore=shutil.ignore_patterns("*.png", "local"))
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    (tmp_path / "preregistrations").symlink_to(ROOT / "preregistrations")
    return tmp_path


def test_the_committed_index_is_current(tmp_path, monkeypatch):
    """findings/README.md and the README's results at a glance as `bistat index findings
    --registrations preregistrations --reasons findings/not-run.toml --readme README.md` writes
    them (from the repository root); and `bistat index` without options, reading the options
    the index records, writes the same bytes again."""
    from bistat.report.index import write_index

    monkeypatch.chdir(_mirror(tmp_path))
    write_index("findings", "preregistrations", "findings/not-run.toml", "README.md")
    assert (tmp_path / "findings" / "README.md").read_text() == (
        ROOT / "findings" / "README.md").read_text()
    assert (tmp_path / "README.md").read_text() == (ROOT / "README.md").read_text()
    result = CliRunner().invoke(cli, ["index"], catch_exceptions=False)
    assert result.output == ("with the options findings/README.md was written with: "
                             "--registrations preregistrations --reasons findings/not-run.toml "
                             "--readme README.md\nwrote findings/README.md\nwrote README.md: "
                             "the results at a glance\n")
    assert (tmp_path / "findings" / "README.md").read_text() == (
        ROOT / "findings" / "README.md").read_text()
    assert (tmp_path / "README.md").read_text() == (ROOT / "README.md").read_text()


def test_index_without_options_never_deletes_what_it_cannot_write_again(tmp_path, monkeypatch):
    """An index written by an older bistat (no options line) that has the answers: `bistat
    index` without options would delete them (130 lines of the committed index, its Answers
    included); it refuses, naming the options, and leaves the file as it was. A recorded
    option whose path is gone is refused the same way."""
    from bistat.report.index import OPTIONS_LINE

    monkeypatch.chdir(_mirror(tmp_path))
    index = tmp_path / "findings" / "README.md"
    old = OPTIONS_LINE.sub("", index.read_text())
    index.write_text(old)
    result = CliRunner().invoke(cli, ["index"])
    assert result.exit_code == 1
    assert result.output == (
        "Error: findings/README.md: written with --registrations (it has 'Answers' and "
        "'Registered, no finding yet') but records no options; without them `bistat index` "
        "would delete those sections: give them, e.g. bistat index findings --registrations "
        "preregistrations --reasons findings/not-run.toml --readme README.md\n")
    assert index.read_text() == old
    index.write_text((ROOT / "findings" / "README.md").read_text())
    (tmp_path / "findings" / "not-run.toml").unlink()
    result = CliRunner().invoke(cli, ["index"])
    assert (result.exit_code, result.output) == (
        1, "Error: findings/README.md: written with reasons findings/not-run.toml, which is not "
           "there; give the options on the command line\n")
    # an index written without options records none, and is written again without them
    bare = tmp_path / "bare"
    shutil.copytree(ROOT / "findings" / "h200", bare, ignore=shutil.ignore_patterns("*.png"))
    assert CliRunner().invoke(cli, ["index", "bare"]).exit_code == 0
    first = (bare / "README.md").read_text()
    assert '<!-- bistat index options: {"readme": null, "reasons_path": null, ' \
           '"registrations_dir": null} -->' in first and "## Answers" not in first
    assert CliRunner().invoke(cli, ["index", "bare"]).output == "wrote bare/README.md\n"
    assert (bare / "README.md").read_text() == first


# --------------------------------------------------------------------------------------------
# the answers above the listing, on the committed findings and registrations


@pytest.fixture(scope="module")
def committed():
    """The committed findings' answers, and the newest releases the registrations recorded."""
    from bistat.report.index import answers, load_registrations, newest_releases, read_findings

    findings, _ = read_findings(ROOT / "findings")
    registrations = load_registrations(ROOT / "preregistrations")
    return findings, registrations, answers(findings, registrations), \
        newest_releases(registrations)


def _row(rows, engine, finding, treatment):
    (a,) = [a for a in rows if a.engine == engine and a.finding.name == finding
            and a.row.treatment == treatment]
    return a


def _cells(a):
    return (a.model, a.head_size, a.backend, a.setting, a.workload, a.row.verdict, a.row.matched,
            a.row.cost, a.row.ratio, a.row.cost_interval)


def test_answers_name_the_model_the_setting_and_the_numbers_of_study_1a_on_033(committed):
    rows = committed[2]
    finding = "h200-v033-match-smollm2"
    assert _cells(_row(rows, "vLLM 0.33.0", finding, "batch-invariant")) == (
        "SmolLM2-135M-Instruct", 64, "FLASH_ATTN (FA3)", ("VLLM_BATCH_INVARIANT=1",),
        "541 prompts, 64 at a time, ≤ 256 tokens", "*doubtful*", "83 / 541",
        "undecidable (throughput)", "1.0296", "[0.8670, 1.2226]")
    assert _cells(_row(rows, "vLLM 0.33.0", finding, "bi-fa3-pin"))[2:9] == (
        "FLASH_ATTN (FA3)", ("VLLM_BATCH_INVARIANT=1", "BISTAT_FA3_PIN=1"),
        "541 prompts, 64 at a time, ≤ 256 tokens", "*working*", "541 / 541",
        "undecidable (throughput)", "0.9720")
    assert _cells(_row(rows, "vLLM 0.33.0", finding, "bi-triton-attn"))[2:4] == (
        "TRITON_ATTN", ("VLLM_BATCH_INVARIANT=1", "--attention-backend TRITON_ATTN"))


def test_answers_on_034_say_dummy_weights_and_the_compiled_tuned_gemm(committed):
    a = _row(committed[2], "vLLM 0.34.0", "h200-v034-i23-latency-qwen3-8b-b8-compiled",
             "bi-tuned-gemm-compiled")
    assert _cells(a) == (
        "Qwen3-8B shape (36 layers, dummy weights)", 128, "FLASH_ATTN (FA3)",
        ("VLLM_BATCH_INVARIANT=1", "BISTAT_TUNED_GEMM=1", "VLLM_USE_BREAKABLE_CUDAGRAPH=0"),
        "one batch of 8, 128 tokens", "*reported as observed*", "8 / 8",
        "no measurable cost (latency)", "0.9785", "[0.9758, 0.9813]")
    assert a.gpu == "NVIDIA H200" and not a.under_load and a.mode_on


def test_answers_say_what_the_probe_found_where_one_ran(committed):
    """A row's invariant cell adds the behavioural probe's outcome (its finding's Activation
    table) where a probe ran on the arm: SGLang's deterministic arms confirmed, vLLM 0.34.0's
    mode on FA3 violated; nothing where none ran."""
    from bistat.report.index_answers import probe_words

    rows = committed[2]
    for arm in ("deterministic-fa3", "deterministic-triton", "deterministic-flashinfer"):
        a = _row(rows, "SGLang 0.5.23", "h100-sglang-match-smollm2", arm)
        assert dict(a.finding.probes)[arm] == "confirmed"
        assert probe_words(a) == "; probe: confirmed"
    assert probe_words(_row(rows, "vLLM 0.34.0", "h200-v034-match-smollm2",
                            "batch-invariant")) == "; probe: violated"
    assert probe_words(_row(rows, "vLLM 0.34.0", "h100-v034-match-smollm2",
                            "batch-invariant")) == ""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert ("[*working*, 541 / 541](findings/h100/h100-sglang-match-smollm2.md); probe: "
            "confirmed |") in readme


def test_answers_take_the_newest_confirmatory_rule_and_the_newer_run(committed):
    findings, registrations, rows, _ = committed
    names = {a.finding.name for a in rows}
    # never an exploratory analysis, never a finding whose registration is elsewhere
    assert not any(n.endswith("-exploratory") for n in names)
    assert "synthetic-example" not in names
    # two confirmatory rules for one run: the later-registered one
    assert (registrations["h200-match-smollm2-r2-improved"].registered_utc
            > registrations["h200-match-smollm2-r2"].registered_utc)
    assert "h200-match-smollm2-r2" not in names and "h200-match-smollm2-r2-improved" in names
    r2 = _row(rows, "vLLM 0.25.0", "h200-match-smollm2-r2-improved", "batch-invariant")
    assert (r2.row.verdict, r2.row.matched) == ("*doubtful*", "84 / 541")
    # the first attempt of the same study (same model, workload and settings) is older: left out
    assert "h200-match-smollm2" not in names and "h200-match-smollm2-improved" not in names
    # Study 1(b) and its TP=1 twin give one batch-invariant row, the newer run's
    (bi,) = [a for a in rows if a.engine == "vLLM 0.25.0" and a.model.startswith(
        "Qwen3-8B shape (8 layers") and a.setting == ("VLLM_BATCH_INVARIANT=1",)]
    assert (bi.finding.name, bi.model, bi.row.matched) == (
        "tp1-match", "Qwen3-8B shape (8 layers, N(0, 0.02))", "541 / 541")
    keys = [a.key() for a in rows]
    assert len(keys) == len(set(keys))


def test_a_setting_is_against_the_control_with_the_batch_invariant_switch_always_named(committed):
    rows = committed[2]
    # the control is bi-triton-attn: the FA3 arms set nothing it lacks, but batch-invariant mode
    # is on in one of them, and the other turns it off
    kv = "h200-fa3-kv128-smollm2"
    assert _row(rows, "vLLM 0.25.0", kv, "batch-invariant").setting == ("VLLM_BATCH_INVARIANT=1",)
    default = _row(rows, "vLLM 0.25.0", kv, "default")
    assert (default.setting, default.mode_on, default.workload) == (
        ("VLLM_BATCH_INVARIANT=0",), False, "541 prompts, 64 at a time, ≤ 72 tokens")
    # a control in batch-invariant mode; the arms' log paths are bistat's, not settings
    t = _row(rows, "vLLM 0.25.0", "h200-fixture-triton-attn", "bi-triton-attn")
    assert t.setting == ("VLLM_BATCH_INVARIANT=1", "--attention-backend TRITON_ATTN")
    q = _row(rows, "embedded 0.1.0", "quickstart-r2", "invariant")
    assert _cells(q)[:5] == ("SmolLM2-135M-Instruct", 64, "—", ("--gemm invariant",),
                             "288 prompts, 8 at a time, 4–16 tokens")


def test_the_committed_index_opens_with_the_answers_newest_release_first(committed):
    text = (ROOT / "findings" / "README.md").read_text()
    lines = text.splitlines()
    answers_part = text[:text.index("## Every run under every rule")]
    assert [line for line in lines if line.startswith("### ")] == [
        "### SGLang 0.5.23 on NVIDIA H100 80GB HBM3", "### vLLM 0.34.0 on NVIDIA H100 80GB HBM3",
        "### vLLM 0.34.0 on NVIDIA H200", "### vLLM 0.33.0 on NVIDIA H200",
        "### vLLM 0.25.0 on NVIDIA H200", "### embedded 0.1.0 on no GPU"]
    # SGLang's deterministic mode is its batch-invariant switch: its rows name it
    assert ("| SmolLM2-135M-Instruct | 64 | fa3, deterministic | `--enable-deterministic-inference` "
            "+ `--attention-backend fa3` | 541 prompts, 64 at a time, ≤ 256 tokens | *working*; "
            "probe: confirmed | 541 / 541 |") in text
    assert "/tmp/" not in answers_part
    checked, where = _latest_vllm_check()
    assert ("vLLM 0.25.0 is 9 minor versions older than 0.34.0, the newest release (pypi.org, "
            f"checked {checked} at the registration of {where})." in lines)
    assert ("| SmolLM2-135M-Instruct | 64 | FLASH_ATTN (FA3) | `VLLM_BATCH_INVARIANT=1` + "
            "`BISTAT_FA3_PIN=1` | 541 prompts, 64 at a time, ≤ 256 tokens | *working*; probe: confirmed | 541 / 541 "
            "| undecidable (throughput) | 0.9720 [0.8075, 1.1700] | "
            "[h200-v033-match-smollm2](h200/h200-v033-match-smollm2.md) |") in lines
    # the full listing follows, as before
    listing = lines[lines.index("## Every run under every rule"):]
    assert [line for line in listing if line.startswith("## ")] == [
        "## Every run under every rule", "## SGLang 0.5.23 on NVIDIA H100 80GB HBM3",
        "## embedded 0.1.0 on no GPU",
        "## vLLM 0.25.0 on NVIDIA H200", "## vLLM 0.33.0 on NVIDIA H200",
        "## vLLM 0.34.0 on NVIDIA H100 80GB HBM3", "## vLLM 0.34.0 on NVIDIA H200",
        "## One study on two releases or two engines",
        "## Registered, no finding yet"]
    assert "| `h200-v033-match-smollm2` | `/tmp/model/smollm2` | batch-invariant vs default |" \
        in text


def test_the_newest_release_is_the_latest_check_the_registrations_recorded(committed):
    from bistat.report.index import release_words

    newest = committed[3]["vllm"]
    # the latest check any registration recorded (a registration sealed later moves it); of
    # registrations checked at the same second, the first by path is named
    checked, where = _latest_vllm_check()
    assert checked >= "2026-12-04T22:12:17Z"   # the 19 HAC readings' shared check, or later
    assert (newest.version, newest.checked_utc, newest.where) == (
        "0.34.0", checked, f"the registration of {where}")
    assert release_words("vLLM 0.33.0", committed[3]).startswith(
        "vLLM 0.33.0 is 1 minor version older than 0.34.0, the newest release")
    assert release_words("embedded 0.1.0", committed[3]) is None


def test_the_model_table_agrees_with_the_attention_remedies_table():
    from bistat.explain.remedies import load_table, model_shape
    from bistat.report.index import MODELS, model_words

    table = load_table()
    checked = 0
    for folder, m in MODELS.items():
        shape = model_shape(f"/tmp/model/{folder}", table)
        if shape is not None:
            assert shape.head_size == m.head_size, folder
            checked += 1
    assert checked == 4
    assert model_words("/tmp/model/qwen3-8b-config/", {"load_format": "dummy"}) == (
        "Qwen3-8B shape (36 layers, dummy weights)", 128)
    assert model_words("/models/unknown-7b", {}) == ("`unknown-7b`", None)


def _v034_study_1a(findings_dir):
    """Study 1(a) on vLLM 0.34.0 as its finding's Summary would give it (the registration is the
    committed h200-v034-match-smollm2; the numbers are made up for the test)."""
    rows = [f"| {arm} | default | vllm-server, {backend} | *{label}* | {m} / 541 | "
            f"[0.9929, 1.0000] | undecidable (throughput) | 0.9800 | [0.9000, 1.0700] |"
            for arm, backend, label, m in [
                ("batch-invariant", "FLASH_ATTN (FA3)", "doubtful", 90),
                ("bi-fa3-pin", "FLASH_ATTN (FA3)", "working", 541),
                ("bi-triton-attn", "TRITON_ATTN", "working", 541),
                ("bi-plugin", "FLASH_ATTN (FA3)", "working", 541)]]
    path = findings_dir / "h200" / "h200-v034-match-smollm2.md"
    path.write_text(_finding("h200-v034-match-smollm2", "h200-v034-match-smollm2",
                             "confirmatory", rows, engine="vLLM 0.34.0",
                             run="h200-v034-match-smollm2"))
    return path


def test_a_new_release_s_finding_is_picked_up_and_wins_at_a_glance(tmp_path, monkeypatch):
    """Study 1(a) on 0.34.0 (registered, not yet run) enters the answers and the README's glance
    with no edit anywhere: its rows replace 0.33.0's for the same head size, backend and
    setting."""
    import shutil

    from bistat.report.index import (GLANCE_ROWS, README_BEGIN, README_END, glance,
                                     readme_with_glance)

    monkeypatch.chdir(ROOT)
    copy = tmp_path / "findings"
    shutil.copytree(ROOT / "findings", copy, ignore=shutil.ignore_patterns("*.png", "local"))
    _v034_study_1a(copy)
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{README_BEGIN}\n{README_END}\n")
    result = CliRunner().invoke(cli, ["index", str(copy), "--registrations", "preregistrations",
                                      "--reasons", "findings/not-run.toml", "--readme",
                                      str(readme)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    text = (copy / "README.md").read_text()
    assert ("| SmolLM2-135M-Instruct | 64 | FLASH_ATTN (FA3) | `VLLM_BATCH_INVARIANT=1` + "
            "`BISTAT_FA3_PIN=1` + `BISTAT_TUNED_GEMM=1` + `VLLM_USE_BREAKABLE_CUDAGRAPH=0` | 541 "
            "prompts, 64 at a time, ≤ 256 tokens | *working* | 541 / 541 | undecidable "
            "(throughput) | 0.9800 [0.9000, 1.0700] | "
            "[h200-v034-match-smollm2](h200/h200-v034-match-smollm2.md) |") in text
    # it has a finding now: no longer among the registrations without one
    assert "h200-v034-match-smollm2" not in text[text.index("## Registered, no finding yet"):]
    glance_rows = readme.read_text().splitlines()
    smol = [line for line in glance_rows if "SmolLM2-135M-Instruct" in line
            and line.startswith("| vLLM")]
    assert [line.split(" | ")[0] for line in smol] == ["| vLLM 0.34.0"] * 4
    assert len([line for line in glance_rows if line.startswith("| ") and "---" not in line
                and not line.startswith(("| engine", "| [", "| study"))]) == GLANCE_ROWS
    assert glance_rows[-1] == README_END and glance_rows[2] == README_BEGIN
    assert readme_with_glance(readme, [], copy / "README.md", {}).count("\n| ") == 1
    assert glance([]) == ([], 0)


def test_an_untested_finding_never_enters_the_readme_s_results(tmp_path, monkeypatch):
    """Study 1(a) on 0.34.0 with every verdict *untested* (a run that could not test it, say a
    toy run of 8 prompts stopped early): its rows are in the index's answers, but none enters
    the README's results at a glance, where a tested finding's would (the test above)."""
    from bistat.report.index import README_BEGIN, README_END

    monkeypatch.chdir(ROOT)
    copy = tmp_path / "findings"
    shutil.copytree(ROOT / "findings", copy, ignore=shutil.ignore_patterns("*.png", "local"))
    path = _v034_study_1a(copy)
    text = path.read_text()
    for label in ("working", "doubtful"):
        text = text.replace(f"| *{label}* |", "| *untested* |").replace(f"**{label}**",
                                                                       "**untested**")
    path.write_text(text)
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{README_BEGIN}\n{README_END}\n")
    result = CliRunner().invoke(cli, ["index", str(copy), "--registrations", "preregistrations",
                                      "--readme", str(readme)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "| *untested* | 541 / 541 |" in (copy / "README.md").read_text()
    glance_rows = [line for line in readme.read_text().splitlines()
                   if line.startswith("| ") and not line.startswith(("| [", "| study"))]
    assert len(glance_rows) > 2
    assert not [line for line in glance_rows if "untested" in line or "h200-v034-match" in line]


def test_the_readme_option_needs_its_markers_and_the_registrations(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    readme = tmp_path / "README.md"
    readme.write_text("# x\n")
    result = CliRunner().invoke(cli, ["index", "findings", "--readme", str(readme)])
    assert result.exit_code == 1
    assert result.output == ("Error: the README's results at a glance need the registrations "
                             "folder (--registrations)\n")
    import shutil

    copy = tmp_path / "findings"
    shutil.copytree(ROOT / "findings", copy, ignore=shutil.ignore_patterns("*.png", "local"))
    result = CliRunner().invoke(cli, ["index", str(copy), "--registrations", "preregistrations",
                                      "--readme", str(readme)])
    assert result.exit_code == 1
    assert result.output.startswith(f"Error: {readme}: needs one line '<!-- results at a glance")
    assert result.output.rstrip().endswith("where the results at a glance go; add them")
    assert readme.read_text() == "# x\n"


def test_a_summary_arm_the_registration_does_not_declare_is_refused_by_name(tmp_path, monkeypatch):
    import shutil

    monkeypatch.chdir(ROOT)
    copy = tmp_path / "findings"
    shutil.copytree(ROOT / "findings", copy, ignore=shutil.ignore_patterns("*.png", "local"))
    path = _v034_study_1a(copy)
    path.write_text(path.read_text().replace("| bi-plugin | default |", "| bi-pluggin | default |"))
    result = CliRunner().invoke(cli, ["index", str(copy), "--registrations", "preregistrations"])
    assert result.exit_code == 1
    assert result.output == (
        f"Error: {path}: arm 'bi-pluggin' of its Summary is not declared in "
        "preregistrations/h200-v034-match-smollm2.json; regenerate the finding with `bistat "
        "analyze` against that registration\n")


def test_a_machine_s_local_findings_are_never_indexed(tmp_path):
    """``bash scripts/main.sh`` writes findings/local/quickstart-r2.md: the index, and so the
    README's results at a glance, read only the project's findings."""
    from bistat.report.index import LOCAL_FINDINGS, read_findings

    shutil.copy(ROOT / "findings" / "quickstart-r2.md", tmp_path / "quickstart-r2.md")
    (tmp_path / LOCAL_FINDINGS).mkdir()
    shutil.copy(ROOT / "findings" / "quickstart-r2.md", tmp_path / LOCAL_FINDINGS / "mine.md")
    (tmp_path / "sub").mkdir()
    shutil.copy(ROOT / "findings" / "quickstart-r2.md", tmp_path / "sub" / "local.md")
    findings, _ = read_findings(tmp_path)
    assert sorted(f.path.relative_to(tmp_path).as_posix() for f in findings) == [
        "quickstart-r2.md", "sub/local.md"]
