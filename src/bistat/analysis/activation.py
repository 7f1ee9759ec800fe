"""Was the mode an arm asked for actually on? Evidence from the engine's log and from a probe.

vLLM prints no line saying "batch-invariant mode is on" (FIELD-NOTES, "Activation is not confirmed
by the engine"): an arm that set ``VLLM_BATCH_INVARIANT=1`` has *requested* the mode, and only a
behavioural probe (a needle alone vs inside a batch, bitwise; :mod:`bistat.explain.probe`) with a negative
control that shows the probe has power can *confirm* it. What the engine's log does show is
circumstantial and worth stating beside the verdict: the batch-invariant kernels registering
themselves (vLLM 0.25.0 registers aten overrides from
``vllm/model_executor/layers/batch_invariant.py``, which torch reports as "new kernel: registered
at .../batch_invariant.py"), bistat's tuned GEMM installing itself (``bistat_kernels: tuned GEMM
installed``) and the table it resolved for the GPU and each shape (:func:`logged_gemm_tables`),
and the attention backend chosen ("Using FLASH_ATTN attention backend",
"Using FlashAttention version 3", "Using AttentionBackendEnum.TRITON_ATTN backend"). The runner
keeps those lines per engine start (``environment.jsonl``, ``log_findings``; see
:data:`bistat.engines.vllm_server.LOG_FINDING_RE`).

This module is pure: it turns those lines, the declaration's arms and an optional probe report
(``bistat probe --output RUN_DIR/probe.json``) into one :class:`ArmActivation` per arm, and says
what an arm sets beyond its control as a user would set it (:func:`arm_setting`, which the
findings index and ``bistat compare`` both show).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

if TYPE_CHECKING:
    from bistat.declare.experiment import Experiment

#: vLLM 0.25.0: torch's "new kernel: registered at .../layers/batch_invariant.py" as the aten
#: overrides register; 0.33.0 (``determinism/batch_invariant.py``): the same where it still
#: overrides an aten kernel, Dynamo's warning naming ``batch_invariant.py`` when it compiles, and,
#: where it switches to breakable CUDA graphs instead of compiling, "VLLM_BATCH_INVARIANT=1:
#: auto-enabling VLLM_USE_BREAKABLE_CUDAGRAPH=1" (vllm/config/vllm.py); 0.33.0 and 0.34.0 on
#: Hopper, compiled or not: torch's warning that ``preferred_blas_library`` is experimental, which
#: ``enable_batch_invariant_mode`` triggers by choosing cuBLASLt (batch_invariant.py; 0.34.0's line
#: 1474) and nothing else in vLLM does (the only marker a 0.34 engine compiled with the tuned GEMM
#: logs: its GEMMs no longer go through an aten override or Dynamo's warning).
_BI_REGISTERED = re.compile(r"batch_invariant\.py|batch[ _-]invariant (mode|kernels?) (is )?"
                            r"(on|enabled|active)|VLLM_BATCH_INVARIANT=1: auto-enabling"
                            r"|preferred_blas_library is an experimental feature", re.I)
_TUNED = re.compile(r"bistat_kernels: tuned GEMM installed")
#: bistat's tuned GEMM says once per process which table it resolved for the GPU and how
#: (``bistat_kernels.tables.resolve_device_table``), and once per weight shape which table served
#: it (``bistat_kernels.tables.note_shape``): bistat's, vLLM's own or vLLM's fixed configuration
_GEMM_TABLE = re.compile(r"bistat_kernels: batch-invariant GEMM table for [^:]+: (.+?)\s*$")
_GEMM_SHAPE = re.compile(r"bistat_kernels: batch-invariant GEMM (\w+) N=(\d+) K=(\d+) served by "
                         r"(bistat table \S+|vLLM's fixed configuration|vLLM .+?'s \w+ table)")
_BACKENDS = (
    (re.compile(r"Using FlashAttention version (\d)"), lambda m: f"FLASH_ATTN (FA{m.group(1)})"),
    (re.compile(r"Using (?:AttentionBackendEnum\.)?([A-Z][A-Z0-9_]+) (?:attention )?backend"),
     lambda m: m.group(1)),
)


@dataclass(frozen=True)
class ArmActivation:
    """What an arm asked for and what the evidence says.

    Attributes
    ----------
    arm, role : str
    requested : tuple of str
        The arm's settings that differ from the control arm's (``KEY=value`` of its environment,
        ``key=value`` of its engine arguments); empty for the control.
    bi_requested : bool
        The arm set ``VLLM_BATCH_INVARIANT=1``.
    bi_kernels_logged : bool or None
        The engine log showed the batch-invariant kernels registering; None without engine logs.
    tuned_gemm_logged : bool or None
        The engine log showed bistat's tuned GEMM installing itself; None without engine logs.
    attention : tuple of str
        Attention backends named in the engine log (in order of first appearance).
    probe : str or None
        The probe's outcome for this arm (``confirmed``, ``violated``, ``no_power``, ``untested``,
        ``vacuous``) when a probe report is in the run directory.
    status : str
        One line: ``confirmed by the probe``, ``requested; logged, not confirmed by a probe``,
        ``requested; NOT seen in the engine log``, ``requested; no engine log to check`` ... .
    """

    arm: str
    role: str
    requested: tuple[str, ...]
    bi_requested: bool
    bi_kernels_logged: bool | None
    tuned_gemm_logged: bool | None
    attention: tuple[str, ...]
    probe: str | None
    status: str
    #: what the arm's server declared (``bistat serve 0.1.0: gemm=invariant``), for engines that
    #: drive a server bistat knows by its own declaration (bistat.analysis.servers); None otherwise
    server: str | None = None
    #: the GEMM table bistat's tuned GEMM logged it resolved, and how (one per distinct line)
    gemm_table: tuple[str, ...] = ()
    #: which table served how many weight shapes, as logged (``(source, shapes)``)
    gemm_shapes: tuple[tuple[str, int], ...] = ()


def log_markers(lines: Iterable[str]) -> dict[str, Any]:
    """``{"bi_kernels": bool, "tuned_gemm": bool, "attention": (backend, ...)}`` from log lines.

    >>> log_markers(["INFO [cuda.py:416] Using AttentionBackendEnum.TRITON_ATTN backend.",
    ...              "new kernel: registered at /x/vllm/model_executor/layers/batch_invariant.py:905"])
    {'bi_kernels': True, 'tuned_gemm': False, 'attention': ('TRITON_ATTN',)}
    """
    bi = tuned = False
    attention: dict[str, None] = {}
    for line in lines:
        bi = bi or bool(_BI_REGISTERED.search(line))
        tuned = tuned or bool(_TUNED.search(line))
        for pattern, name in _BACKENDS:
            m = pattern.search(line)
            if m:
                attention.setdefault(name(m))
    # "Using FLASH_ATTN attention backend" and "Using FlashAttention version 3" name one backend
    if "FLASH_ATTN" in attention and any(a.startswith("FLASH_ATTN (") for a in attention):
        del attention["FLASH_ATTN"]
    return {"bi_kernels": bi, "tuned_gemm": tuned, "attention": tuple(attention)}


def logged_gemm_tables(lines: Iterable[str]) -> tuple[tuple[str, ...], tuple[tuple[str, int], ...]]:
    """The tuned GEMM's table lines (distinct, in order) and the number of distinct weight shapes
    each source served, from engine-log lines.

    >>> logged_gemm_tables([
    ...     "bistat_kernels: batch-invariant GEMM table for NVIDIA H100 (x): t.json, by "
    ...     "architecture; shapes without an entry: vLLM's fixed configuration",
    ...     "bistat_kernels: batch-invariant GEMM bfloat16 N=8 K=4 served by bistat table t.json",
    ...     "bistat_kernels: batch-invariant GEMM bfloat16 N=2 K=4 served by vLLM's fixed "
    ...     "configuration, on vLLM's own kernel"])
    (("t.json, by architecture; shapes without an entry: vLLM's fixed configuration",), (('bistat table t.json', 1), ("vLLM's fixed configuration", 1)))
    """
    found: dict[str, None] = {}
    shapes: dict[tuple[str, str, str], str] = {}
    for line in lines:
        m = _GEMM_TABLE.search(line)
        if m:
            found.setdefault(m.group(1))
        m = _GEMM_SHAPE.search(line)
        if m:
            shapes.setdefault(m.group(1, 2, 3), m.group(4))
    counts: dict[str, int] = {}
    for source in shapes.values():
        counts[source] = counts.get(source, 0) + 1
    return tuple(found), tuple(counts.items())


def _probe_outcome(entry: Mapping[str, Any] | None, entries: Iterable[Mapping[str, Any]],
                   overall: Any) -> str | None:
    """This arm's probe outcome: ``violated`` if its needle differed; else the report's outcome,
    except that another arm's violation leaves this one ``confirmed`` when a negative control
    differed (the probe had power) and ``no_power`` when none did."""
    if entry is None or entry.get("role") != "probed" or overall is None:
        return None
    if entry.get("differs"):
        return "violated"
    if overall == "violated":
        controls = [e for e in entries if e.get("role") == "negative_control"]
        return "confirmed" if any(e.get("differs") for e in controls) else "no_power"
    return str(overall)


#: Engine arguments that configure bistat's handling of an engine (where its log goes, how long to
#: wait, retries), not the engine: never a "requested setting".
HANDLING_KEYS = frozenset({"log_path", "url", "command", "python", "health_timeout_s",
                           "stop_grace_s", "start_timeout_s", "pass_idle_timeout_s",
                           "metrics_interval_s", "retries", "backoff_s", "max_retry_wait_s",
                           "request_timeout_s", "stream_outputs"})


def _requested(arm: Mapping[str, Any], control: Mapping[str, Any]) -> tuple[str, ...]:
    env, cenv = arm.get("env") or {}, control.get("env") or {}
    args, cargs = arm.get("args") or {}, control.get("args") or {}
    out = [f"{k}={env[k]}" for k in sorted(env) if cenv.get(k) != env[k]]
    out += [f"{k}={args[k]}" for k in sorted(args)
            if k not in HANDLING_KEYS and cargs.get(k) != args[k]]
    # what the control sets and this arm leaves to the engine's default is a difference too
    # (a control on TRITON_ATTN, a treatment on the engine's own attention backend)
    out += [f"{k} unset (control: {cenv[k]})" for k in sorted(cenv) if k not in env]
    out += [f"{k} unset (control: {cargs[k]})" for k in sorted(cargs)
            if k not in HANDLING_KEYS and k not in args]
    return tuple(out)


def _server_differences(arm: str, report: Any, control: Any, control_name: str
                        ) -> tuple[tuple[str, ...], str | None]:
    """How an arm's server differs from the control's by what each declares
    (:class:`bistat.analysis.servers.ServerReport`): ``(differences, unknown)``, ``unknown`` the
    status when either server declares nothing (then nothing can be compared)."""
    silent = [name for name, r in ((arm, report), (control_name, control))
              if r is None or not r.reported]
    if silent:
        return (f"server settings unknown ({' and '.join(silent)}: the server declares "
                "nothing)",), (f"unknown: the server of {' and '.join(silent)} declares nothing "
                               "(GET /version), so whether this arm runs other settings than the "
                               "control cannot be told")
    mine, theirs = dict(report.settings), dict(control.settings)
    diffs = [f"server {k}={mine[k]} (control's server: {theirs.get(k, 'not declared')})"
             for k in sorted(mine) if mine[k] != theirs.get(k)]
    diffs += [f"server {k} not declared (control's server: {theirs[k]})"
              for k in sorted(theirs) if k not in mine]
    if (report.name, report.version) != (control.name, control.version):
        diffs.insert(0, f"server {report.describe()} (control's: {control.describe()})")
    return tuple(diffs), None


def _status(role: str, bi: bool, requested: Sequence[str], logged: bool | None,
            probe: str | None, diverged: tuple[int, int] | None = None,
            unknown: str | None = None) -> str:
    if probe == "confirmed" and diverged is not None and diverged[0] > 0:
        # the probe's one needle is weaker evidence than the study's every prompt
        return (f"the probe saw no difference, but {diverged[0]} of {diverged[1]} prompts "
                "diverged across the study's counted passes: the probe missed it")
    if probe == "confirmed":
        return "confirmed by the probe (invariant, with a negative control that shows power)"
    if probe == "violated":
        return "the probe found it NOT batch-invariant"
    if role == "control":
        return "control: nothing requested"
    if unknown is not None:
        return unknown + ("" if probe is None else f"; probe: {probe.replace('_', ' ')}")
    if not requested:
        return "same settings as the control"
    suffix = "" if probe is None else f"; probe: {probe.replace('_', ' ')}"
    if not bi:
        return ("requested; not confirmed by a probe" if probe is None else "requested" + suffix)
    if logged is None:
        return "requested; no engine log to check" + suffix
    if not logged:
        return "requested; NOT seen in the engine log" + suffix
    return "requested; kernels registered in the engine log, not confirmed by a probe" + suffix


def arm_activation(arms: Sequence[Mapping[str, Any]],
                   log_findings: Mapping[str, Sequence[str]],
                   probe_report: Mapping[str, Any] | None = None,
                   diverged: Mapping[str, tuple[int, int]] | None = None,
                   servers: Mapping[str, Any] | None = None,
                   compare_servers: bool = False,
                   ) -> tuple[ArmActivation, ...]:
    """One :class:`ArmActivation` per declared arm.

    Parameters
    ----------
    arms : sequence of mapping
        The declaration's arms (``name``, ``role``, ``env``, ``args``).
    log_findings : mapping
        Arm name -> the engine-log lines kept for it (every start); an arm without an entry has no
        engine log (the embedded engine, a remote server).
    probe_report : mapping, optional
        A ``bistat.probe/1`` report (:mod:`bistat.explain.probe`).
    diverged : mapping, optional
        Arm name -> (prompts that diverged across the study's counted passes, prompts compared):
        a probe that confirms an arm the study saw diverge is reported as having missed it.
    servers : mapping, optional
        Arm name -> what its server declared (:class:`bistat.analysis.servers.ServerReport`);
        an SGLang server's declared attention backend (and deterministic flag) is the arm's
        backend.
    compare_servers : bool
        The engine drives servers bistat knows only by their declaration (two ``openai`` arms
        that differ only in ``url``): each treatment is compared with the control on what their
        servers declare, and a server that declares nothing makes it *unknown*, never "same
        settings as the control".
    """
    control = next((a for a in arms if a.get("role") == "control"), {})
    control_name = str(control.get("name"))
    probed = {str(a.get("arm")): a for a in (probe_report or {}).get("arms") or []}
    overall = (probe_report or {}).get("outcome")
    servers = servers or {}
    out = []
    for a in arms:
        name, role = str(a.get("name")), str(a.get("role"))
        requested = _requested(a, control) if role != "control" else ()
        unknown = None
        report = servers.get(name)
        if compare_servers and role != "control":
            diffs, unknown = _server_differences(name, report, servers.get(control_name),
                                                 control_name)
            requested += diffs
        bi = str((a.get("env") or {}).get("VLLM_BATCH_INVARIANT", "0")) == "1"
        lines = log_findings.get(name)
        marks = log_markers(lines) if lines is not None else None
        attention = () if marks is None else marks["attention"]
        if report is not None and report.setting("attention_backend"):
            attention = (report.setting("attention_backend"),)   # as the server resolved it
        if report is not None and report.setting("enable_deterministic_inference") == "true":
            attention += ("deterministic",)
        probe = _probe_outcome(probed.get(name), probed.values(), overall)
        gemm_table, gemm_shapes = logged_gemm_tables(lines or ())
        out.append(ArmActivation(
            arm=name, role=role, requested=requested, bi_requested=bi,
            bi_kernels_logged=None if marks is None else marks["bi_kernels"],
            tuned_gemm_logged=None if marks is None else marks["tuned_gemm"],
            attention=attention, probe=probe,
            status=_status(role, bi, requested, None if marks is None else marks["bi_kernels"],
                           probe, (diverged or {}).get(name), unknown),
            server=None if report is None or not compare_servers else (report.describe() + (
                f": {report.settings_text()}" if report.reported and report.settings else "")),
            gemm_table=gemm_table, gemm_shapes=gemm_shapes))
    return tuple(out)


#: Settings that switch a batch-invariant mode on (environment variable or engine argument, and
#: its value). An arm's setting names them even where its control has them too (a study of two
#: attention backends, both in batch-invariant mode), since without them nothing holds.
MODE_SWITCHES = frozenset({("VLLM_BATCH_INVARIANT", "1"), ("gemm", "invariant"),
                           ("enable_deterministic_inference", "True")})


def _flag(key: str, value: Any) -> str:
    """An engine argument as on a command line: ``--attention-backend TRITON_ATTN``."""
    flag = "--" + key.replace("_", "-")
    if isinstance(value, bool):
        return flag if value else "--no-" + key.replace("_", "-")
    return f"{flag} {value}"


def arm_setting(exp: "Experiment", arm: str) -> tuple[tuple[str, ...], bool]:
    """What ``arm`` sets, as a user sets it, and whether that switches a batch-invariant mode on.

    The setting is every environment variable and engine argument in which the arm differs from
    the control, plus the mode switches it has on (:data:`MODE_SWITCHES`): the mode switches
    first, then environment variables (``BISTAT_FA3_PIN=1``), then engine arguments as
    command-line flags (``--attention-backend TRITON_ATTN``). Arguments that configure bistat's
    handling of the engine (its log file, timeouts) are not settings.
    """
    arms = {a.name: a for a in exp.arms}
    control = next(a for a in exp.arms if a.role == "control")
    a = arms[arm]
    items = [(k, str(v), f"{k}={v}", 1) for k, v in sorted(a.env.items())
             if control.env.get(k) != v or (k, str(v)) in MODE_SWITCHES]
    items += [(k, str(v), _flag(k, v), 2) for k, v in sorted(a.args.items())
              if k not in HANDLING_KEYS and (control.args.get(k) != v
                                             or (k, str(v)) in MODE_SWITCHES)]
    items.sort(key=lambda i: ((i[0], i[1]) not in MODE_SWITCHES, i[3], i[0]))
    return (tuple(i[2] for i in items),
            any((i[0], i[1]) in MODE_SWITCHES for i in items))
