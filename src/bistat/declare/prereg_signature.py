"""Optional SSH signatures of registrations: ``NAME.json.sig`` beside ``preregistrations/NAME.json``.

A registration's seal (its self-computed SHA-256) proves integrity; git's first commit holding
its bytes proves time (:func:`bistat.declare.prereg.git_evidence`); a signature proves who sealed
it. Signing and checking are OpenSSH's, as git signs commits with ``gpg.format = ssh``:

* ``bistat register --sign KEY`` signs the registration's exact bytes with
  ``ssh-keygen -Y sign -f KEY -n bistat`` (namespace ``bistat``) and writes the armored
  signature to ``NAME.json.sig``;
* ``bistat verify`` finds the signer with ``ssh-keygen -Y find-principals`` in an allowed-signers
  file (``--allowed-signers FILE``, else git's ``gpg.ssh.allowedSignersFile``; format: ssh-keygen(1),
  "ALLOWED SIGNERS") and checks the signature with ``ssh-keygen -Y verify``; with no such file it
  can only check that the signature matches the bytes (``ssh-keygen -Y check-novalidate``) and
  says that the key is not vouched for.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "NAMESPACE",
    "SignatureError",
    "SignatureCheck",
    "signature_path",
    "sign_bytes",
    "allowed_signers_file",
    "check_signature",
]

#: The ``ssh-keygen -Y`` namespace of registration signatures: a signature made for another
#: purpose (a git commit's namespace is ``git``) never verifies as a registration's.
NAMESPACE = "bistat"

_GOOD = re.compile(r'Good "[^"]*" signature (?:for (?P<principal>.+?) )?with (?P<kind>\S+) key '
                   r"(?P<fingerprint>\S+)")


class SignatureError(ValueError):
    """A registration could not be signed (no ssh-keygen, an unreadable key)."""


def signature_path(registration: str | Path) -> Path:
    """``NAME.json.sig`` beside ``NAME.json``."""
    p = Path(registration)
    return p.with_name(p.name + ".sig")


def _ssh_keygen() -> str | None:
    return shutil.which("ssh-keygen")


def _run(args: list[str], data: bytes | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(args, input=data, capture_output=True, check=False)


def _said(proc: subprocess.CompletedProcess) -> str:
    """What ssh-keygen said about a failure: its stderr (the reason), else its stdout."""
    for stream in (proc.stderr, proc.stdout):
        lines = [x.strip() for x in (stream or b"").decode("utf-8", "replace").splitlines()
                 if x.strip() and not x.startswith("Signing data on standard input")]
        if lines:
            return "; ".join(lines)
    return f"exit code {proc.returncode}"


def sign_bytes(data: bytes, key: str | Path) -> bytes:
    """The armored SSH signature of ``data`` by ``key`` (a private key file, or a public key
    whose private half ssh-agent holds), namespace :data:`NAMESPACE`.

    Raises
    ------
    SignatureError
        ssh-keygen is missing, the key is unreadable, or signing failed.
    """
    exe = _ssh_keygen()
    if exe is None:
        raise SignatureError("--sign needs ssh-keygen (OpenSSH 8.2 or later), which is not "
                             "installed; install openssh-client or register without --sign")
    if not Path(key).is_file():
        raise SignatureError(f"--sign {key}: no such key file; give an SSH private key (e.g. "
                             "~/.ssh/id_ed25519) or a public key whose private half ssh-agent holds")
    proc = _run([exe, "-Y", "sign", "-f", str(key), "-n", NAMESPACE], data)
    if proc.returncode != 0 or not proc.stdout.startswith(b"-----BEGIN SSH SIGNATURE-----"):
        raise SignatureError(f"--sign {key}: ssh-keygen -Y sign failed: {_said(proc)}")
    return proc.stdout


def allowed_signers_file(registration: str | Path,
                         given: str | Path | None = None) -> tuple[Path | None, str]:
    """The allowed-signers file to check a registration's signature against, and where it was
    named: ``given`` (``--allowed-signers``), else git's ``gpg.ssh.allowedSignersFile`` as seen
    from the registration's folder (a relative path is taken from the repository's top level,
    where git runs ssh-keygen). ``(None, "")`` when neither names one."""
    if given is not None:
        return Path(given), "--allowed-signers"
    folder = Path(registration).resolve().parent

    def git(*args: str) -> str:
        try:
            proc = subprocess.run(["git", "-C", str(folder), *args], capture_output=True,
                                  text=True, check=False)
        except OSError:
            return ""
        return proc.stdout.strip() if proc.returncode == 0 else ""

    value = git("config", "--type=path", "--get", "gpg.ssh.allowedSignersFile")
    if not value:
        return None, ""
    path = Path(value)
    if not path.is_absolute():
        top = git("rev-parse", "--show-toplevel")
        path = (Path(top) if top else folder) / path
    return path, "git config gpg.ssh.allowedSignersFile"


@dataclass(frozen=True)
class SignatureCheck:
    """What a registration's signature shows.

    ``status``: ``"none"`` (no ``NAME.json.sig``), ``"valid"`` (made by ``principal``'s key in
    the allowed-signers file over these exact bytes), ``"unvouched"`` (a signature over these
    bytes by key ``fingerprint``, but no allowed-signers file was given or configured),
    ``"unknown-key"`` (a signature over these bytes by a key the allowed-signers file does not
    list), ``"invalid"`` (not a signature of these bytes: the registration changed after it was
    signed, or the file is not a bistat signature), ``"unchecked"`` (ssh-keygen is missing).
    """

    status: str
    signature: str | None = None
    fingerprint: str | None = None
    principal: str | None = None
    allowed_signers: str | None = None
    detail: str | None = None

    @property
    def refutes(self) -> bool:
        """The signature contradicts the registration (changed after signing, or a key the
        allowed signers do not list)."""
        return self.status in ("invalid", "unknown-key")

    def line(self) -> str:
        """One line for ``verify`` and the finding (empty when there is no signature)."""
        if self.status == "none":
            return ""
        if self.status == "valid":
            return f"signature: valid, key {self.fingerprint} ({self.principal})"
        if self.status == "unvouched":
            return (f"signature: made by key {self.fingerprint}, which no allowed-signers file "
                    "vouches for (give --allowed-signers FILE or set git config "
                    "gpg.ssh.allowedSignersFile)")
        if self.status == "unknown-key":
            return (f"signature: INVALID, made by key {self.fingerprint}, which "
                    f"{self.allowed_signers} does not allow")
        if self.status == "invalid":
            return (f"signature: INVALID, {self.signature} is not a signature of these bytes: "
                    f"the registration changed after it was signed, or the signature is not "
                    f"bistat's (ssh-keygen: {self.detail})")
        return (f"signature: {self.signature} not checked: ssh-keygen (OpenSSH 8.2 or later) "
                "is not installed")


def check_signature(registration: str | Path,
                    allowed_signers: str | Path | None = None) -> SignatureCheck:
    """Check ``NAME.json.sig`` against the registration's current bytes.

    ``allowed_signers``: the allowed-signers file (``--allowed-signers``); when None, git's
    ``gpg.ssh.allowedSignersFile`` (:func:`allowed_signers_file`).

    Raises
    ------
    SignatureError
        The allowed-signers file that was named cannot be read.
    """
    reg = Path(registration)
    sig = signature_path(reg)
    if not sig.is_file():
        return SignatureCheck("none")
    shown = sig.name
    exe = _ssh_keygen()
    if exe is None:
        return SignatureCheck("unchecked", shown)
    data = reg.read_bytes()
    novalidate = _run([exe, "-Y", "check-novalidate", "-n", NAMESPACE, "-s", str(sig)], data)
    good = _GOOD.search(novalidate.stdout.decode("utf-8", "replace"))
    if novalidate.returncode != 0 or good is None:
        return SignatureCheck("invalid", shown, detail=_said(novalidate))
    fingerprint = good.group("fingerprint")
    signers, named_by = allowed_signers_file(reg, allowed_signers)
    if signers is None:
        return SignatureCheck("unvouched", shown, fingerprint)
    if not signers.is_file():
        raise SignatureError(f"{signers} ({named_by}): no such allowed-signers file; give one "
                             "that lists the signers' public keys, one 'PRINCIPAL KEYTYPE KEY' "
                             "a line (ssh-keygen(1), ALLOWED SIGNERS)")
    found = _run([exe, "-Y", "find-principals", "-s", str(sig), "-f", str(signers)])
    principals = ([x.strip() for x in found.stdout.decode("utf-8", "replace").splitlines()
                   if x.strip()] if found.returncode == 0 else [])
    for principal in principals:
        proc = _run([exe, "-Y", "verify", "-f", str(signers), "-I", principal, "-n", NAMESPACE,
                     "-s", str(sig)], data)
        ok = _GOOD.search(proc.stdout.decode("utf-8", "replace"))
        if proc.returncode == 0 and ok is not None:
            return SignatureCheck("valid", shown, ok.group("fingerprint"), principal,
                                  str(signers))
    return SignatureCheck("unknown-key", shown, fingerprint, None, str(signers),
                          _said(found))
