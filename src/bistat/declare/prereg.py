"""Sealed pre-registrations: register, amend and verify (``preregistrations/NAME.json``).

A registration holds the fully resolved declaration, its design analysis and provenance (UTC
time, bistat version, git commit and the declaration file's clean/dirty state), sealed by the
SHA-256 of a canonical JSON serialization of all of it (``sort_keys``, fixed separators, UTF-8;
pyperf's ``json.dump(data, fp, sort_keys=True)`` made canonical). The file layout::

    {"schema": "bistat.registration/1",
     "sealed": {"name", "source", "declaration", "declaration_sha256", "registered_utc",
                "sealed_utc", "bistat_version", "git", "design", "amendments",
                "engine_release"},      # vLLM engines only; absent from older registrations
     "sha256": "<sha256 of canonical_json(sealed)>"}

``engine_release`` is the newest release of the engine's package that the package index knew as
the study was registered (:class:`bistat.declare.releases.ReleaseCheck`: ``newest`` or the ``error`` that
left it unknown); findings compare the version each run measured with it.

A registration is written once and never overwritten. ``amend`` replaces the declaration only
while no data has been recorded for it (no run directory names it), appending an entry to the
append-only amendment log inside the seal: ``time_utc``, ``reason``, ``old_declaration_sha256``,
``new_declaration_sha256``, ``previous_sha256`` (the seal before the amendment) and ``git``.

``verify`` recomputes the seal, checks the declaration and the amendment log, and checks that
the registration (its last sealing) precedes every recorded datum of the runs recorded against
it: ``run.json``'s ``created_utc``, ``time_utc`` of ``schedule.jsonl`` and ``events.jsonl`` lines
and ``started_utc`` of ``passes.jsonl`` lines (``responses.jsonl`` times are relative to the
pass start, so the pass's ``schedule.jsonl`` start event dates them). It also says which evidence
the seal has besides its own hash, which whoever can rewrite the file can recompute: git's first
commit of the file's exact bytes, older than the run's first record or not (:func:`git_evidence`;
a shallow clone that cannot see it says so), and an optional SSH signature ``NAME.json.sig``
(``register``/``amend`` with ``sign_key``; :mod:`bistat.declare.prereg_signature`).

Newest-release checks made after the seal (``check_release``, and each ``amend``) are appended to
``NAME.releases.jsonl`` beside the registration (:mod:`bistat.declare.release_log`), never to the
sealed file; ``verify`` checks that log's hash chain too.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

from bistat import __version__
from bistat.declare.errors import DeclarationError
from bistat.declare.prereg_signature import (SignatureCheck, SignatureError, check_signature,
                                             sign_bytes, signature_path)
from bistat.declare.release_log import (LoggedCheck, ReleaseLogError, append_release_check,
                                        read_release_log, release_log_path)
from bistat.declare.releases import ReleaseCheck
from bistat.store.format import RecordsError, parse_time

if TYPE_CHECKING:  # pragma: no cover
    from bistat.declare.design_report import DesignReport
    from bistat.declare.experiment import Experiment

# The declaration's models (pydantic) and the design analysis are imported where a registration
# is made or read, not with this module, which every command's --help loads.

__all__ = [
    "SCHEMA",
    "RegistrationError",
    "Registration",
    "VerifyReport",
    "canonical_json",
    "sha256_hex",
    "git_state",
    "GitEvidence",
    "git_evidence",
    "registration_path",
    "register",
    "load_declaration",
    "amend",
    "load_registration",
    "find_recorded_runs",
    "ledger_path",
    "ledger_runs",
    "note_run",
    "verify",
    "release_log_checks",
    "check_release",
    "format_time",
    "parse_time",
]

SCHEMA = "bistat.registration/1"
DEFAULT_REGISTRATIONS_DIR = "preregistrations"
DEFAULT_RUNS_DIR = "runs"


class RegistrationError(ValueError):
    """A registration could not be written, amended or read."""


# --------------------------------------------------------------------------------------------
# canonical form and time


def canonical_json(obj: Any) -> bytes:
    """The canonical serialization that is hashed: sorted keys, no whitespace, UTF-8, no NaN."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False).encode("utf-8")


def sha256_hex(obj: Any) -> str:
    """SHA-256 (hex) of ``canonical_json(obj)``."""
    return hashlib.sha256(canonical_json(obj)).hexdigest()


def _utcnow() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def format_time(t: dt.datetime) -> str:
    """ISO 8601 UTC with microseconds and a ``Z``: ``2026-11-29T10:14:01.123456Z``."""
    return t.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


# --------------------------------------------------------------------------------------------
# git


def git_state(path: str | Path) -> dict[str, Any]:
    """Git commit of the repository holding ``path`` and the file's state there.

    Returns ``{"commit": sha or None, "declaration_state": "clean" | "dirty" | "untracked" |
    None}``; both None outside a git repository or without git.
    """
    p = Path(path).resolve()
    none = {"commit": None, "declaration_state": None}

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(p.parent), *args], capture_output=True,
                              text=True, check=False)

    try:
        head = git("rev-parse", "HEAD")
    except OSError:  # git is not installed
        return none
    if head.returncode != 0:
        inside = git("rev-parse", "--is-inside-work-tree")
        if inside.returncode != 0:
            return none
        commit = None  # a repository without commits yet
    else:
        commit = head.stdout.strip()
    status = git("status", "--porcelain", "--", p.name)
    if status.returncode != 0:
        return {"commit": commit, "declaration_state": None}
    out = status.stdout.strip()
    state = "clean" if not out else ("untracked" if out.startswith("??") else "dirty")
    return {"commit": commit, "declaration_state": state}


@dataclass(frozen=True)
class GitEvidence:
    """What git says about a registration file's current bytes (its blob).

    ``status``: ``"none"`` (not in a git repository, or git missing), ``"uncommitted"`` (no
    commit holds the path), ``"differs"`` (commits hold the path, none with these bytes:
    ``commit`` is the newest that holds it), ``"committed"`` (``commit`` is the first commit
    holding these exact bytes, ``time_utc`` its committer time), ``"shallow"`` (a shallow
    clone whose first commit holding these bytes is a boundary commit, ``commit``: its history
    is cut there, so the bytes may be older and no time can be told). ``before`` compares
    that time with the run's first record when one is given (None otherwise).
    """

    status: str
    commit: str | None = None
    time_utc: str | None = None
    before: bool | None = None

    def line(self) -> str:
        """The one line ``verify`` and the finding print."""
        if self.status == "none":
            return "no git evidence (not in a git repository): only the seal's integrity is shown"
        if self.status == "uncommitted":
            return "no git evidence: the registration is not committed"
        if self.status == "shallow":
            return (f"no git evidence: a shallow clone, cut at {self.commit} which holds the "
                    "registration; its first commit is not here (git fetch --unshallow)")
        if self.status == "differs":
            return (f"git: the registration differs from the blob committed in {self.commit}; "
                    "it was changed after it was committed")
        when = "" if self.before is None else (
            ", before the run's first record" if self.before else ", after the run's first record")
        return f"git: first committed in {self.commit} at {self.time_utc}{when}"

    @property
    def refutes(self) -> bool:
        """The evidence contradicts the seal (changed after commit, or committed after data)."""
        return self.status == "differs" or self.before is False


def _shallow_boundary(git: Callable[..., subprocess.CompletedProcess]) -> frozenset[str]:
    """The commits where a shallow clone's history is cut (empty for a full clone)."""
    if git("rev-parse", "--is-shallow-repository").stdout.strip() != "true":
        return frozenset()
    shallow = git("rev-parse", "--path-format=absolute", "--git-path", "shallow").stdout.strip()
    try:
        return frozenset(Path(shallow).read_text(encoding="ascii").split())
    except OSError:
        return frozenset()


def git_evidence(path: str | Path, first_record: dt.datetime | None = None) -> GitEvidence:
    """The first commit holding ``path``'s exact current bytes, and whether it is older than
    ``first_record`` (the run's first record): evidence of time the user cannot rewrite after
    the fact, unlike the self-computed seal."""
    p = Path(path).resolve()

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(p.parent), *args], capture_output=True,
                              text=True, check=False)

    try:
        top = git("rev-parse", "--show-toplevel")
    except OSError:
        return GitEvidence("none")
    if top.returncode != 0 or not p.is_file():
        return GitEvidence("none")
    rel = p.relative_to(Path(top.stdout.strip()).resolve()).as_posix()
    blob = git("hash-object", "--", str(p)).stdout.strip()
    log = git("log", "--format=%H %ct", "--reverse", "--", f":(top){rel}")
    commits = [line.split() for line in log.stdout.splitlines() if line.strip()]
    if log.returncode != 0 or not commits:
        return GitEvidence("uncommitted")
    for sha, ct in commits:
        if git("rev-parse", f"{sha}:{rel}").stdout.strip() == blob:
            if sha in _shallow_boundary(git):  # every file appears in a boundary commit
                return GitEvidence("shallow", sha)
            when = dt.datetime.fromtimestamp(int(ct), dt.timezone.utc)
            before = None if first_record is None else when < first_record
            return GitEvidence("committed", sha, when.strftime("%Y-%m-%dT%H:%M:%SZ"), before)
    return GitEvidence("differs", commits[-1][0])


# --------------------------------------------------------------------------------------------
# the registration


@dataclass(frozen=True)
class Registration:
    """A registration file's content (``data``) and where it lives."""

    path: Path
    data: dict[str, Any]

    @property
    def sealed(self) -> dict[str, Any]:
        return self.data["sealed"]

    @property
    def sha256(self) -> str:
        return self.data["sha256"]

    @property
    def name(self) -> str:
        return self.sealed["name"]

    @property
    def registered_utc(self) -> str:
        return self.sealed["registered_utc"]

    @property
    def sealed_utc(self) -> str:
        """When the declaration now in force was sealed (registration or last amendment)."""
        return self.sealed["sealed_utc"]

    @property
    def declaration(self) -> dict[str, Any]:
        return self.sealed["declaration"]

    @property
    def declaration_sha256(self) -> str:
        return self.sealed["declaration_sha256"]

    @property
    def amendments(self) -> list[dict[str, Any]]:
        return list(self.sealed["amendments"])

    @property
    def design(self) -> dict[str, Any]:
        return self.sealed["design"]

    @property
    def previous_sha256s(self) -> list[str]:
        """Seals this registration had before its amendments."""
        return [a["previous_sha256"] for a in self.sealed["amendments"]]

    def experiment(self) -> Experiment:
        """The registered declaration, validated."""
        from bistat.declare.experiment import validate_experiment

        return validate_experiment(self.declaration, source=f"{self.path}: declaration")

    def reference(self) -> dict[str, Any]:
        """What a run records in ``run.json`` under ``registration``."""
        return {"path": str(self.path), "sha256": self.sha256,
                "registered_utc": self.registered_utc, "name": self.name}


def registration_path(name: str, registrations_dir: str | Path = DEFAULT_REGISTRATIONS_DIR) -> Path:
    return Path(registrations_dir) / f"{name}.json"


def load_declaration(declaration_path: str | Path) -> Experiment:
    """Load and validate ``experiments/NAME.toml`` with the one rule ``register`` and ``design``
    share: its ``name`` is its file name."""
    from bistat.declare.experiment import load_experiment

    exp = load_experiment(declaration_path)
    stem = Path(declaration_path).stem
    if exp.name != stem:
        raise DeclarationError([f"{declaration_path}: name: {exp.name!r} differs from the file "
                                f"name {stem!r}; rename the file to {exp.name}.toml or set "
                                f"name = \"{stem}\""])
    return exp


def registration_problems(exp: Experiment, declaration_path: str | Path,
                          base_dir: str | Path | None = None, *, check_engine: bool = True
                          ) -> list[str]:
    """What ``register`` (and ``--amend``) checks beyond the schema: everything ``bistat run``
    would refuse of this declaration before or in its first pass, one message per problem naming
    the file, the field and the fix: at least two counted passes per arm (a comparison needs two;
    bistat has no reference-arm mode), the prompts the workload names, read as the run reads them
    (a ``file:`` source that exists and is well formed, ``n_prompts`` it can give: the built-in
    chat source holds 1,200), and the engine adapter's own checks (argument names, types and
    values against its schema, server URLs and ports, the model, ``max_tokens`` with the longest
    prompt against a context length the declaration or the model fixes). What an adapter cannot
    check before its engine runs is stated in the design report
    (:func:`bistat.engines.registry.declaration_limits`). ``check_engine=False`` skips the
    adapter's checks, for a declaration analysed from records written without its engine
    (synthetic records in tests)."""
    from bistat.engines.registry import declaration_problems, prompt_problems

    problems: list[tuple[str, str]] = []
    if exp.workload.passes < 2:
        problems.append(("workload.passes", f"{exp.workload.passes} counted pass per arm cannot "
                         "be compared: a comparison needs at least 2 counted passes per arm with "
                         "each prompt present in both; set passes = 2 or more"))
    if check_engine:
        problems += declaration_problems(exp)
    prompts, problem = _declared_prompts(exp, base_dir)
    if problem is not None:
        problems.append(problem)
    if check_engine:
        problems += prompt_problems(exp, prompts)
    return [f"{declaration_path}: {field}: {message}"
            for field, message in dict.fromkeys(problems)]


def _declared_prompts(exp: Experiment, base_dir: str | Path | None
                      ) -> tuple[list[Any], tuple[str, str] | None]:
    """The workload's prompts as the run will read them, or ``([], (field, message))`` when it
    could not (:func:`bistat.declare.prompts.load_prompts`)."""
    from bistat.declare.prompts import WorkloadError, load_prompts

    wl = exp.workload
    source = wl.source
    if source.startswith("file:"):
        raw = source[len("file:"):]
        path = Path(raw)
        if not path.is_absolute():
            path = Path(base_dir or Path.cwd()) / path
        if not path.is_file():
            return [], ("workload.source", f"prompt file {raw} does not exist ({path}); "
                        "create it or fix the path (relative to the working directory)")
    try:
        return load_prompts(source, wl.n_prompts, wl.seed,
                            base_dir=Path(base_dir) if base_dir is not None else None), None
    except WorkloadError as exc:
        text = str(exc)
        field = ("workload.n_prompts" if "n_prompts" in text else "workload.source")
        return [], (field, text)


def _checked_declaration(declaration_path: str | Path, base_dir: str | Path | None,
                         check_engine: bool) -> Experiment:
    exp = load_declaration(declaration_path)
    problems = registration_problems(exp, declaration_path, base_dir, check_engine=check_engine)
    if problems:
        raise DeclarationError(problems)
    return exp


def _dump(data: dict[str, Any]) -> str:
    return json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False, allow_nan=False) + "\n"


def _seal(sealed: dict[str, Any]) -> dict[str, Any]:
    return {"schema": SCHEMA, "sealed": sealed, "sha256": sha256_hex(sealed)}


def register(
    declaration_path: str | Path,
    *,
    registrations_dir: str | Path = DEFAULT_REGISTRATIONS_DIR,
    base_dir: str | Path | None = None,
    now: dt.datetime | None = None,
    release_check: Callable[[str], Any] | None = None,
    check_engine: bool = True,
    sign_key: str | Path | None = None,
) -> tuple[Registration, DesignReport]:
    """Seal a declaration into ``registrations_dir/NAME.json``; never overwrites.

    With ``sign_key`` (``--sign KEY``) the registration's exact bytes are also signed with
    ``ssh-keygen -Y sign`` into ``NAME.json.sig`` (:mod:`bistat.declare.prereg_signature`).

    For a vLLM engine the seal also records the newest release the package index knows as the
    study is registered (``engine_release``; :func:`bistat.declare.releases.check_newest_release`, or
    ``release_check(package)``): its finding compares the version the run measured with it.

    Raises
    ------
    DeclarationError
        The declaration does not validate.
    RegistrationError
        A registration of that name exists already, a signature without its registration is
        in the way, or ``sign_key`` could not sign.
    bistat.declare.design_report.DesignError
        ``design.cv_from`` names no usable run.
    """
    exp = _checked_declaration(declaration_path, base_dir, check_engine)
    path = registration_path(exp.name, registrations_dir)
    if path.exists():
        raise RegistrationError(
            f"{path} already exists; a registration is never overwritten. To change the "
            f"declaration before any data is recorded: bistat register {declaration_path} "
            "--amend --reason \"...\"; otherwise register it under a new name")
    sig_path = signature_path(path)
    if sig_path.exists() and sign_key is None:
        raise RegistrationError(f"{sig_path} exists without its registration {path}; it would "
                                "not be this registration's signature: remove it, or sign the "
                                "new registration with --sign KEY")
    log = release_log_path(path)
    if log.exists():
        raise RegistrationError(f"{log} exists without its registration {path}; it would not be "
                                "this registration's release log: move it aside")
    from bistat.declare.design_report import analyse_design

    report = analyse_design(exp, base_dir=base_dir)
    when = format_time(now or _utcnow())
    declaration = exp.resolved()
    sealed = {
        "name": exp.name,
        "source": str(declaration_path),
        "declaration": declaration,
        "declaration_sha256": sha256_hex(declaration),
        "registered_utc": when,
        "sealed_utc": when,
        "bistat_version": __version__,
        "git": git_state(declaration_path),
        "design": report.to_dict(),
        "amendments": [],
    }
    from bistat.declare.engine_version import ENGINE_PACKAGES
    from bistat.declare.releases import check_newest_release

    package = ENGINE_PACKAGES.get(exp.engine.kind)
    if package is not None:
        check = (release_check or check_newest_release)(package)
        sealed["engine_release"] = check.to_dict()
    data = _seal(sealed)
    text = _dump(data)
    signature = _sign(text, sign_key)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(path, "x", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
    except FileExistsError as exc:  # lost a race with another writer
        raise RegistrationError(f"{path} already exists; a registration is never "
                                "overwritten") from exc
    if signature is not None:
        _write_replacing(sig_path, signature)
    return Registration(path, data), report


def _sign(text: str, sign_key: str | Path | None) -> bytes | None:
    """The signature of a registration's bytes (``text`` as written), before it is written."""
    if sign_key is None:
        return None
    try:
        return sign_bytes(text.encode("utf-8"), sign_key)
    except SignatureError as exc:
        raise RegistrationError(str(exc)) from None


def _write_replacing(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (a temporary file, then ``os.replace``)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def amend(
    declaration_path: str | Path,
    reason: str,
    *,
    registrations_dir: str | Path = DEFAULT_REGISTRATIONS_DIR,
    runs_dirs: Sequence[str | Path] = (DEFAULT_RUNS_DIR,),
    base_dir: str | Path | None = None,
    now: dt.datetime | None = None,
    check_engine: bool = True,
    sign_key: str | Path | None = None,
    release_check: Callable[[str], ReleaseCheck] | None = None,
) -> tuple[Registration, DesignReport]:
    """Replace a registration's declaration, while no data has been recorded for it.

    The amendment (time, reason, old and new declaration hashes, the seal it replaces) is
    appended to the registration's amendment log and sealed with it. A signed registration
    (``NAME.json.sig``) is amended only with ``sign_key``, which signs the amended bytes.

    For a vLLM engine the amendment also checks the newest release, as ``register`` does, and
    appends the check to the release log ``NAME.releases.jsonl`` (``by: "amend"``, against the
    new seal; :mod:`bistat.declare.release_log`) whatever it found: the seal's
    ``engine_release`` stays the check made at registration.

    Raises
    ------
    RegistrationError
        No reason given, no registration to amend, its seal is broken, the declaration is
        unchanged, data has been recorded for it, it is signed and no ``sign_key`` is given,
        or its release log does not verify.
    """
    if not reason or not reason.strip():
        raise RegistrationError("an amendment needs a reason: --reason \"why the declaration "
                                "changes\"")
    exp = _checked_declaration(declaration_path, base_dir, check_engine)
    path = registration_path(exp.name, registrations_dir)
    if not path.exists():
        raise RegistrationError(f"{path} does not exist; there is nothing to amend. Register "
                                f"it first: bistat register {declaration_path}")
    old = load_registration(path)
    sig_path = signature_path(path)
    if sig_path.exists() and sign_key is None:
        raise RegistrationError(f"{path} is signed ({sig_path}): an amendment would leave the "
                                "signature invalid; sign the amended registration too: "
                                f"bistat register {declaration_path} --amend --reason \"...\" "
                                "--sign KEY")
    # a run that recorded no data yet (its engine could not start) does not block an
    # amendment; the ledger finds runs recorded under any --run-dir (see note_run)
    found: dict[Path, Path] = {}
    for r in [*find_recorded_runs(old, runs_dirs), *ledger_runs(old)]:
        found.setdefault(r.resolve(), r)
    runs = [r for r in found.values() if _has_data(r)]
    if runs:
        shown = ", ".join(str(r) for r in runs[:3]) + (" ..." if len(runs) > 3 else "")
        raise RegistrationError(
            f"cannot amend {path}: data has been recorded for it ({shown}); a registration "
            "cannot change after data exists. Register the changed declaration under a new name")
    logged = release_log_checks(old)
    declaration = exp.resolved()
    new_sha = sha256_hex(declaration)
    if new_sha == old.declaration_sha256:
        raise RegistrationError(f"{declaration_path} is unchanged since {path} was sealed "
                                f"(declaration sha256 {new_sha}); nothing to amend")
    from bistat.declare.design_report import analyse_design

    report = analyse_design(exp, base_dir=base_dir)
    when = format_time(now or _utcnow())
    if parse_time(when) < parse_time(old.sealed_utc):
        raise RegistrationError(f"the clock reads {when}, before {path} was last sealed "
                                f"({old.sealed_utc}); fix the system clock")
    git = git_state(declaration_path)
    sealed = dict(old.sealed)
    sealed.update({
        "source": str(declaration_path),
        "declaration": declaration,
        "declaration_sha256": new_sha,
        "sealed_utc": when,
        "bistat_version": __version__,
        "git": git,
        "design": report.to_dict(),
        "amendments": old.amendments + [{
            "time_utc": when,
            "reason": reason.strip(),
            "old_declaration_sha256": old.declaration_sha256,
            "new_declaration_sha256": new_sha,
            "previous_sha256": old.sha256,
            "git": git,
        }],
    })
    data = _seal(sealed)
    text = _dump(data)
    signature = _sign(text, sign_key)
    from bistat.declare.engine_version import ENGINE_PACKAGES
    from bistat.declare.releases import check_newest_release

    package = ENGINE_PACKAGES.get(exp.engine.kind)
    check = None if package is None else (release_check or check_newest_release)(package)
    if check is not None:
        _check_clock(check, old, logged)
    _write_replacing(path, text.encode("utf-8"))
    if signature is not None:
        _write_replacing(sig_path, signature)
    amended = Registration(path, data)
    if check is not None:
        append_release_check(path, check, by="amend", name=amended.name,
                             registration_sha256=amended.sha256, logged=logged)
    return amended, report


def _read(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if p.suffix.lower() == ".toml" and not p.exists():   # missing: not "a declaration"
        raise RegistrationError(f"{path}: no such file; give a sealed registration, "
                                f"{DEFAULT_REGISTRATIONS_DIR}/NAME.json")
    if p.suffix.lower() == ".toml":
        sealed = registration_path(p.stem, p.parent.parent / DEFAULT_REGISTRATIONS_DIR
                                   if p.parent.name == "experiments" else DEFAULT_REGISTRATIONS_DIR)
        raise RegistrationError(f"{path} is a declaration, not a registration; give the sealed "
                                f".json ({sealed}, which `bistat register {path}` writes)")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise RegistrationError(f"{path}: no such registration") from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RegistrationError(f"{path}: not a readable registration ({exc})") from exc
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        got = data.get("schema") if isinstance(data, dict) else None
        raise RegistrationError(f"{path}: schema {got!r} is not {SCHEMA!r}; not a bistat "
                                "registration, or written by an incompatible version")
    if not isinstance(data.get("sealed"), dict) or not isinstance(data.get("sha256"), str):
        raise RegistrationError(f"{path}: 'sealed' or 'sha256' is missing; the file is damaged")
    return data


def _seal_problems(path: Path, data: dict[str, Any]) -> list[str]:
    problems: list[str] = []
    sealed = data["sealed"]
    try:
        actual = sha256_hex(sealed)
    except ValueError as exc:  # NaN or similar: cannot have been written by register
        return [f"{path}: seal broken: the content cannot be serialized canonically ({exc})"]
    if actual != data["sha256"]:
        problems.append(f"{path}: seal broken: the sealed content hashes to {actual}, but the "
                        f"seal is {data['sha256']}; the registration was changed after it was "
                        "sealed")
    required = ("name", "declaration", "declaration_sha256", "registered_utc", "sealed_utc",
                "amendments")
    missing = [k for k in required if k not in sealed]
    if missing:
        problems.append(f"{path}: sealed content lacks {', '.join(missing)}; the file is damaged")
        return problems
    if sha256_hex(sealed["declaration"]) != sealed["declaration_sha256"]:
        problems.append(f"{path}: declaration_sha256 does not match the declaration; the "
                        "declaration was changed after it was sealed")
    from bistat.declare.experiment import validate_experiment

    try:
        exp = validate_experiment(sealed["declaration"], source=f"{path}: declaration")
        if not _sealed_within(sealed["declaration"], exp.resolved()):
            problems.append(f"{path}: the declaration is not in resolved form; it was not "
                            "written by bistat register")
    except DeclarationError as exc:
        problems.extend(exc.messages)
    amendments = sealed["amendments"]
    if not isinstance(amendments, list) or not all(isinstance(a, dict) for a in amendments):
        problems.append(f"{path}: the amendment log is not a list of amendments; the file is "
                        "damaged")
        return problems
    times = [sealed["registered_utc"]] + [a.get("time_utc") for a in amendments]
    try:
        parsed = [parse_time(t) for t in times]
        if any(b < a for a, b in zip(parsed, parsed[1:])):
            problems.append(f"{path}: amendment times are not in order; the log was edited")
        if parse_time(sealed["sealed_utc"]) != parsed[-1]:
            problems.append(f"{path}: sealed_utc {sealed['sealed_utc']} is not the time of the "
                            f"last sealing ({times[-1]})")
    except (TypeError, ValueError) as exc:
        problems.append(f"{path}: a registration time is not an ISO 8601 time ({exc})")
    for i, a in enumerate(amendments):
        nxt = (amendments[i + 1]["old_declaration_sha256"] if i + 1 < len(amendments)
               else None)
        if nxt is not None and a.get("new_declaration_sha256") != nxt:
            problems.append(f"{path}: amendments[{i}] and amendments[{i + 1}] do not chain; "
                            "the log was edited")
    if amendments and amendments[-1].get("new_declaration_sha256") != sealed["declaration_sha256"]:
        problems.append(f"{path}: the last amendment does not produce the sealed declaration; "
                        "the log was edited")
    return problems


def _sealed_within(sealed: Any, resolved: Any) -> bool:
    """True when every value the seal holds is what the current schema resolves it to.

    Fields added to the schema after a registration was sealed appear in ``resolved`` with their
    defaults and are tolerated, so old registrations stay readable (additive schema changes only);
    any sealed field the schema resolves differently is not.
    """
    if isinstance(sealed, dict):
        return (isinstance(resolved, dict)
                and all(k in resolved and _sealed_within(v, resolved[k]) for k, v in sealed.items()))
    if isinstance(sealed, list):
        return (isinstance(resolved, list) and len(sealed) == len(resolved)
                and all(_sealed_within(a, b) for a, b in zip(sealed, resolved)))
    return sealed == resolved


def load_registration(path: str | Path) -> Registration:
    """Read a registration and check its seal; raise ``RegistrationError`` if it is broken."""
    data = _read(path)
    problems = _seal_problems(Path(path), data)
    if problems:
        raise RegistrationError("\n".join(problems))
    return Registration(Path(path), data)


# --------------------------------------------------------------------------------------------
# newest-release checks after the seal


def release_log_checks(reg: Registration) -> tuple[LoggedCheck, ...]:
    """The verified newest-release checks of ``reg``'s release log (``NAME.releases.jsonl``,
    :mod:`bistat.declare.release_log`), in order; () when it has none.

    Raises
    ------
    RegistrationError
        The log does not verify (the message names the file, the line, the field and the fix).
    """
    try:
        return read_release_log(reg.path, name=reg.name,
                                seals={reg.sha256, *reg.previous_sha256s},
                                registered_utc=reg.registered_utc)
    except ReleaseLogError as exc:
        raise RegistrationError(str(exc)) from None


def _check_clock(check: ReleaseCheck, reg: Registration, logged: Sequence[LoggedCheck]) -> None:
    """Refuse a check dated before the registration or the log's last check (a wrong clock): the
    log would no longer verify. Checks are dated to the second, so the comparison is too."""
    last = logged[-1].check.checked_utc if logged else reg.registered_utc
    if parse_time(check.checked_utc) < parse_time(last).replace(microsecond=0):
        where = f"the last check in {release_log_path(reg.path)}" if logged else "the registration"
        raise RegistrationError(f"the clock reads {check.checked_utc}, before {last} ({where}); "
                                "nothing was recorded: fix the system clock")


def check_release(
    path: str | Path,
    *,
    release_check: Callable[[str], ReleaseCheck] | None = None,
) -> tuple[Registration, LoggedCheck]:
    """Ask the package index for the newest release of the registration's engine now and append
    the answer to its release log (``by: "check-release"``); the sealed file is not touched.

    A check that found no release (the index is switched off, unreachable or answers something
    unreadable) is an error and nothing is appended: the log holds only what the index answered.

    Parameters
    ----------
    path : path
        The registration (``preregistrations/NAME.json``).
    release_check : callable, optional
        ``release_check(package) -> ReleaseCheck``; default
        :func:`bistat.declare.releases.check_newest_release` (``$BISTAT_PACKAGE_INDEX``).

    Returns
    -------
    (Registration, LoggedCheck)
        The registration and the line appended.

    Raises
    ------
    RegistrationError
        No such registration, its seal or its release log is broken, its engine has no releases
        to compare with, or the index gave no newest release.
    """
    from bistat.declare.engine_version import ENGINE_PACKAGES
    from bistat.declare.releases import INDEX_ENV, check_newest_release

    p = Path(path)
    if not p.exists():
        raise RegistrationError(f"{p}: no such registration; fix the path, or register the "
                                f"declaration first (bistat register experiments/{p.stem}.toml)")
    reg = load_registration(p)
    kind = reg.declaration.get("engine", {}).get("kind")
    package = ENGINE_PACKAGES.get(kind)
    if package is None:
        raise RegistrationError(
            f"{p}: engine.kind: {kind!r} is not released on a package index, so there is no "
            f"newest release to check (only {', '.join(sorted(ENGINE_PACKAGES))} are)")
    logged = release_log_checks(reg)
    check = (release_check or check_newest_release)(package)
    log = release_log_path(p)
    if check.newest is None:
        fix = (f"unset {INDEX_ENV} (it is 'off') and run again" if check.index == "off" else
               f"run it on a machine that reaches {check.index}, or set {INDEX_ENV} to a "
               "reachable copy of PyPI's JSON API")
        raise RegistrationError(f"{p}: cannot check the newest {package} release: {check.error} "
                                f"(index {check.index}); nothing was appended to {log}: {fix}")
    _check_clock(check, reg, logged)
    line = append_release_check(p, check, by="check-release", name=reg.name,
                                registration_sha256=reg.sha256, logged=logged)
    return reg, line


# --------------------------------------------------------------------------------------------
# recorded data


def _run_json(run_dir: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((run_dir / "run.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def _names_registration(run: dict[str, Any], reg: Registration) -> bool:
    ref = run.get("registration")
    if not isinstance(ref, dict):
        return False
    return (ref.get("sha256") in {reg.sha256, *reg.previous_sha256s}
            or ref.get("name") == reg.name)


def find_recorded_runs(reg: Registration, runs_dirs: Iterable[str | Path]) -> list[Path]:
    """Run directories (children of ``runs_dirs``, or those directories themselves) whose
    ``run.json`` names this registration: its seal, an earlier seal, or its name."""
    found: list[Path] = []
    for base in runs_dirs:
        base = Path(base)
        if not base.is_dir():
            continue
        candidates = [base] + sorted(p for p in base.iterdir() if p.is_dir())
        for d in candidates:
            run = _run_json(d)
            if run is not None and _names_registration(run, reg):
                found.append(d)
    return found


def ledger_path(reg_path: str | Path) -> Path:
    """The run ledger of a registration: ``.NAME.runs`` beside ``NAME.json``, one run directory
    (absolute path) per line, appended by ``bistat run`` as a run starts (:func:`note_run`). It
    lets ``--amend`` find runs recorded anywhere (``--run-dir`` outside ``runs/``). Paths are
    written relative to the registration's folder, so a copied project points at its own runs."""
    p = Path(reg_path)
    return p.with_name(f".{p.stem}.runs")


def note_run(reg: Registration, run_dir: str | Path) -> None:
    """Append ``run_dir`` to the registration's run ledger (once)."""
    ledger = ledger_path(reg.path)
    line = os.path.relpath(Path(run_dir).resolve(), ledger.parent.resolve())
    known = ledger.read_text(encoding="utf-8").splitlines() if ledger.exists() else []
    if line not in known:
        with open(ledger, "a", encoding="utf-8") as fh:
            fh.write(line + "\n")


def ledger_runs(reg: Registration) -> list[Path]:
    """The run directories in the registration's ledger that still name it."""
    ledger = ledger_path(reg.path)
    if not ledger.exists():
        return []
    out = []
    for line in ledger.read_text(encoding="utf-8").splitlines():
        d = Path(os.path.normpath(ledger.parent / line))
        run = _run_json(d) if line.strip() else None
        if run is not None and _names_registration(run, reg):
            out.append(d)
    return out


def ledger_entries(reg: Registration) -> list[tuple[Path, bool]]:
    """Every run directory the registration's ledger lists, in order, with whether it is still
    a run of it (``run.json`` there names this registration); a directory since removed or
    replaced is listed as ``False``: a run was started, and its record is gone."""
    ledger = ledger_path(reg.path)
    if not ledger.exists():
        return []
    out = []
    for line in ledger.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        d = Path(os.path.normpath(ledger.parent / line))
        run = _run_json(d)
        out.append((d, run is not None and _names_registration(run, reg)))
    return out


def known_runs(reg: Registration, runs_dirs: Iterable[str | Path] = ()) -> list[Path]:
    """The run directories of ``reg`` that its run ledger lists or that lie under ``runs_dirs``
    (:func:`find_recorded_runs`), each once (by resolved path), in that order."""
    out: dict[Path, Path] = {}
    for d in [*ledger_runs(reg), *find_recorded_runs(reg, runs_dirs)]:
        out.setdefault(d.resolve(), d)
    return list(out.values())


def _has_data(run_dir: Path) -> bool:
    """True when the run recorded data: a response or a pass (``responses.jsonl``/``.parquet``,
    ``passes.jsonl``). Headers alone (``run.json``, the engine's failed start in
    ``events.jsonl``) are not data: a registration whose run never started may be amended."""
    if (run_dir / "responses.parquet").exists():
        return True
    for table in ("responses.jsonl", "passes.jsonl"):
        try:
            with open(run_dir / table, encoding="utf-8", errors="replace") as fh:
                if any(line.strip() for line in fh):
                    return True
        except OSError:
            pass
    return False


def _jsonl(path: Path) -> Iterable[tuple[int, dict[str, Any]]]:
    from bistat.store.readers import iter_jsonl_strict

    try:
        yield from iter_jsonl_strict(path)
    except RecordsError as exc:
        raise RegistrationError(str(exc)) from None


def _data_times(run_dir: Path, run: dict[str, Any]) -> list[tuple[str, str]]:
    """``(where, time)`` of every datum of a run that carries a wall-clock time."""
    out: list[tuple[str, str]] = []
    if "created_utc" in run:
        out.append((f"{run_dir / 'run.json'} created_utc", run["created_utc"]))
    for fname, key in (("schedule.jsonl", "time_utc"), ("events.jsonl", "time_utc"),
                       ("passes.jsonl", "started_utc")):
        for lineno, rec in _jsonl(run_dir / fname):
            if rec.get(key) is not None:
                out.append((f"{run_dir / fname}:{lineno} {key}", rec[key]))
    return out


@dataclass(frozen=True)
class VerifyReport:
    """The outcome of ``verify``; ``ok`` when ``problems`` is empty."""

    path: str
    sha256: str | None
    name: str | None
    registered_utc: str | None
    sealed_utc: str | None
    amendments: int
    runs: tuple[str, ...]
    n_data: int
    earliest_datum: str | None
    problems: tuple[str, ...] = field(default_factory=tuple)
    git: GitEvidence = GitEvidence("none")
    signature: SignatureCheck = SignatureCheck("none")
    release_checks: int = 0   # verified lines of NAME.releases.jsonl
    #: run directories the run ledger lists that no longer hold a run of it
    ledger_missing: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "ok": self.ok, "sha256": self.sha256, "name": self.name,
                "registered_utc": self.registered_utc, "sealed_utc": self.sealed_utc,
                "amendments": self.amendments, "runs": list(self.runs),
                "n_runs": len(self.runs), "ledger_missing": list(self.ledger_missing),
                "n_data": self.n_data,
                "earliest_datum": self.earliest_datum, "problems": list(self.problems),
                "git": {"status": self.git.status, "commit": self.git.commit,
                        "time_utc": self.git.time_utc, "before_first_record": self.git.before,
                        "line": self.git.line()},
                "signature": {"status": self.signature.status,
                              "fingerprint": self.signature.fingerprint,
                              "principal": self.signature.principal,
                              "allowed_signers": self.signature.allowed_signers,
                              "line": self.signature.line() or None},
                "release_checks": self.release_checks}


def verify(
    path: str | Path,
    run_dirs: Sequence[str | Path] = (),
    *,
    runs_dirs: Sequence[str | Path] = (DEFAULT_RUNS_DIR,),
    now: dt.datetime | None = None,
    allowed_signers: str | Path | None = None,
) -> VerifyReport:
    """Re-check a registration's seal and that it precedes every recorded datum, and say which
    evidence holds: git's first commit of its exact bytes (:func:`git_evidence`) and, when
    ``NAME.json.sig`` exists, its signature (:func:`bistat.declare.prereg_signature.check_signature`).

    Parameters
    ----------
    path : path
        The registration file.
    run_dirs : sequence of paths
        Run directories to check. When empty, every run under ``runs_dirs`` whose ``run.json``
        names this registration is checked.
    now : datetime, optional
        The current time (a registration dated in the future is refused).
    allowed_signers : path, optional
        The allowed-signers file a signature is checked against; default: git's
        ``gpg.ssh.allowedSignersFile``.

    Returns
    -------
    VerifyReport
        ``problems`` lists every failure (a broken seal, an edited amendment log or release
        log, a run recorded against another registration, a datum older than the registration,
        bytes changed after they were committed or signed, a signature by a key not allowed).
    """
    p = Path(path)
    try:
        data = _read(p)
    except RegistrationError as exc:
        return VerifyReport(str(p), None, None, None, None, 0, (), 0, None, (str(exc),))
    problems = _seal_problems(p, data)
    reg = Registration(p, data)
    release_checks = 0
    if not problems:
        try:
            release_checks = len(release_log_checks(reg))
        except RegistrationError as exc:
            problems.append(str(exc))
    sealed = data["sealed"]
    sealed_at: dt.datetime | None
    try:
        sealed_at = parse_time(sealed.get("sealed_utc"))
    except (TypeError, ValueError):
        sealed_at = None
    if sealed_at is not None and sealed_at > (now or _utcnow()):
        problems.append(f"{p}: sealed at {sealed['sealed_utc']}, which is in the future; the "
                        "registration is forward-dated or the clock is wrong")

    dirs = [Path(d) for d in run_dirs] if run_dirs else known_runs(reg, runs_dirs)
    missing = ([str(d) for d, ok in ledger_entries(reg) if not ok]
               if not run_dirs and not problems else [])
    n_data = 0
    earliest: tuple[dt.datetime, str, str] | None = None
    for d in dirs:
        run = _run_json(d)
        if run is None:
            problems.append(f"{d}: no readable run.json; not a run directory")
            continue
        ref = run.get("registration") if isinstance(run.get("registration"), dict) else {}
        got = ref.get("sha256")
        if got != data["sha256"]:
            if got in reg.previous_sha256s:
                problems.append(f"{d}: recorded against {p} as sealed before an amendment "
                                f"(sha256 {got}); data recorded before an amendment voids it")
            else:
                problems.append(f"{d}: recorded against registration sha256 {got!r}, not "
                                f"{data['sha256']} ({p})")
        try:
            times = _data_times(d, run)
        except RegistrationError as exc:
            problems.append(str(exc))
            continue
        late: list[str] = []
        for where, text in times:
            n_data += 1
            try:
                t = parse_time(text)
            except (TypeError, ValueError):
                problems.append(f"{where}: {text!r} is not an ISO 8601 time")
                continue
            if earliest is None or t < earliest[0]:
                earliest = (t, text, where)
            if sealed_at is not None and t <= sealed_at:
                late.append(f"{where} = {text}")
        if late:
            problems.append(f"{d}: {len(late)} recorded datum(s) are not later than the "
                            f"registration (sealed {sealed.get('sealed_utc')}), e.g. {late[0]}; "
                            "the registration does not precede the data (back-dated data or a "
                            "registration made after the run)")
    evidence = git_evidence(p, None if earliest is None else earliest[0])
    if evidence.status == "differs" and dirs:
        problems.append(f"{p}: {evidence.line()}")
    elif evidence.before is False:
        problems.append(f"{p}: {evidence.line()}; the registration does not precede the data")
    try:
        signature = check_signature(p, allowed_signers)
    except SignatureError as exc:
        signature = SignatureCheck("none")
        problems.append(str(exc))
    if signature.refutes:
        problems.append(f"{p}: {signature.line()}")
    return VerifyReport(
        path=str(p), sha256=data["sha256"], name=sealed.get("name"),
        registered_utc=sealed.get("registered_utc"), sealed_utc=sealed.get("sealed_utc"),
        amendments=len(sealed.get("amendments") or []), runs=tuple(str(d) for d in dirs),
        n_data=n_data, earliest_datum=None if earliest is None else earliest[1],
        problems=tuple(problems), git=evidence, signature=signature,
        release_checks=release_checks, ledger_missing=tuple(missing),
    )
