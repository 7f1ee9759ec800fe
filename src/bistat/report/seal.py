"""Which evidence holds for a finding's registration: the line ``Seal: ...`` near its top.

The seal (the registration's self-computed SHA-256, checked by the analysis) proves integrity
only: whoever can rewrite the file can recompute it. What proves time is git: the first commit
holding the registration's exact bytes (:func:`bistat.declare.prereg.git_evidence`), compared
with the run's first record (``run.json``'s ``created_utc``). What proves authorship is an
optional SSH signature, ``NAME.json.sig`` (:mod:`bistat.declare.prereg_signature`).

The line is computed from the repository the run is analysed in, so it is the one part of a
finding that depends on more than the records: a full clone, a shallow clone (``git clone
--depth 1``, as CI checks out) and a tarball tell different amounts of history. Its forms are
fixed (:data:`GIT_UNAVAILABLE` lists those that say no history was found; the others name the
commit), and the regeneration tests compare every other byte of a committed finding and accept
for this one line either the committed text or the form this clone can state
(``tests/finding_seal.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from bistat.declare.git_evidence import GitEvidence, git_evidence
from bistat.store.format import parse_time
from bistat.declare.prereg_signature import SignatureCheck, check_signature
from bistat.declare.run_registration import run_registration

__all__ = ["SEAL_PREFIX", "GIT_UNAVAILABLE", "SealEvidence", "seal_evidence", "run_seal_evidence"]

#: Every finding's seal line starts so (and no other line does).
SEAL_PREFIX = "Seal: content hash verified; "

#: ``GitEvidence.status`` -> the reason git shows no time, for each status that shows none.
GIT_UNAVAILABLE = {
    "none": "not a git checkout, or git is not installed",
    "uncommitted": "the registration is not committed",
    "shallow": "a shallow clone: `git fetch --unshallow` to look further back",
}

_NO_TIME = "the seal proves integrity, not time"


@dataclass(frozen=True)
class SealEvidence:
    """The evidence a registration's seal has besides its own hash.

    ``registration``: the file, as given; ``git``: what git says about its exact bytes,
    ``before`` comparing the first commit holding them with ``first_record_utc`` (the run's
    first record); ``signature``: what ``NAME.json.sig`` shows (status ``"none"`` without one).
    """

    registration: str
    git: GitEvidence
    first_record_utc: str | None
    signature: SignatureCheck = SignatureCheck("none")

    def refutations(self) -> list[str]:
        """How the evidence contradicts the registration: its bytes differ from those git
        committed, or its signature is not of these bytes or by an allowed key. (Committed
        after the run's first record is none: the finding says what that leaves.)"""
        out = [self.git_text()] if self.git.status == "differs" else []
        return out + ([self.signature.line()] if self.signature.refutes else [])

    def to_dict(self) -> dict[str, object]:
        """The evidence as ``bistat analyze --json`` prints it."""
        g, sig = self.git, self.signature
        return {"registration": self.registration, "line": self.line(),
                "git": {"status": g.status, "commit": g.commit, "time_utc": g.time_utc,
                        "before_first_record": g.before, "first_record_utc": self.first_record_utc},
                "signature": {"status": sig.status, "fingerprint": sig.fingerprint,
                              "principal": sig.principal, "allowed_signers": sig.allowed_signers}}

    def git_text(self) -> str:
        """The line's git clause (``git: ...``), in the fixed forms docs/RECORDS.md lists."""
        g = self.git
        if g.status in GIT_UNAVAILABLE:
            return f"git: not in git history here ({GIT_UNAVAILABLE[g.status]}): {_NO_TIME}"
        if g.status == "differs":
            return (f"git: the registration differs from the blob committed in {g.commit}; "
                    "it was changed after it was committed")
        first = f"git: first committed in {g.commit} at {g.time_utc}"
        if g.before is None:
            return f"{first}; the run records no start time to compare: {_NO_TIME}"
        if g.before:
            return f"{first}, before the run's first record ({self.first_record_utc})"
        return f"{first}, after the run's first record ({self.first_record_utc}): {_NO_TIME}"

    def line(self) -> str:
        """The finding's line: ``Seal: content hash verified; git: ...[; signature: ...].``"""
        parts = [self.git_text()]
        if self.signature.line():
            parts.append(self.signature.line())
        return SEAL_PREFIX + "; ".join(parts) + "."


def seal_evidence(registration: str | Path, first_record_utc: str | None, *,
                  allowed_signers: str | Path | None = None) -> SealEvidence:
    """The git and signature evidence for the registration file a run is analysed against.

    ``first_record_utc``: the run's first record (``RunSummary.created_utc``).
    ``allowed_signers``: the file a signature is checked against (default: git's
    ``gpg.ssh.allowedSignersFile``).

    Raises
    ------
    bistat.declare.prereg_signature.SignatureError
        The allowed-signers file named cannot be read.
    """
    try:
        first = None if first_record_utc is None else parse_time(first_record_utc)
    except (TypeError, ValueError):
        first = None
    return SealEvidence(str(registration), git_evidence(registration, first), first_record_utc,
                        check_signature(registration, allowed_signers))


def run_seal_evidence(run_dir: str | Path, registration: str | Path | None,
                      first_record_utc: str | None, *,
                      allowed_signers: str | Path | None = None) -> SealEvidence:
    """:func:`seal_evidence` of the registration file ``bistat analyze RUN_DIR [--registration
    REGISTRATION]`` analyses: ``registration`` when given, else the one ``run.json`` names
    (:func:`bistat.declare.run_registration.run_registration`, the one resolver)."""
    path = run_registration(run_dir, registration).path
    return seal_evidence(path, first_record_utc, allowed_signers=allowed_signers)
