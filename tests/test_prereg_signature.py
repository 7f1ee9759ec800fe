"""Optional SSH signatures of registrations: ``register --sign KEY`` writes
NAME.json.sig (ssh-keygen -Y sign, namespace bistat); ``verify`` and ``analyze`` check it against
an allowed-signers file (``--allowed-signers`` or git's gpg.ssh.allowedSignersFile). A tampered
registration, a signature by another key or one made for another namespace fails, with a clear
message. Keys are throwaway ed25519 keys made here."""

from __future__ import annotations

import datetime as dt
import json
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from bistat.cli import cmd_analyze, cmd_register
from bistat.declare import prereg
from bistat.declare.prereg import RegistrationError, amend, register, verify
from bistat.declare.prereg_signature import (SignatureError, check_signature, sign_bytes,
                                             signature_path)

pytestmark = pytest.mark.skipif(shutil.which("ssh-keygen") is None,
                                reason="ssh-keygen (OpenSSH) is not installed")

ROOT = Path(__file__).resolve().parents[1]
DECL = ROOT / "tests" / "data" / "declarations"
T0 = dt.datetime(2026, 3, 1, 12, 0, 0, tzinfo=dt.timezone.utc)


def _keygen(path: Path, comment: str) -> tuple[Path, str]:
    """A passphrase-less ed25519 key at ``path``; returns (its path, its SHA256 fingerprint)."""
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f",
                    str(path)], check=True, capture_output=True)
    fp = subprocess.run(["ssh-keygen", "-l", "-f", f"{path}.pub"], check=True,
                        capture_output=True, text=True).stdout.split()[1]
    assert fp.startswith("SHA256:")
    return path, fp


@pytest.fixture
def keys(tmp_path_factory):
    """Two keys, ``alice`` (in the allowed-signers file) and ``mallory`` (not)."""
    d = tmp_path_factory.mktemp("keys")
    alice, alice_fp = _keygen(d / "alice", "alice")
    mallory, mallory_fp = _keygen(d / "mallory", "mallory")
    allowed = d / "allowed_signers"
    kind, key = (d / "alice.pub").read_text().split()[:2]
    allowed.write_text(f"alice@example.org {kind} {key}\n")
    return {"alice": alice, "alice_fp": alice_fp, "mallory": mallory, "mallory_fp": mallory_fp,
            "allowed": allowed}


@pytest.fixture
def work(tmp_path, monkeypatch):
    """A project outside git (no global or system git config either) with experiments/minimal.toml."""
    (tmp_path / "experiments").mkdir()
    shutil.copy(DECL / "minimal.toml", tmp_path / "experiments" / "minimal.toml")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", "/dev/null")
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    return tmp_path


def _forge(path: Path) -> None:
    """Loosen the rule and recompute both hashes (the seal still checks)."""
    data = json.loads(path.read_text())
    sealed = data["sealed"]
    sealed["declaration"]["rule"]["labels"][0]["all"][0]["at_least"] = 0.5
    sealed["declaration_sha256"] = prereg.sha256_hex(sealed["declaration"])
    data["sha256"] = prereg.sha256_hex(sealed)
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def test_a_signed_registration_verifies_with_the_signers_key(work, keys):
    reg, _ = register("experiments/minimal.toml", now=T0, sign_key=keys["alice"])
    sig = signature_path(reg.path)
    assert sig == Path("preregistrations") / "minimal.json.sig"
    assert sig.read_text().startswith("-----BEGIN SSH SIGNATURE-----\n")
    report = verify(reg.path, allowed_signers=keys["allowed"])
    assert report.ok, report.problems
    assert report.signature.line() == f"signature: valid, key {keys['alice_fp']} (alice@example.org)"
    assert report.to_dict()["signature"]["principal"] == "alice@example.org"


def test_without_an_allowed_signers_file_the_key_is_named_but_not_vouched_for(work, keys):
    reg, _ = register("experiments/minimal.toml", now=T0, sign_key=keys["alice"])
    report = verify(reg.path)
    assert report.ok, report.problems
    assert report.signature.status == "unvouched"
    assert report.signature.line() == (
        f"signature: made by key {keys['alice_fp']}, which no allowed-signers file vouches for "
        "(give --allowed-signers FILE or set git config gpg.ssh.allowedSignersFile)")


def test_a_tampered_registration_fails_its_signature(work, keys):
    reg, _ = register("experiments/minimal.toml", now=T0, sign_key=keys["alice"])
    _forge(reg.path)
    prereg.load_registration(reg.path)            # the seal alone cannot tell
    for signers in (keys["allowed"], None):
        report = verify(reg.path, allowed_signers=signers)
        assert not report.ok
        (problem,) = report.problems
        assert problem.startswith(f"{reg.path}: signature: INVALID, minimal.json.sig is not a "
                                  "signature of these bytes: the registration changed after it "
                                  "was signed"), problem
        assert "ssh-keygen: Signature verification failed: incorrect signature" in problem


def test_a_signature_by_another_key_fails(work, keys):
    reg, _ = register("experiments/minimal.toml", now=T0, sign_key=keys["alice"])
    sig = signature_path(reg.path)
    sig.write_bytes(sign_bytes(reg.path.read_bytes(), keys["mallory"]))
    report = verify(reg.path, allowed_signers=keys["allowed"])
    assert report.problems == (f"{reg.path}: signature: INVALID, made by key "
                               f"{keys['mallory_fp']}, which {keys['allowed']} does not allow",)
    # a signature of the same bytes for another purpose (git signs commits in namespace "git")
    other = subprocess.run(["ssh-keygen", "-Y", "sign", "-f", str(keys["alice"]), "-n", "git"],
                           input=reg.path.read_bytes(), capture_output=True, check=True).stdout
    sig.write_bytes(other)
    (problem,) = verify(reg.path, allowed_signers=keys["allowed"]).problems
    assert "signature: INVALID" in problem and "namespace does not match" in problem


def test_git_config_names_the_allowed_signers_file(work, keys):
    subprocess.run(["git", "init", "-q"], cwd=work, check=True)
    shutil.copy(keys["allowed"], work / ".allowed_signers")
    subprocess.run(["git", "config", "gpg.ssh.allowedSignersFile", ".allowed_signers"], cwd=work,
                   check=True)
    reg, _ = register("experiments/minimal.toml", now=T0, sign_key=keys["alice"])
    assert verify(reg.path).signature.status == "valid"
    (work / ".allowed_signers").write_text("")
    assert verify(reg.path).signature.status == "unknown-key"
    (work / ".allowed_signers").unlink()
    (problem,) = verify(reg.path).problems
    assert problem.startswith(f"{work / '.allowed_signers'} (git config "
                              "gpg.ssh.allowedSignersFile): no such allowed-signers file")


def test_a_signed_registration_is_amended_only_with_a_new_signature(work, keys):
    reg, _ = register("experiments/minimal.toml", now=T0, sign_key=keys["alice"])
    toml = work / "experiments" / "minimal.toml"
    toml.write_text(toml.read_text().replace("n_prompts = 400", "n_prompts = 300"))
    before = reg.path.read_bytes()
    with pytest.raises(RegistrationError, match=r"is signed \(.*minimal.json.sig\): an amendment "
                                                r"would leave the signature invalid.*--sign KEY"):
        amend("experiments/minimal.toml", "fewer prompts", now=T0 + dt.timedelta(minutes=1))
    assert reg.path.read_bytes() == before
    new, _ = amend("experiments/minimal.toml", "fewer prompts", now=T0 + dt.timedelta(minutes=1),
                   sign_key=keys["alice"])
    assert new.path.read_bytes() != before
    assert verify(new.path, allowed_signers=keys["allowed"]).signature.status == "valid"


def test_signing_problems_are_refused_before_anything_is_written(work, keys):
    with pytest.raises(RegistrationError, match=r"--sign nokey: no such key file"):
        register("experiments/minimal.toml", now=T0, sign_key="nokey")
    assert not (work / "preregistrations" / "minimal.json").exists()
    (work / "preregistrations").mkdir(exist_ok=True)
    stale = work / "preregistrations" / "minimal.json.sig"
    stale.write_text("old\n")
    with pytest.raises(RegistrationError, match=r"minimal.json.sig exists without its "
                                                r"registration"):
        register("experiments/minimal.toml", now=T0)
    assert not (work / "preregistrations" / "minimal.json").exists()
    with pytest.raises(SignatureError, match="no such allowed-signers file"):
        stale.unlink()
        reg, _ = register("experiments/minimal.toml", now=T0, sign_key=keys["alice"])
        check_signature(reg.path, work / "missing")


def test_unsigned_registrations_have_no_signature_line(work):
    reg, _ = register("experiments/minimal.toml", now=T0)
    report = verify(reg.path)
    assert report.ok and report.signature.status == "none" and report.signature.line() == ""


# --------------------------------------------------------------------------------------------
# the commands


def _cli(module) -> object:
    import click
    group = click.Group("bistat")
    module.register(group)
    return group


def test_register_sign_and_verify_through_the_cli(work, keys, monkeypatch):
    monkeypatch.setattr(prereg, "_utcnow", lambda: T0)
    cli = _cli(cmd_register)
    result = CliRunner().invoke(cli, ["register", "experiments/minimal.toml", "--sign",
                                      str(keys["alice"])])
    assert result.exit_code == 0, result.output
    assert ("  signature:  preregistrations/minimal.json.sig (ssh-keygen -Y sign, namespace "
            "bistat); check it with: bistat verify preregistrations/minimal.json "
            "--allowed-signers FILE\n") in result.output
    result = CliRunner().invoke(cli, ["verify", "preregistrations/minimal.json",
                                      "--allowed-signers", str(keys["allowed"])])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[-1] == (f"  signature: valid, key {keys['alice_fp']} "
                                              "(alice@example.org)")
    _forge(work / "preregistrations" / "minimal.json")
    result = CliRunner().invoke(cli, ["verify", "preregistrations/minimal.json",
                                      "--allowed-signers", str(keys["allowed"])])
    assert result.exit_code == 1
    assert "signature: INVALID, minimal.json.sig is not a signature of these bytes" in result.output


@pytest.fixture
def synthetic(tmp_path, monkeypatch):
    """The worked example (examples/synthetic) copied outside git: its run and registration."""
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", "/dev/null")
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    monkeypatch.chdir(tmp_path)
    shutil.copytree(ROOT / "examples" / "synthetic" / "run", tmp_path / "run")
    shutil.copy(ROOT / "examples" / "synthetic" / "synthetic-example.json", tmp_path)
    return tmp_path


def test_the_finding_names_the_signature_and_analyze_refuses_a_bad_one(synthetic, keys):
    reg = synthetic / "synthetic-example.json"
    signature_path(reg).write_bytes(sign_bytes(reg.read_bytes(), keys["alice"]))
    cli = _cli(cmd_analyze)
    args = ["analyze", "run", "--registration", "synthetic-example.json", "--out", "findings"]
    result = CliRunner().invoke(cli, [*args, "--allowed-signers", str(keys["allowed"])])
    assert result.exit_code == 0, result.output
    lines = (synthetic / "findings" / "synthetic-example.md").read_text().splitlines()
    assert lines[4] == ("Seal: content hash verified; git: not in git history here (not a git "
                        "checkout, or git is not installed): the seal proves integrity, not "
                        f"time; signature: valid, key {keys['alice_fp']} (alice@example.org).")
    result = CliRunner().invoke(
        cli, [*args, "--json", "--allowed-signers", str(keys["allowed"])])
    assert result.exit_code == 0, result.output
    seal = json.loads(result.stdout)["seal"]
    assert seal["line"] == lines[4]
    assert (seal["git"]["status"], seal["signature"]["status"], seal["signature"]["fingerprint"]) \
        == ("none", "valid", keys["alice_fp"])
    signature_path(reg).write_bytes(sign_bytes(reg.read_bytes(), keys["mallory"]))
    (synthetic / "findings" / "synthetic-example.md").unlink()
    result = CliRunner().invoke(cli, [*args, "--allowed-signers", str(keys["allowed"])])
    assert result.exit_code == 1
    assert (f"Error: synthetic-example.json: signature: INVALID, made by key "
            f"{keys['mallory_fp']}, which {keys['allowed']} does not allow; check it with: "
            "bistat verify synthetic-example.json run") in result.output
    assert not (synthetic / "findings" / "synthetic-example.md").exists()
