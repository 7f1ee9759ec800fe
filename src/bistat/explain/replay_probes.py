"""The probes ``bistat replay`` runs on one diverging prompt, and their results: the prompt it
re-runs (from the recorded run: :func:`_replay_target`), the batch-size sweep (the needle among
1, 2, 4, ... co-batched fillers, each output compared bitwise with the alone output), prefill vs
decode (the logprob each generated token got while decoding against the one a prefill of the same
prefix gives) and the prefix cache cold vs warm.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from bistat.analysis.anatomy import (DEFAULT_TOP_LOGPROBS, DivergenceAnatomy, divergence_anatomy,
                                     first_divergence)
from bistat.declare.run_registration import run_declaration
from bistat.engines.base import GenerationRequest, GenerationResult
from bistat.explain.replay_backends import ReplayError, _Backend
from bistat.store.format import logprob_sha256, token_sha256
from bistat.store.run_dir import RecordedRun


#: Generated tokens checked past the divergence in the prefill-vs-decode probe.
PREFILL_TAIL = 3


@dataclass(frozen=True)
class SweepPoint:
    """The needle among ``n_fillers`` fillers against the alone output (bitwise, and tokens only)."""

    n_fillers: int
    position: int
    identical: bool                      # token ids and logprob bits
    first_divergence: int | None         # first token whose id or logprob bits differ
    tokens_identical: bool
    first_token_divergence: int | None   # first token whose id differs
    token_sha256: str
    logprob_sha256: str | None


@dataclass(frozen=True)
class ProbeResult:
    name: str
    status: str            # "identical" | "differs" | "unsupported" | "not applicable"
    detail: str
    data: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ReplayReport:
    run_id: str
    arm: str
    prompt_id: str
    pack_dir: Path
    alone_repeat_identical: bool
    sweep: tuple[SweepPoint, ...]
    prefill_decode: ProbeResult
    prefix_cache: ProbeResult
    reproduced_condition: str | None   # the differing condition the pack reproduces, if any

    def summary_lines(self) -> list[str]:
        lines = [f"replay of prompt {self.prompt_id} (arm {self.arm}, run {self.run_id})",
                 f"  alone twice: {'identical' if self.alone_repeat_identical else 'DIFFERENT'}"]
        for p in self.sweep:
            if p.identical:
                what = "identical"
            elif p.tokens_identical:
                what = f"same tokens, logprobs DIFFERENT from token {p.first_divergence}"
            else:
                what = (f"tokens DIFFERENT from token {p.first_token_divergence} (logprobs from "
                        f"token {p.first_divergence})")
            lines.append(f"  with {p.n_fillers} filler(s): {what}")
        lines.append(f"  prefill vs decode: {self.prefill_decode.status}: "
                     f"{self.prefill_decode.detail}")
        lines.append(f"  prefix cache cold vs warm: {self.prefix_cache.status}: "
                     f"{self.prefix_cache.detail}")
        lines.append(f"repro pack: {self.pack_dir}"
                     + (f" (reproduces alone vs {self.reproduced_condition})"
                        if self.reproduced_condition else " (no batch condition differed)"))
        return lines


def sweep_sizes(max_fillers: int) -> list[int]:
    """1, 2, 4, ... up to ``max_fillers`` (included when not a power of two).

    >>> sweep_sizes(128)
    [1, 2, 4, 8, 16, 32, 64, 128]
    >>> sweep_sizes(20)
    [1, 2, 4, 8, 16, 20]
    """
    if max_fillers < 1:
        raise ValueError(f"max_fillers ({max_fillers}) must be at least 1")
    out, n = [], 1
    while n <= max_fillers:
        out.append(n)
        n *= 2
    if out[-1] != max_fillers:
        out.append(max_fillers)
    return out


def _identical(a: GenerationResult, b: GenerationResult) -> tuple[bool, int | None]:
    found = first_divergence(a.token_ids, b.token_ids, a.logprobs, b.logprobs)
    return found is None, None if found is None else found[0]


def _fin(x: Any) -> float | None:
    return None if x is None or not math.isfinite(float(x)) else float(x)


def _batch(needle: GenerationRequest, fillers: Sequence[GenerationRequest], n: int
           ) -> tuple[list[GenerationRequest], int]:
    chosen = [replace(fillers[j % len(fillers)],
                      prompt_id=f"filler-{j}-{fillers[j % len(fillers)].prompt_id}")
              for j in range(n)]
    position = n // 2
    return chosen[:position] + [needle] + chosen[position:], position


@dataclass(frozen=True)
class _Target:
    """What a replay replays: the run, its declaration, the arm, the needle and its fillers, and
    where the pack goes."""

    run: RecordedRun
    header: Mapping[str, Any]
    declaration: Mapping[str, Any]
    experiment: Any                  # bistat.declare.experiment.Experiment
    arm: str
    divergence: DivergenceAnatomy | None
    prompt: Any                      # bistat.run.workload.Prompt, the needle's
    needle: GenerationRequest
    fillers: list[GenerationRequest]
    pack: Path


def _replay_target(run: RecordedRun, prompt_id: str, arm: str | None, *,
                   out_dir: str | Path | None, max_fillers: int, top_k: int | None,
                   base_dir: Path | None) -> _Target:
    """Step 1: the registered declaration, the arm (default: where the prompt diverged, else
    the control), the needle's request and the fillers' (the workload's other prompts), the
    pack folder (refused when it holds a pack)."""
    from bistat.declare.experiment import validate_experiment
    from bistat.run.workload import load_prompts, prompt_seed

    run_dir, header = run.path, run.header
    decl = run_declaration(run)
    if decl is None:
        raise ReplayError(f"{run_dir / 'run.json'}: registration.path does not name a readable "
                          "registration; the replay needs the registered declaration")
    exp = validate_experiment(decl, source="registration declaration")
    wl = exp.workload
    anatomy = divergence_anatomy(run)
    divs = [d for d in anatomy.divergences if d.prompt_id == prompt_id]
    arm_names = [a.name for a in exp.arms]
    if arm is None:
        arm = next((a for a in arm_names if any(d.arm == a for d in divs)), exp.control.name)
    if arm not in arm_names:
        raise ReplayError(f"--arm {arm!r} is not an arm of {exp.name}; arms: "
                          + ", ".join(arm_names))
    div: DivergenceAnatomy | None = next((d for d in divs if d.arm == arm), None)
    n_prompts = max(wl.n_prompts, max_fillers + 1)
    try:
        prompts = load_prompts(wl.source, n_prompts, wl.seed, base_dir=base_dir)
    except Exception:  # noqa: BLE001 - a file source may hold only the declared prompts
        prompts = load_prompts(wl.source, wl.n_prompts, wl.seed, base_dir=base_dir)
    by_id = {p.prompt_id: p for p in prompts}
    if prompt_id not in by_id:
        known = ", ".join(sorted(by_id)[:5])
        raise ReplayError(f"--prompt {prompt_id!r} is not a prompt of {exp.name}'s workload "
                          f"({wl.source}); e.g. {known}")
    k = top_k or int(getattr(wl, "top_logprobs", 0) or DEFAULT_TOP_LOGPROBS)

    def request(p) -> GenerationRequest:
        return p.request(max_tokens=wl.max_tokens, temperature=wl.temperature, top_p=wl.top_p,
                         top_k=wl.top_k, seed=prompt_seed(wl.seed, p.index),
                         ignore_eos=wl.ignore_eos, logprobs=k)

    run_id = str(header.get("run_id") or run_dir.name)
    pack = (Path(out_dir) if out_dir is not None else
            Path("repro") / run_id / f"{prompt_id}-{arm}")
    if (pack / "manifest.json").exists():
        raise ReplayError(f"{pack}: already holds a repro pack; choose another --out")
    return _Target(run, header, decl, exp, arm, div, by_id[prompt_id], request(by_id[prompt_id]),
                   [request(p) for p in prompts if p.prompt_id != prompt_id], pack)


#: (fillers, the batch, the needle's place in it, the needle's result)
_Condition = tuple[int, list[GenerationRequest], int, GenerationResult]


@dataclass(frozen=True)
class _Sweep:
    """Step 2: the needle alone twice (cold, warm), then with growing batches of fillers."""

    alone: GenerationResult
    repeat_same: bool
    repeat_at: int | None
    points: list[SweepPoint]
    #: the smallest batch that changed the tokens, else the logprobs (the pack reproduces it)
    first_differing: _Condition | None


def _sweep(backend: _Backend, needle: GenerationRequest, fillers: Sequence[GenerationRequest],
           max_fillers: int) -> _Sweep:
    cold = backend.generate([needle])[0]
    warm = backend.generate([needle])[0]
    for r in (cold, warm):
        if r.error is not None:
            raise ReplayError(f"the needle's request failed: {r.error}")
    repeat_same, repeat_at = _identical(cold, warm)
    alone = cold
    points: list[SweepPoint] = []
    first_differing: _Condition | None = None
    first_lp_only: _Condition | None = None
    for n in sweep_sizes(max_fillers):
        batch, position = _batch(needle, fillers, n)
        res = backend.generate(batch)[position]
        if res.error is not None:
            raise ReplayError(f"the needle's request failed with {n} fillers: {res.error}")
        same, at = _identical(alone, res)
        tok = first_divergence(alone.token_ids, res.token_ids)
        points.append(SweepPoint(n, position, same, at, tok is None,
                                 None if tok is None else tok[0],
                                 token_sha256(res.token_ids), logprob_sha256(res.logprobs)))
        if tok is not None and first_differing is None:
            first_differing = (n, batch, position, res)
        elif not same and first_lp_only is None:
            first_lp_only = (n, batch, position, res)
    return _Sweep(alone, repeat_same, repeat_at, points, first_differing or first_lp_only)


def _prefill_vs_decode(backend: _Backend, target: _Target, sweep: _Sweep) -> ProbeResult:
    """Step 3: the needle's generated tokens fed back as a prompt, its logprobs against the
    decode's, up to a few tokens past the divergence (the run's, else the sweep's)."""
    alone = sweep.alone
    focus: int | None = None
    if target.divergence is not None:
        focus = target.divergence.position
    elif sweep.first_differing is not None:
        focus = _identical(alone, sweep.first_differing[3])[1]
    upto = len(alone.token_ids) if focus is None else min(len(alone.token_ids),
                                                          focus + PREFILL_TAIL + 1)
    pre = backend.prefill_logprobs(target.needle, alone.token_ids, upto)
    if isinstance(pre, str):
        return ProbeResult("prefill_vs_decode", "unsupported", pre)
    dec = [float(x) for x in (alone.logprobs or [])[:upto]]
    diffs = [abs(a - b) for a, b in zip(dec, pre)]
    bad = [j for j, (a, b) in enumerate(zip(dec, pre))
           if np.float64(a).view(np.int64) != np.float64(b).view(np.int64)]
    data = {"positions": upto, "decode_logprobs": [_fin(x) for x in dec],
            "prefill_logprobs": [_fin(x) for x in pre],
            "max_abs_difference": max(diffs) if diffs else 0.0,
            "first_differing_position": bad[0] if bad else None}
    if not bad:
        return ProbeResult("prefill_vs_decode", "identical",
                           f"bitwise equal at all {upto} generated position(s) checked", data)
    return ProbeResult("prefill_vs_decode", "differs",
                       f"{len(bad)} of {upto} position(s) differ, first at token {bad[0]}; "
                       f"max |Δ logprob| {max(diffs):.3g}", data)


def _prefix_cache(backend: _Backend, sweep: _Sweep) -> ProbeResult:
    """Step 4: the needle first after the engine's start (cold) against again (warm)."""
    if backend.prefix_cache is None:
        return ProbeResult("prefix_cache", "not applicable",
                           "the embedded engine has no prefix cache")
    state = "on" if backend.prefix_cache else "off"
    return ProbeResult(
        "prefix_cache", "identical" if sweep.repeat_same else "differs",
        f"prefix caching {state}; the needle first after engine start (cold) and again "
        f"(warm): " + ("bitwise identical" if sweep.repeat_same else
                       f"first divergence at token {sweep.repeat_at}"),
        {"prefix_caching": backend.prefix_cache})
