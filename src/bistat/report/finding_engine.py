"""What ran, as a finding shows it: the environment, the engine version and the activation.

The environment table per arm (engine, GPU, host, versions, the engine's commit and modes, what
each server declares, the declared environment, the tuned GEMM's tables); how the engine release
compares with the newest one recorded and the one required; what each arm asked for and the
evidence that it was on, with the behavioural probe's trials (per needle for a kv-sweep probe).
"""

from __future__ import annotations

from typing import Sequence

from bistat.analysis.probe_report import filler_line
from bistat.analysis.results import RunSummary
from bistat.core.markdown import md_cell, md_table
from bistat.declare.release_log import release_log_path


def _environment(s: RunSummary) -> list[str]:
    out = ["## Environment", ""]
    if not s.environments:
        return out + ["No environment fingerprint was recorded.", ""]
    names = [a for a, _ in s.environments]
    envs = dict(s.environments)
    rows = [("engine", *[envs[a].engine for a in names]),
            ("engine starts", *[str(envs[a].n_starts) for a in names]),
            ("GPU", *[", ".join(envs[a].gpus) or "none" for a in names]),
            ("host", *[envs[a].host or "—" for a in names])]
    keys = [k for k, _ in envs[names[0]].versions]
    for k in keys:
        rows.append((k, *[dict(envs[a].versions).get(k) or "not installed" for a in names]))
    rows += _engine_rows(s, names)
    servers = {r.arm: r for r in s.servers}
    if servers:
        rows += [("server (as it declares itself)",
                  *[servers[a].describe() if a in servers else "not recorded" for a in names]),
                 ("server declares", *[servers[a].settings_text() if a in servers else "—"
                                       for a in names])]
    arm_env = {a["name"]: a.get("env") or {} for a in s.declaration.get("arms", [])}
    rows.append(("declared env", *[", ".join(f"`{k}={v}`" for k, v in sorted(
        arm_env.get(a, {}).items())) or "—" for a in names]))
    rows += _gemm_table_rows(s, names)
    return out + [md_table(("", *names), rows), ""]


def _gemm_table_rows(s: RunSummary, names: Sequence[str]) -> list[tuple[str, ...]]:
    """The tuned GEMM's table per arm and which table served how many shapes, as its engine log
    says (bistat.analysis.activation.logged_gemm_tables); no rows where no arm logged one."""
    acts = {a.arm: a for a in s.activation}
    if not any(a.gemm_table for a in acts.values()):
        return []
    return [("tuned GEMM table (engine log)",
             *["; ".join(acts[a].gemm_table) if a in acts and acts[a].gemm_table else "—"
               for a in names]),
            ("tuned GEMM shapes by table (engine log)",
             *[", ".join(f"{src}: {n}" for src, n in acts[a].gemm_shapes)
               if a in acts and acts[a].gemm_shapes else "—" for a in names])]


def _engine_rows(s: RunSummary, names: Sequence[str]) -> list[tuple[str, ...]]:
    """The environment table's rows for the engine's commit and each arm's compilation and
    CUDA-graph modes (vLLM engines; bistat.declare.engine_version)."""
    ev = s.engine_version
    if ev is None or ev.package is None:
        return []
    by_arm = {a.arm: a for a in ev.arms}
    modes = {a: by_arm[a].modes.describe() if a in by_arm and by_arm[a].modes else None
             for a in names}
    return [("engine commit", *[(by_arm[a].commit if a in by_arm else None) or "—" for a in names]),
            ("compilation", *[m[0] if m else "not recorded" for m in modes.values()]),
            ("CUDA graphs", *[m[1] if m else "not recorded" for m in modes.values()])]


def _engine_version_section(s: RunSummary) -> list[str]:
    """How the engine version measured compares with the newest release known and with the
    version the registration requires (vLLM engines; bistat.declare.engine_version)."""
    ev = s.engine_version
    if ev is None or ev.package is None:
        return []
    rows = [(ev.label(where, c), c.newest or "unknown", c.checked_utc, c.index, c.error or "—")
            for where, c in ev.checks]
    out = ["## Engine version", "", *[f"{line}" for line in ev.comparison], ""]
    if rows:
        out += [f"Newest {ev.package} release, as recorded (the comparison uses the latest check "
                "that found one):", "",
                md_table(("checked", "newest release", "time (UTC)", "index", "why unknown"), rows),
                ""]
        if any(where in ("check-release", "amend") for where, _ in ev.checks):
            log = (f"`{release_log_path(s.registration_path).as_posix()}`"
                   if s.registration_path else "`NAME.releases.jsonl` beside it")
            out += [f"Checks made after the registration was sealed come from its release log "
                    f"({log}: `bistat check-release`, `bistat register --amend`), hashed and "
                    "chained; the seal itself records only the check made at registration.", ""]
    out += [f"Required version (`engine.required_version`): `{ev.required}`; "
            + ("every arm ran a version it allows." if not ev.deviations
               else "arms ran versions it excludes (see Deviations).")
            if ev.required else "The registration requires no engine version.", ""]
    return out


def _activation(s: RunSummary) -> list[str]:
    """What each arm asked for and the evidence that it was on (bistat.analysis.activation)."""
    if not s.activation:
        return []
    probe_cmd = "`bistat probe REGISTRATION --output RUN_DIR/probe.json`"
    parts = []
    if len(s.probe_files) > 1:
        controls = [a.arm for a in s.probe.arms if a.role == "negative_control"] if s.probe else []
        power = ("so one part's negative control gives the others their power" if controls else
                 "but no part ran a negative control (`--control`), so an arm's needle staying "
                 "identical confirms nothing, whatever another probed arm showed")
        parts = [f"The probe ran in {len(s.probe_files)} parts ("
                 + ", ".join(f"`{f}`" for f in s.probe_files)
                 + f"): the same needle and settings on different arms, judged together, {power}.",
                 ""]
    if not (s.engine_kind or "").startswith("vllm"):
        served = any(a.server is not None for a in s.activation)
        backends = bool(s.servers) and any(a.attention for a in s.activation)
        rows = [(a.arm, a.role, ", ".join(f"`{r}`" for r in a.requested) or "—",
                 *((a.server or "not recorded",) if served else ()),
                 *((", ".join(a.attention) or "—",) if backends else ()),
                 (a.probe or "not run").replace("_", " "), a.status) for a in s.activation]
        header = ("arm", "role", "requested (vs control)",
                  *(("server (as it declares itself)",) if served else ()),
                  *(("attention backend (server)",) if backends else ()), "probe", "status")
        note = ([] if not s.servers else [
            "What each arm's server declares about itself (`GET /version` and its model list; "
            "SGLang's `/server_info`) is recorded at every engine start and compared with the "
            "control's: a server that declares nothing leaves the arm's settings *unknown*.", ""])
        return ["## Activation", "",
                f"A setting is *requested* until a behavioural probe with a negative control "
                f"confirms it ({probe_cmd}).", "", *note, *parts,
                md_table(header, rows), "", *_probe_detail(s)]
    flag = {True: "yes", False: "no", None: "—"}
    rows = [(a.arm, a.role, ", ".join(f"`{r}`" for r in a.requested) or "—",
             "**no**" if a.bi_requested and a.bi_kernels_logged is False
             else flag[a.bi_kernels_logged],
             flag[a.tuned_gemm_logged], ", ".join(a.attention) or "—",
             (a.probe or "not run").replace("_", " "), a.status)
            for a in s.activation]
    return ["## Activation", "",
            "vLLM prints no line saying that batch-invariant mode is on, so a setting is "
            f"*requested* until a behavioural probe with a negative control confirms it "
            f"({probe_cmd}). The engine's log, kept at every start, gives circumstantial "
            "evidence: the batch-invariant kernels registering, bistat's tuned GEMM installing "
            "itself, the attention backend chosen.", "", *parts,
            md_table(("arm", "role", "requested (vs control)", "batch-invariant kernels in log",
                      "tuned GEMM in log", "attention backend (log)", "probe", "status"), rows), "",
            *_probe_detail(s)]


def _probe_machine(s: RunSummary) -> list[str]:
    """Where the probe ran (each arm's report keeps its GPUs and engine), and whether that is the
    GPU the study's passes ran on: a probe on another unit speaks for the card type, not the
    unit."""
    probe = s.probe
    if probe is None:
        return []
    gpus: dict[str, str] = {}
    engines: dict[str, None] = {}
    for a in probe.arms:
        for g in (a.machine or {}).get("gpus") or []:
            gpus.setdefault(str(g.get("uuid")), f"{g.get('name')} ({g.get('uuid')}, driver "
                                                 f"{g.get('driver')})")
        eng = (a.machine or {}).get("engine") or {}
        if eng.get("kind"):
            engines.setdefault(" ".join(str(x) for x in (eng["kind"], eng.get("version")) if x))
    if not any(a.machine for a in probe.arms):
        return ["The probe's report does not record the machine it ran on (a report written "
                "before probes recorded it); the run's notes may say.", ""]
    on = f", {', '.join(engines)}" if engines else ""
    if not gpus:
        hosts = sorted({str((a.machine or {}).get("host")) for a in probe.arms if a.machine})
        return [f"The probe ran on {', '.join(hosts)}, no GPU{on}.", ""]
    run_uuids = {u for _, env in s.environments for u in env.gpu_uuids}
    where = ", ".join(gpus.values())
    same = ("the GPU of the study's passes" if set(gpus) <= run_uuids else
            "**not the GPU of the study's passes**" + (
                f" ({', '.join(sorted(run_uuids))})" if run_uuids else "")
            + ": it speaks for the setting on this card type, not for that unit")
    return [f"The probe ran on {where}{on}: {same}.", ""]


def _probe_detail(s: RunSummary) -> list[str]:
    """The probe's trials per arm (batch mode: the needle alone twice, then among fillers), and
    where the probe and the study disagree."""
    probe = s.probe
    if probe is None or probe.settings.mode != "batch":
        return []
    st = probe.settings
    rows = []
    for a in probe.arms:
        role = a.role.replace("_", " ")
        if a.error:
            rows.append((a.arm, role, "—", "—", "—", "—", f"could not run: {a.error}"))
            continue
        n = len(a.trials)
        rows.append((a.arm, role,
                     {True: "identical", False: "**different**", None: "—"}[a.alone_repeat_identical],
                     f"{a.n_identical} / {n}",
                     ", ".join(str(t.n_fillers) for t in a.trials), f"{a.n_shared} / {n}",
                     ", ".join(map(str, a.first_divergences)) or "—"))
    pending = (f" Not probed: {', '.join(probe.pending)}." if probe.pending else "")
    fillers = [f"{a.arm}: {filler_line(a)}" for a in probe.arms if a.n_fillers_compared is not None]
    filler_note = [] if not fillers else [
        "The fillers too: each that ran in two or more trials (among other neighbours, at another "
        "place) compared bitwise with its first trial — " + "; ".join(fillers) + ".", ""]
    study = {a.name: a for a in s.arms}
    missed = [(a, study[a.arm]) for a in probe.arms if a.arm in s.probe_missed]
    disagree = [] if not missed else [
        "**The probe and the study disagree** on " + ", ".join(
            f"{pa.arm} (needle {pa.n_needle_tokens} tokens; {sa.n_prompts_diverged} "
            f"of {sa.n_prompts} prompts diverged across the counted passes)" for pa, sa in missed)
        + ": the probe saw no difference there. A needle"
        + (" and its fillers" if any(pa.n_fillers_compared for pa, _ in missed) else "")
        + f" of {st.max_tokens} tokens at most in {st.trials} trial(s) "
        + ("are" if any(pa.n_fillers_compared for pa, _ in missed) else "is")
        + " weaker evidence than every prompt of every pass; the study's match counts decide."
        + (" To aim the probe at what the study saw, `bistat probe --needle-from` with this "
           "run's directory takes as its needle the prompt that diverged first here."
           if probe.needle_source is None else ""), ""]
    src = probe.needle_source
    chosen = ("" if src is None else
              f", chosen from run `{src.run_id}` where it first diverged earliest (token "
              f"{src.position}, arm {src.arm}, pass {src.pass_index})")
    return [f"Probe (needle `{probe.needle_prompt_id}`{chosen}, {st.trials} trial(s) among "
            f"{st.min_fillers}-{st.max_fillers} fillers, {st.max_tokens} tokens, bitwise token ids "
            f"and logprobs): **{probe.outcome.replace('_', ' ')}** — {probe.reason}.{pending}", "",
            *_probe_machine(s),
            md_table(("arm", "role", "needle alone, twice", "identical among fillers",
                      "fillers per trial", "needle shared an engine step",
                      "first divergence (token)"), rows), "", *filler_note, *_probe_needles(s), *disagree]


def _probe_needles(s: RunSummary) -> list[str]:
    """A kv-sweep probe's outcome per needle (``ProbeReport.needle_outcomes``) and what each arm
    showed at it; nothing for the single design (reports written before designs)."""
    probe = s.probe
    if probe is None or not probe.settings.sweep:
        return []
    st = probe.settings
    by_arm = {a.arm: {n.needle: n for n in a.needles} for a in probe.arms if not a.error}
    rows = []
    for v in probe.needle_outcomes:
        cells = []
        for arm in by_arm:
            n = by_arm[arm].get(v.needle)
            if n is None:
                cells.append("—")
                continue
            same = n.n_identical
            where = ("" if n.kv_first_divergence is None
                     else f", first at KV length {n.kv_first_divergence}")
            repeat = "" if n.alone_repeat_identical is not False else "; alone twice **different**"
            cells.append(f"identical {same} / {len(n.trials)}" if not n.differs else
                         f"**different** in {len(n.trials) - same} / {len(n.trials)}{where}"
                         f"{repeat}")
        keys = "—" if v.kv_low is None else f"{v.kv_low}-{v.kv_high}"
        rows.append((v.needle, "—" if v.target_tokens is None else str(v.target_tokens),
                     md_cell(v.n_prompt_tokens), keys, *cells,
                     f"**{v.outcome.replace('_', ' ')}** — {v.reason}"))
    left = ("" if not probe.left_out else
            " Left out: " + "; ".join(probe.left_out) + ".")
    return [f"Per needle (the kv-sweep design: the needle prompt and needles of about "
            f"{', '.join(map(str, st.long_needles))} prompt tokens, {st.max_tokens} tokens each, "
            f"among fillers of {st.filler_tokens} tokens arriving while they decode; in how many trials "
            f"identical, or different, bitwise).{left}", "",
            md_table(("needle", "design tokens", "prompt tokens", "keys decoded",
                      *[f"{arm}: in batch" for arm in by_arm], "outcome"), rows), ""]
