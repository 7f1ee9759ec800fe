"""Build small recorded runs for the records / analysis / report tests.

``make_run`` registers a declaration (the real ``bistat.declare.prereg.register``, at a fixed time) and
records a run through the real ``RunWriter``, from a compact description of every response.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any, Callable

from bistat.declare.prereg import Registration, register
from bistat.store.writer import RunWriter
from bistat.store.format import logprob_sha256, token_sha256

REGISTERED = dt.datetime(2026, 2, 1, 12, 0, 0, tzinfo=dt.timezone.utc)

GPU_A = {"name": "NVIDIA H200", "uuid": "GPU-aaaa", "serial": "1", "driver": "580.1"}
GPU_B = {"name": "NVIDIA H200", "uuid": "GPU-bbbb", "serial": "2", "driver": "580.1"}


def fingerprint(gpu: dict = GPU_A, vllm: str = "0.25.0") -> dict[str, Any]:
    return {"gpus": [gpu], "cpu": {"model": "x", "count": 2, "machine": "x86_64"},
            "os": {"system": "Linux", "release": "6", "platform": "linux"},
            "versions": {"python": "3.11.7", "numpy": "2.4.6", "torch": None, "triton": None,
                         "vllm": vllm, "bistat": "0.1.0"},
            "git": {"commit": "abc", "dirty": False}, "host": "h"}


def declaration(name: str = "tiny", *, n_prompts: int = 10, passes: int = 2, warmup: int = 0,
                unit: str = "token_ids", multi_pass: str = "all",
                min_mean_running: float = 1.0, max_preemptions: int | None = None,
                same_gpu: bool = True, same_versions: bool = True,
                extra_treatments: tuple[str, ...] = ()) -> str:
    lines = [
        f'name = "{name}"',
        'hypothesis = "The treatment matches; the control does not."',
        "[engine]", 'kind = "embedded"', 'model = "m"',
        "[[arms]]", 'name = "ctl"', 'role = "control"',
        "[[arms]]", 'name = "trt"', 'role = "treatment"',
        *[x for t in extra_treatments for x in ("[[arms]]", f'name = "{t}"', 'role = "treatment"')],
        "[workload]", 'source = "builtin:token-ids"', f"n_prompts = {n_prompts}",
        "max_tokens = 4", "concurrency = 4", f"passes = {passes}", f"warmup_passes = {warmup}",
        "[match]", f'unit = "{unit}"', f'multi_pass = "{multi_pass}"',
        "[validity]",
        f"same_gpu = {'true' if same_gpu else 'false'}",
        f"same_versions = {'true' if same_versions else 'false'}",
    ]
    lines.append(f"min_mean_running = {min_mean_running!r}")
    if max_preemptions is not None:
        lines.append(f"max_preemptions = {max_preemptions}")
    lines += ["[rule]", "[[rule.labels]]", 'label = "working"',
              'all = [ { criterion = "match_lower_bound", arm = "treatment", at_least = 0.5 },',
              '        { criterion = "throughput_ratio", statistic = "point", below = 0.95 } ]']
    return "\n".join(lines) + "\n"


def register_tiny(tmp: Path, text: str, name: str = "tiny") -> Registration:
    toml = tmp / f"{name}.toml"
    toml.write_text(text, encoding="utf-8")
    # model "m" exists only in the synthetic records: no engine check
    reg, _ = register(toml, registrations_dir=tmp / "preregistrations", now=REGISTERED,
                      check_engine=False)
    return reg


Output = Any  # list[int] | dict(token_ids=..., logprobs=..., error=..., text=...)


def make_run(tmp: Path, reg: Registration, outputs: Callable[[str, int, int], Output], *,
             n_prompts: int = 10, passes: int = 2, warmup: int = 0,
             throughput: Callable[[str, int], float] = lambda arm, p: 100.0,
             running: Callable[[str, int], list[float]] = lambda arm, p: [4.0, 4.0],
             preemptions: Callable[[str, int], float] = lambda arm, p: 0.0,
             env_fp: Callable[[str], dict] = lambda arm: fingerprint(),
             status: Callable[[str, int], str] = lambda arm, p: "complete",
             arms: tuple[str, ...] = ("ctl", "trt"),
             events: list[dict] | None = None, run_name: str = "run",
             created_utc: str = "2026-02-01T13:00:00Z",
             host: Callable[[str, int], dict | None] = lambda arm, p: None,
             gpu: Callable[[str, int], dict | None] = lambda arm, p: None,
             block: Callable[[str, int], int] | None = None,
             latency: Callable[[str, int, int], float] = lambda arm, p, i: 0.2) -> Path:
    """Record a run; ``outputs(arm, pass_index, prompt_index)`` gives each response.
    ``block(arm, pass_index)``: the engine start each pass ran in, recorded in its pass and
    schedule records (default: block 0 in the schedule, none in the pass records).
    ``latency(arm, pass_index, prompt_index)``: each response's ``t_done - t_submit``."""
    run_dir = tmp / run_name
    header = {"run_id": run_name, "registration": reg.reference(), "bistat_version": "0.1.0",
              "created_utc": created_utc, "command": ["bistat", "run"],
              "engine_kind": "embedded"}
    plan = []
    for p in range(warmup + passes):
        kind = "warmup" if p < warmup else "counted"
        order = arms if p % 2 == 0 else arms[::-1]
        plan += [(arm, p, kind) for arm in order]
    with RunWriter.create(run_dir, header) as w:
        for arm in arms:
            w.append("environment", {"arm": arm, "block": 0, "fingerprint": env_fp(arm),
                                     "engine": {"kind": "embedded", "version": "0.1.0"},
                                     "log_findings": []})
        for ev in events or []:
            w.append("events", ev)
        for seq, (arm, p, kind) in enumerate(plan):
            b = 0 if block is None else block(arm, p)
            w.append("schedule", {"event": "start", "seq": seq, "arm": arm, "pass_index": p,
                                  "kind": kind, "block": b, "time_utc": "2026-02-01T13:00:01Z"})
            n_failed = 0
            for i in range(n_prompts):
                out = outputs(arm, p, i)
                if out is None:
                    continue
                if isinstance(out, list):
                    out = {"token_ids": out}
                ids = out.get("token_ids", [])
                lps = out.get("logprobs")
                err = out.get("error")
                n_failed += err is not None
                w.append("responses", {
                    "arm": arm, "seq": seq, "pass_index": p, "kind": kind,
                    "prompt_id": f"q{i:02d}", "prompt_index": i, "token_ids": ids,
                    "text": out.get("text", " ".join(map(str, ids))), "logprobs": lps,
                    "top_logprobs": out.get("top_logprobs"), "finish_reason": "length",
                    "n_prompt_tokens": 3,
                    "t_submit": 0.0, "t_first_token": 0.1, "t_done": latency(arm, p, i),
                    "error": err,
                    "attempts": 1, "token_sha256": None if err else token_sha256(ids),
                    "logprob_sha256": None if err else logprob_sha256(lps),
                    **({"preemptions": out["preemptions"]} if "preemptions" in out else {})})
            for t, r in enumerate(running(arm, p)):
                w.append("metrics", {"arm": arm, "seq": seq, "t": float(t),
                                     "num_requests_running": r, "num_requests_waiting": 0.0,
                                     "num_preemptions_total": preemptions(arm, p) * t,
                                     "generation_tokens_total": 0.0, "prompt_tokens_total": 0.0,
                                     "source": "embedded"})
            tps = throughput(arm, p)
            w.append("passes", {"arm": arm, "seq": seq, "pass_index": p, "kind": kind,
                                "wall_s": 40.0 / tps, "n_requests": n_prompts,
                                "n_failed": n_failed, "prompt_tokens": 30, "output_tokens": 40,
                                "output_tokens_per_s": tps, "requests_per_s": n_prompts * tps / 40,
                                "started_utc": "2026-02-01T13:00:01Z", "batching": {},
                                **({"host": host(arm, p)} if host(arm, p) is not None else {}),
                                **({"gpu": gpu(arm, p)} if gpu(arm, p) is not None else {}),
                                **({"block": b} if block is not None else {})})
            w.append("schedule", {"event": "end", "seq": seq, "arm": arm, "pass_index": p,
                                  "kind": kind, "block": b, "time_utc": "2026-02-01T13:00:02Z",
                                  "status": status(arm, p), "n_failed": n_failed})
    return run_dir


def within_arm_spearman(summary: Any, field: str, arms: tuple[str, ...] = ("ctl", "trt")) -> Any:
    """``scipy.stats.spearmanr`` of the counted passes' log wall times less their arm's mean
    against each pass's ``field`` (the analysis's host and GPU notes, computed again by hand)."""
    import math

    from scipy import stats as sps
    resid, values = [], []
    for arm in arms:
        mine = [q for q in summary.passes if q.arm == arm and q.counted]
        mean = sum(math.log(q.wall_s) for q in mine) / len(mine)
        resid += [math.log(q.wall_s) - mean for q in mine]
        values += [getattr(q, field) for q in mine]
    return sps.spearmanr(resid, values)
