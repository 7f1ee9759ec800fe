"""Validity (the analysis's phase 4): what each arm ran on, the declared validity checks, what the
declaration asked for and the run did not do, and why an arm cannot be tested.

A comparison is *untested* only for reasons of its own two arms (:func:`pair_status`): an arm
whose engine died does not make the comparisons of the other arms untestable.
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

import pandas as pd

from bistat.analysis.passes import PassSummary
from bistat.analysis.results import ArmEnvironment, ArmSummary
from bistat.analysis.servers import ServerReport
from bistat.core.classify_inputs import RunTestable, ValidityCheck
from bistat.declare.experiment import Experiment
from bistat.run.fingerprint import same_node, version_differences
from bistat.store.format import parse_time
from bistat.store.readers import optional_str as _opt_str

__all__ = ["OPTIONAL_VERSION_KEYS", "VERSION_KEYS", "bad_events", "with_engine_versions", "environments", "not_run", "pair_status", "untestable",
           "validity_checks"]

VERSION_KEYS = ("python", "numpy", "torch", "triton", "vllm", "sglang", "bistat")
#: version keys shown and compared only where some arm's environment has them (an engine's own
#: package: SGLang's version is in its adapter's report, not in bistat's environment)
OPTIONAL_VERSION_KEYS = ("sglang",)


def with_engine_versions(fp: Mapping[str, Any]) -> Mapping[str, Any]:
    """A fingerprint with the versions its engine reported (``engine_reported.versions``: SGLang's
    environment, read by its adapter) over the runner's: the software the arm's engine ran."""
    reported = fp.get("engine_reported")
    versions = reported.get("versions") if isinstance(reported, Mapping) else None
    if not isinstance(versions, Mapping):
        return fp
    return {**fp, "versions": {**(fp.get("versions") or {}),
                               **{k: v for k, v in versions.items() if v is not None}}}


def environments(env: pd.DataFrame, arm_names: Sequence[str],
                 servers: Sequence[ServerReport] = (), declared_server: bool = False) -> tuple[
        dict[str, ArmEnvironment], dict[str, list[Mapping[str, Any]]]]:
    """Per arm: what it ran on (every engine start's fingerprint, with the versions its engine
    reported) and those fingerprints. ``declared_server``: the engine is whatever server the
    arm's URL or command reaches, named by what it declares (``servers``)."""
    reports = {r.arm: r for r in servers}
    envs: dict[str, ArmEnvironment] = {}
    fps: dict[str, list[Mapping[str, Any]]] = {}
    if env.empty:
        return envs, fps
    for arm in arm_names:
        rows = env[env["arm"] == arm]
        if rows.empty:
            continue
        prints = [with_engine_versions(fp) if isinstance(fp, Mapping) else {}
                  for fp in rows["fingerprint"]]
        fps[arm] = prints
        gpus: dict[str, None] = {}
        uuids: dict[str, None] = {}
        for fp in prints:
            for g in fp.get("gpus") or []:
                gpus.setdefault(f"{g.get('name')} ({g.get('uuid')}, driver {g.get('driver')})")
                uuids.setdefault(str(g.get("uuid")))
        last = prints[-1]
        versions = last.get("versions") or {}
        engine = rows["engine"].iloc[-1] if "engine" in rows else None
        engine = engine if isinstance(engine, Mapping) else {}
        engine_text = " ".join(str(x) for x in (engine.get("kind"), engine.get("version"))
                               if x is not None) or "unknown"
        if declared_server and arm in reports:   # the server measured, not the client
            engine_text = f"{engine.get('kind')} → {reports[arm].describe()}"
        logs: dict[str, None] | None = None
        if "log_findings" in rows:
            for found in rows["log_findings"]:
                if isinstance(found, (list, tuple)):
                    logs = logs if logs is not None else {}
                    for line in found:
                        logs.setdefault(_strip_pid(str(line)))
        envs[arm] = ArmEnvironment(
            gpus=tuple(gpus), gpu_uuids=tuple(uuids),
            versions=tuple((k, None if versions.get(k) is None else str(versions.get(k)))
                           for k in VERSION_KEYS
                           if k not in OPTIONAL_VERSION_KEYS or versions.get(k) is not None),
            engine=engine_text, host=last.get("host"), n_starts=len(prints),
            log_findings=None if logs is None else tuple(logs))
    return envs, fps


_LOG_PREFIX = re.compile(r"^\((?:EngineCore|APIServer|Worker|MainProcess)[^)]*pid=\d+\)\s*")
_LOG_STAMP = re.compile(r"^(INFO|WARNING|ERROR|DEBUG) \d\d-\d\d \d\d:\d\d:\d\d ")


def _strip_pid(line: str) -> str:
    """A log line without vLLM's process prefix and time stamp (so starts compare equal)."""
    return _LOG_STAMP.sub(r"\1 ", _LOG_PREFIX.sub("", line.strip()))


def validity_checks(exp: Experiment, passes: Sequence[PassSummary],
                    fps: Mapping[str, list[Mapping[str, Any]]],
                    envs: Mapping[str, ArmEnvironment], registered_utc: str,
                    created_utc: str | None, *, exploratory: bool = False,
                    servers: Sequence[ServerReport] = (), remote: bool = False
                    ) -> list[ValidityCheck]:
    """The declared validity checks. ``exploratory``: the rule was sealed after the data (a
    sibling registered later): the order is then stated as the analysis's nature, not checked.
    ``servers``: what each arm's server declared (:mod:`bistat.analysis.servers`); ``remote``:
    the servers run elsewhere, so ``same versions`` compares what they declare, not the
    client's fingerprint."""
    checks: list[ValidityCheck] = []
    v = exp.validity
    counted = [p for p in passes if p.counted]
    if created_utc is not None and not exploratory:
        try:
            ok: bool | None = parse_time(registered_utc) <= parse_time(created_utc)
        except (TypeError, ValueError):
            ok = None
        checks.append(ValidityCheck(
            name="registration precedes data", passed=ok, observed=created_utc,
            limit=f"after {registered_utc}",
            detail={True: "run created after the registration (its last sealing)",
                    False: "the run was created before the registration was sealed: not a "
                           "pre-registered test",
                    None: "a time is not ISO 8601"}[ok]))
    if v.min_mean_running is not None:
        measured = [p for p in counted if p.mean_running is not None]
        if measured:
            low = min(measured, key=lambda p: (p.mean_running, p.seq))
            checks.append(ValidityCheck(
                name="mean running requests", passed=bool(low.mean_running >= v.min_mean_running),
                observed=round(low.mean_running, 6), limit=v.min_mean_running,
                detail=f"lowest over counted passes: {low.arm} pass {low.pass_index} "
                       f"(schedule position {low.seq})"))
        else:
            checks.append(ValidityCheck(
                name="mean running requests", passed=None, observed=None,
                limit=v.min_mean_running, detail="no engine metrics recorded for counted passes"))
    if v.max_preemptions is not None:
        measured = [p for p in counted if p.preemptions is not None]
        if measured:
            per_arm: dict[str, float] = {}
            for p in measured:
                per_arm[p.arm] = per_arm.get(p.arm, 0.0) + float(p.preemptions or 0.0)
            worst = max(sorted(per_arm), key=lambda a: per_arm[a])
            checks.append(ValidityCheck(
                name="preemptions", passed=bool(per_arm[worst] <= v.max_preemptions),
                observed=per_arm[worst], limit=v.max_preemptions,
                detail=f"most in one arm's counted passes: {worst}"))
        else:
            checks.append(ValidityCheck(
                name="preemptions", passed=None, observed=None, limit=v.max_preemptions,
                detail="no preemption counter recorded for counted passes"))
    arms = [a.name for a in exp.arms]
    all_fps = [fp for a in arms for fp in fps.get(a, [])]
    missing = [a for a in arms if a not in fps]
    if v.same_gpu:
        if missing or not all_fps:
            checks.append(ValidityCheck("same GPU", None, None, "identical GPU UUIDs",
                                        f"no fingerprint for arm(s) {', '.join(missing)}"))
        else:
            ok = same_node(all_fps)
            observed = "; ".join(f"{a}: {', '.join(envs[a].gpu_uuids) or 'no GPU'}" for a in arms)
            checks.append(ValidityCheck(
                "same GPU", ok, observed, "identical GPU UUIDs (host and CPU without a GPU)",
                "one physical device set for every arm" if ok else
                "arms ran on different devices (or a GPU UUID was unreadable)"))
    if v.same_versions:
        if missing or not all_fps:
            checks.append(ValidityCheck("same versions", None, None, "identical versions",
                                        f"no fingerprint for arm(s) {', '.join(missing)}"))
        elif servers and remote:
            checks.append(_same_server_versions(arms, servers))
        else:
            keys = [k for k in VERSION_KEYS if k not in OPTIONAL_VERSION_KEYS
                    or any((fp.get("versions") or {}).get(k) for fp in all_fps)]
            differing = version_differences(all_fps, keys)
            if servers:   # a server started here from a command: what it declares too
                named = {r.describe() for r in servers}
                if len(named) > 1:
                    differing.append("server: " + " / ".join(sorted(named)))
            ok = not differing
            coded = any(fp.get("code") for fp in all_fps)   # runs recorded since code digests
            checks.append(ValidityCheck(
                "same versions", ok, "; ".join(differing) or "identical",
                f"identical {', '.join(keys)}, git commit, driver"
                + (", bistat code" if coded else "")
                + (", the servers' declared versions" if servers else ""),
                "every engine start of every arm" if ok else "software differs between arms"))
    return checks


def _same_server_versions(arms: Sequence[str], servers: Sequence[ServerReport]) -> ValidityCheck:
    """``same versions`` for servers started elsewhere: what each arm's server declares (the
    runner's own fingerprint describes only the client). A server that declares nothing leaves
    the check not evaluable."""
    reports = {r.arm: r for r in servers}
    observed = "; ".join(f"{a}: {reports[a].describe() if a in reports else 'not recorded'}"
                         for a in arms)
    limit = "identical server name and version, as each arm's server declares them"
    silent = [a for a in arms if a not in reports or not reports[a].reported
              or reports[a].version is None]
    if silent:
        return ValidityCheck("same versions", None, observed, limit,
                             f"the server of arm(s) {', '.join(silent)} declares no version "
                             "(GET /version): unknown, so the arms' software cannot be compared")
    ok = len({(reports[a].name, reports[a].version) for a in arms}) == 1
    return ValidityCheck("same versions", ok, observed, limit,
                         "every arm's server declares the same" if ok
                         else "the arms' servers declare different software")


def bad_events(events: pd.DataFrame) -> tuple[list[tuple[str, str, str | None]], list[str]]:
    """The engines' refusals and failed starts, and what else held the GPU, from the events."""
    bad_events: list[tuple[str, str, str | None]] = []
    gpu_busy: list[str] = []
    if not events.empty:
        for arm, event, detail in zip(events["arm"], events["event"], events["detail"]):
            if event in ("refused", "start_failed"):
                bad_events.append((str(arm), str(event), _opt_str(detail)))
            elif event == "gpu_busy":
                gpu_busy.append(_opt_str(detail) or "processes not named")
    return bad_events, gpu_busy


def not_run(exp: Experiment, arms: Sequence[ArmSummary], passes: Sequence[PassSummary],
             envs: Mapping[str, ArmEnvironment], bad_events: Sequence[tuple[str, str, str | None]],
             gpu_busy: Sequence[str], gaps: Sequence[str], deviations: list[str]) -> list[str]:
    """Phase 4 (validity): what the declaration asked for and the run did not do; the
    departures from it go into ``deviations``."""
    not_run: list[str] = []
    wl = exp.workload
    for a in arms:
        n_counted = len(a.counted_passes)
        if n_counted == 0:
            not_run.append(f"arm {a.name}: no counted pass recorded (declared {wl.passes})")
        elif n_counted < wl.passes:
            not_run.append(f"arm {a.name}: {wl.passes - n_counted} of {wl.passes} declared "
                           "counted passes not recorded")
        elif n_counted > wl.passes:
            deviations.append(f"arm {a.name}: {n_counted} counted passes recorded, "
                              f"{wl.passes} declared")
        mine = [p for p in passes if p.arm == a.name and p.counted]
        if mine and all(p.n_requests and p.n_failed == p.n_requests for p in mine):
            not_run.append(f"arm {a.name}: its {len(mine)} counted pass(es) ran, but the engine "
                           "answered none of their requests (every request failed)")
        # Warm-ups run after every engine start (restarts per block, resumes), so the declared
        # count applies per start of the arm's engine.
        n_warm = len({p.pass_index for p in passes if p.arm == a.name and p.kind == "warmup"
                      and p.status != "interrupted"})
        n_starts = envs[a.name].n_starts if a.name in envs else 1
        if n_warm != wl.warmup_passes * max(n_starts, 1):
            deviations.append(f"arm {a.name}: {n_warm} warm-up pass(es) recorded, "
                              f"{wl.warmup_passes} declared per engine start "
                              f"({max(n_starts, 1)} start(s))")
        if a.n_excluded_failed:
            deviations.append(f"arm {a.name}: {a.n_failed_requests} failed request(s) in counted "
                              f"passes; {a.n_excluded_failed} prompt(s) excluded from matching")
        if a.n_excluded_missing:
            deviations.append(f"arm {a.name}: {a.n_excluded_missing} prompt(s) missing from a "
                              "counted pass; excluded from matching")
        if a.n_excluded_no_logprobs:
            deviations.append(f"arm {a.name}: {a.n_excluded_no_logprobs} prompt(s) without "
                              "logprobs; excluded from matching")
        if a.n_prompts_recorded and a.n_prompts_recorded != wl.n_prompts:
            deviations.append(f"arm {a.name}: {a.n_prompts_recorded} prompts recorded, "
                              f"{wl.n_prompts} declared")
    for p in passes:
        if p.counted and p.n_requests is not None and p.n_requests != wl.n_prompts:
            deviations.append(f"{p.arm} pass {p.pass_index}: {p.n_requests} requests, "
                              f"{wl.n_prompts} declared")
    for arm, event, detail in bad_events:
        not_run.append(f"arm {arm}: engine {event.replace('_', ' ')}" +
                       (f" ({detail})" if detail else ""))
    for detail in gpu_busy:
        deviations.append(f"other processes held the GPU when the run (or a resume) started, "
                          f"allowed with --allow-busy-gpu: {detail}; they shared its memory and "
                          f"time with the arms' engines")
    if gaps:
        deviations.append(f"{len(gaps)} unreadable record line(s) ignored (see Data gaps)")
    return not_run


def untestable(bad_events: Sequence[tuple[str, str, str | None]],
                arms: Sequence[ArmSummary], declared_passes: int) -> list[tuple[str, str]]:
    """Phase 4 (validity): why an arm cannot be tested, each reason with its arm (a comparison is
    untested only for reasons of its own two arms: an arm whose engine died does not make the
    comparisons of the other arms untestable).

    An arm with fewer counted passes than registered did not run the registered test: with
    ``multi_pass = "all"`` fewer passes give fewer chances to diverge (a lenient test), and a cost
    decided on them was not the one planned. Its numbers are still reported (a pilot); the
    comparison's label is *untested*."""
    arm_reasons: list[tuple[str, str]] = []
    for arm, event, detail in bad_events:
        arm_reasons.append((arm, f"arm {arm}: engine {event.replace('_', ' ')}"
                            + (f": {detail}" if detail else "")))
    for a in arms:
        if not a.counted_passes:
            arm_reasons.append((a.name, f"arm {a.name}: no counted pass recorded"))
        elif len(a.counted_passes) < 2:
            # one pass always matches itself: comparing it would report "identical" for nothing
            arm_reasons.append((a.name, f"arm {a.name}: only {len(a.counted_passes)} counted pass "
                                "recorded; a comparison needs at least 2 counted passes per arm"))
        elif len(a.counted_passes) < declared_passes:
            arm_reasons.append((a.name, f"arm {a.name}: stopped early, {len(a.counted_passes)} "
                                f"of {declared_passes} registered counted passes recorded (a "
                                "pilot: the registered test did not run in full)"))
        elif a.n_prompts_recorded and a.n_prompts == 0 and a.n_excluded_failed == \
                a.n_prompts_recorded:
            arm_reasons.append((a.name, f"arm {a.name}: every prompt had a failed request"))
        elif a.n_units == 0:
            arm_reasons.append((a.name, f"arm {a.name}: no prompt could be compared"))
    return arm_reasons


def pair_status(arm_reasons: Sequence[tuple[str, str]], control: str, treatment: str) -> RunTestable:
    """The run status one comparison is classified under: untestable only for the reasons that
    concern its own control or treatment arm."""
    mine = [r for arm, r in arm_reasons if arm in (control, treatment)]
    return RunTestable(False, "; ".join(mine)) if mine else RunTestable(True)
