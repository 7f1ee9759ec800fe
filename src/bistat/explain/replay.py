"""``bistat replay``: re-run one diverging prompt under targeted probes and write a repro pack.

The prompt is re-run on its arm's engine with the run's sampling settings:

* **alone**, twice (run-to-run determinism with nothing else in the batch);
* a **batch-size sweep**: among 1, 2, 4, ..., ``max_fillers`` (default 128) co-batched filler
  prompts of the workload, the needle in the middle of the batch, all submitted together; each
  output is compared bitwise with the alone output;
* **prefill vs decode**: the logprob each generated token got while decoding, against the one
  it gets when the same prefix (prompt + earlier generated tokens) is prefilled in one pass, up
  to a few tokens past the divergence. On the embedded engine this calls its forward pass
  directly (:func:`bistat.engines.embedded.forward.forward_step`); other engines need a
  ``prompt_logprobs(request, continuation)`` method (e.g. vLLM's ``prompt_logprobs``), else the
  probe is reported *unsupported*;
* **prefix cache cold vs warm**: the needle first after the engine starts (cold) and again
  (warm); *not applicable* on engines without a prefix cache (the embedded one).

The embedded engine is driven through :meth:`EmbeddedEngine.generate`, which queues every
request before the first step, so the batch compositions -- and hence the outputs -- are
deterministic and a repro pack reproduces bit for bit. Other engines are driven through the
:class:`~bistat.engines.base.Engine` protocol (``run_pass`` with every request in flight).

The repro pack (one folder) holds versioned JSON files -- ``manifest.json`` (``bistat.repro/1``),
``prompt.json``, ``settings.json``, ``outputs.json``, ``environment.json``, ``probes.json``, each
with its ``schema`` -- plus ``README.md`` and ``reproduce.sh``. ``bistat reproduce PACK`` (see
:func:`reproduce_pack`) re-runs the pack's two conditions (alone, and the smallest batch whose
output differed) and checks their token ids and logprobs against the recorded hashes.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from bistat import __version__
from bistat.analysis.anatomy import (
    DEFAULT_TOP_LOGPROBS,
    DivergenceAnatomy,
    divergence_anatomy,
    first_divergence,
    load_pass_outputs,
)
from bistat.engines.base import (
    Engine,
    EngineUnsupported,
    GenerationRequest,
    GenerationResult,
    MetricsSample,
)
from bistat.engines.registry import capabilities
from bistat.store.format import logprob_sha256, token_sha256
from bistat.declare.run_registration import run_declaration
from bistat.store.run_dir import RecordedRun

__all__ = [
    "REPRO_SCHEMA",
    "ProbeResult",
    "ReplayError",
    "ReplayReport",
    "ReproduceResult",
    "SweepPoint",
    "replay_prompt",
    "reproduce_pack",
    "sweep_sizes",
]

REPRO_SCHEMA = "bistat.repro/1"
PACK_FILES = {
    "manifest.json": "bistat.repro/1",
    "prompt.json": "bistat.repro-prompt/1",
    "settings.json": "bistat.repro-settings/1",
    "outputs.json": "bistat.repro-outputs/1",
    "environment.json": "bistat.repro-environment/1",
    "probes.json": "bistat.repro-probes/1",
}
#: Generated tokens checked past the divergence in the prefill-vs-decode probe.
PREFILL_TAIL = 3
#: Logprobs kept on each side of the divergence in outputs.json.
WINDOW = 3


class ReplayError(Exception):
    """A replay cannot be made: unknown prompt, missing registration, unreadable pack."""


# --------------------------------------------------------------------------------------------
# backends
# --------------------------------------------------------------------------------------------


class _Backend(Protocol):
    prefix_cache: bool | None

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]: ...

    def prefill_logprobs(self, request: GenerationRequest, tokens: Sequence[int],
                         upto: int) -> list[float] | str: ...

    def stop(self) -> None: ...


class _EmbeddedBackend:
    """The embedded engine, not started: ``generate`` runs steps in this thread, deterministically."""

    prefix_cache = None  # no prefix cache at all

    def __init__(self, model_name: str, args: Mapping[str, Any]) -> None:
        from bistat.engines.embedded.engine import EmbeddedEngine
        from bistat.engines.embedded.adapter import ENGINE_ARGS
        from bistat.model import load_model

        unknown = sorted(set(args) - set(ENGINE_ARGS))
        if unknown:
            raise ReplayError(f"embedded engine: unknown argument(s) {unknown}; expected some of "
                              f"{list(ENGINE_ARGS)}")
        self.model = load_model(model_name)
        self.engine = EmbeddedEngine(self.model, **dict(args))

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        return self.engine.generate(list(requests))

    def prefill_logprobs(self, request: GenerationRequest, tokens: Sequence[int],
                         upto: int) -> list[float] | str:
        from bistat.engines.embedded import ops
        from bistat.engines.embedded.forward import Segment, forward_step
        from bistat.engines.embedded.kvcache import KVCache

        eng = self.engine
        prompt = eng.encode_prompt(request)
        d = eng.weights.dims
        out: list[float] = []
        for j in range(min(upto, len(tokens))):
            ids = list(prompt) + [int(t) for t in tokens[:j]]
            cache = KVCache(d.num_hidden_layers, d.num_key_value_heads, d.head_dim,
                            eng.max_model_len, initial=len(ids))
            logits = forward_step(eng.weights, [Segment(cache, ids, 0, True)],
                                  eng.gemm)  # [1, V]
            lse, _ = ops.log_softmax_rows(logits)  # [1]
            out.append(float(logits[0, int(tokens[j])] - lse[0]))
        return out

    def stop(self) -> None:
        return None


class _EngineBackend:
    """Any engine through the ``Engine`` protocol (all requests in flight at once)."""

    def __init__(self, engine: Engine, prefix_cache: bool | None) -> None:
        self.engine = engine
        self.prefix_cache = prefix_cache
        engine.start()

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        got: dict[str, GenerationResult] = {}

        def on_result(r: GenerationResult) -> None:
            got[r.prompt_id] = r

        def on_metrics(_: MetricsSample) -> None:
            return None

        self.engine.run_pass(list(requests), concurrency=len(requests), on_result=on_result,
                             on_metrics=on_metrics)
        missing = [r.prompt_id for r in requests if r.prompt_id not in got]
        if missing:
            raise ReplayError(f"the engine returned no result for {missing[:3]}")
        return [got[r.prompt_id] for r in requests]

    def prefill_logprobs(self, request: GenerationRequest, tokens: Sequence[int],
                         upto: int) -> list[float] | str:
        fn = getattr(self.engine, "prompt_logprobs", None)
        if not callable(fn):  # adapters that wrap an HTTP client (vllm-server) expose it there
            fn = getattr(getattr(self.engine, "client", None), "prompt_logprobs", None)
        if not callable(fn):
            return (f"unsupported: engine kind {getattr(self.engine, 'kind', '?')!r} returns no "
                    "prompt logprobs through the Engine protocol (needs a prompt_logprobs method, "
                    "e.g. vLLM's prompt_logprobs request field)")
        try:
            return [float(x) for x in fn(request, list(tokens[:upto]))]
        except EngineUnsupported as exc:
            return f"unsupported: {exc}"

    def stop(self) -> None:
        self.engine.stop()


def _truthy(v: Any) -> bool:
    return v is True or (isinstance(v, str) and v.lower() in ("1", "true", "yes", "on"))


def _backend(declaration: Mapping[str, Any], arm: str,
             engine_factory: Callable[[Any, Any], Engine] | None) -> _Backend:
    from bistat.declare.experiment import validate_experiment

    exp = validate_experiment(dict(declaration), source="registration declaration")
    arm_obj = next(a for a in exp.arms if a.name == arm)
    args = exp.arm_args(arm_obj)
    if capabilities(exp.engine.kind).in_process_replay and engine_factory is None:
        if arm_obj.env:
            raise ReplayError(f"arms[{arm}].env: the embedded engine cannot apply environment "
                              "variables")
        return _EmbeddedBackend(str(exp.engine.model), args)
    if engine_factory is None:
        from bistat.engines.registry import create_engine

        engine_factory = create_engine
    pc = any(_truthy(v) for k, v in args.items()
             if k.replace("-", "_").lstrip("_") == "enable_prefix_caching")
    return _EngineBackend(engine_factory(exp, arm_obj), pc)


# --------------------------------------------------------------------------------------------
# results
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# replay
# --------------------------------------------------------------------------------------------


def _identical(a: GenerationResult, b: GenerationResult) -> tuple[bool, int | None]:
    found = first_divergence(a.token_ids, b.token_ids, a.logprobs, b.logprobs)
    return found is None, None if found is None else found[0]


def _result_dict(r: GenerationResult, around: int | None = None) -> dict[str, Any]:
    lps = r.logprobs
    lo, hi = (0, len(r.token_ids)) if around is None else (max(0, around - WINDOW),
                                                          around + WINDOW + 1)
    return {"token_ids": [int(t) for t in r.token_ids], "text": r.text,
            "finish_reason": r.finish_reason,
            "token_sha256": token_sha256(r.token_ids), "logprob_sha256": logprob_sha256(lps),
            "logprobs_window": {"start": lo, "logprobs": [_fin(x) for x in (lps or [])[lo:hi]],
                                "top_logprobs": [[[int(t), _fin(v)] for t, v in pos]
                                                 for pos in (r.top_logprobs or [])[lo:hi]]},
            "error": r.error}


def _fin(x: Any) -> float | None:
    return None if x is None or not math.isfinite(float(x)) else float(x)


def _request_dict(r: GenerationRequest) -> dict[str, Any]:
    return {"prompt_id": r.prompt_id,
            "prompt": r.prompt if isinstance(r.prompt, str) else [int(t) for t in r.prompt],
            "max_tokens": r.max_tokens, "temperature": r.temperature, "top_p": r.top_p,
            "top_k": r.top_k, "seed": r.seed, "logprobs": r.logprobs,
            "ignore_eos": r.ignore_eos, "chat": r.chat}


def _request_from(d: Mapping[str, Any]) -> GenerationRequest:
    prompt = d["prompt"]
    return GenerationRequest(prompt_id=str(d["prompt_id"]),
                             prompt=prompt if isinstance(prompt, str) else [int(t) for t in prompt],
                             max_tokens=int(d["max_tokens"]), temperature=float(d["temperature"]),
                             top_p=float(d["top_p"]), top_k=int(d["top_k"]),
                             seed=None if d.get("seed") is None else int(d["seed"]),
                             logprobs=int(d["logprobs"]), ignore_eos=bool(d["ignore_eos"]),
                             chat=bool(d["chat"]))


def _batch(needle: GenerationRequest, fillers: Sequence[GenerationRequest], n: int
           ) -> tuple[list[GenerationRequest], int]:
    chosen = [replace(fillers[j % len(fillers)],
                      prompt_id=f"filler-{j}-{fillers[j % len(fillers)].prompt_id}")
              for j in range(n)]
    position = n // 2
    return chosen[:position] + [needle] + chosen[position:], position


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False,
                               allow_nan=False) + "\n", encoding="utf-8")


def replay_prompt(run_dir: str | Path | RecordedRun, prompt_id: str, *, arm: str | None = None,
                  out_dir: str | Path | None = None, max_fillers: int = 128,
                  top_k: int | None = None, base_dir: Path | None = None,
                  engine_factory: Callable[[Any, Any], Engine] | None = None) -> ReplayReport:
    """Replay one prompt of a recorded run and write its repro pack.

    Parameters
    ----------
    run_dir : path or RecordedRun
        The recorded run; its registration (``run.json`` ``registration.path``) gives the engine,
        arm settings and workload.
    prompt_id : str
        The prompt to replay (a diverging one is the point, but any prompt works).
    arm : str, optional
        The arm; default: the arm in which the prompt diverged (the first, in registration order),
        else the control arm.
    out_dir : path, optional
        The repro pack folder (created; refused when it already holds a pack); default
        ``repro/<run id>/<prompt id>-<arm>`` under the working directory (the run directory
        itself is never written to).
    max_fillers : int
        Largest batch of co-batched fillers in the sweep.
    top_k : int, optional
        Logprobs per position (default: ``workload.top_logprobs`` when declared, else 5).
    base_dir : path, optional
        Where a relative ``file:`` prompt source is resolved (default: the working directory).
    engine_factory : callable, optional
        ``(experiment, arm) -> Engine`` for non-embedded engines (and tests).
    """
    target = _replay_target(RecordedRun.of(run_dir), prompt_id, arm, out_dir=out_dir,
                            max_fillers=max_fillers, top_k=top_k, base_dir=base_dir)
    backend = _backend(target.declaration, target.arm, engine_factory)
    try:
        sweep = _sweep(backend, target.needle, target.fillers, max_fillers)
        prefill = _prefill_vs_decode(backend, target, sweep)
        cache = _prefix_cache(backend, sweep)
    finally:
        backend.stop()
    token_ids = None
    if isinstance(backend, _EmbeddedBackend):
        token_ids = backend.engine.encode_prompt(target.needle)
    elif not isinstance(target.prompt.prompt, str):
        token_ids = list(target.prompt.prompt)
    conditions = _write_pack(target, sweep, prefill, cache, token_ids, max_fillers)
    return ReplayReport(run_id=str(target.header.get("run_id")), arm=target.arm,
                        prompt_id=prompt_id, pack_dir=target.pack,
                        alone_repeat_identical=sweep.repeat_same, sweep=tuple(sweep.points),
                        prefill_decode=prefill, prefix_cache=cache,
                        reproduced_condition=conditions.reproduced)


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


def _recorded_outputs(target: _Target) -> dict[str, Any]:
    """The run's two outputs of the needle that diverged (reference and other pass), around the
    divergence; nothing when it did not diverge in the arm."""
    div, recorded = target.divergence, {}
    if div is None:
        return recorded
    outputs = load_pass_outputs(target.run)
    for side, s in (("reference", div.reference), ("other", div.other)):
        o = outputs.get((target.arm, s.pass_index, target.prompt.prompt_id))
        if o is None:
            continue
        lo = max(0, div.position - WINDOW)
        hi = div.position + WINDOW + 1
        recorded[side] = {
            "pass_index": s.pass_index, "seq": s.seq,
            "token_ids": list(o.token_ids), "text": o.text,
            # a trimmed run (bistat compact --trim) keeps only a prefix of this
            # output: its recorded hash, never one of the prefix
            "token_sha256": (o.token_sha256 if o.trimmed and o.token_sha256
                             else token_sha256(o.token_ids)),
            "logprobs_window": {"start": lo,
                                "logprobs": [_fin(x) for x in (o.logprobs or ())[lo:hi]],
                                "top_logprobs": [[[t, _fin(v)] for t, v in pos] for pos in
                                                 (o.top_logprobs or ())[lo:hi]]}}
        if o.trimmed:
            recorded[side]["token_ids_trimmed"] = {"kept": len(o.token_ids),
                                                   "n_tokens": o.n_tokens}
    return recorded


@dataclass(frozen=True)
class _Conditions:
    """The conditions a pack re-runs: the needle alone, and the batch that changed it."""

    conditions: list[dict[str, Any]]
    reproduced: str | None


def _conditions(target: _Target, sweep: _Sweep) -> _Conditions:
    alone = sweep.alone
    around = target.divergence.position if target.divergence is not None else None
    conditions = [{"name": "alone", "requests": [_request_dict(target.needle)],
                   "needle_position": 0, "expected": _result_dict(alone, around)}]
    if sweep.first_differing is None:
        return _Conditions(conditions, None)
    n, batch, position, res = sweep.first_differing
    conditions.append({"name": f"batch of {n} filler(s)",
                       "requests": [_request_dict(r) for r in batch],
                       "needle_position": position,
                       "expected": _result_dict(res, _identical(alone, res)[1])})
    return _Conditions(conditions, f"{n} filler(s)")


def _write_pack(target: _Target, sweep: _Sweep, prefill: ProbeResult, cache: ProbeResult,
                token_ids: list[int] | None, max_fillers: int) -> _Conditions:
    """Step 5: the repro pack's files (``PACK_FILES``, ``reproduce.sh``, ``README.md``, the
    manifest last)."""
    from bistat.run.fingerprint import collect_fingerprint

    pack, exp, arm, header = target.pack, target.experiment, target.arm, target.header
    div, needle, prompt_obj = target.divergence, target.needle, target.prompt
    prompt_id, run_dir = prompt_obj.prompt_id, target.run.path
    pack.mkdir(parents=True, exist_ok=True)
    recorded = _recorded_outputs(target)
    conditions = _conditions(target, sweep)
    env_rows = target.run.table("environment").to_dict("records")
    recorded_env = [r.get("fingerprint") for r in env_rows if r.get("arm") == arm]
    engine_rows = [r.get("engine") for r in env_rows if r.get("arm") == arm]
    arm_env = dict(next(a for a in exp.arms if a.name == arm).env)
    commands = [f"bistat reproduce {shlex.quote(str(pack))}",
                f"bistat replay {shlex.quote(str(run_dir))} --prompt {shlex.quote(prompt_id)} "
                f"--arm {shlex.quote(arm)} --max-fillers {max_fillers}"]
    created = _now()
    common = {"bistat_version": __version__, "created_utc": created}
    _write_json(pack / "prompt.json", {
        "schema": PACK_FILES["prompt.json"], **common, "prompt_id": prompt_id,
        "prompt_index": prompt_obj.index,
        "text": prompt_obj.prompt if isinstance(prompt_obj.prompt, str) else None,
        "token_ids": token_ids, "chat": prompt_obj.chat, "source": exp.workload.source})
    _write_json(pack / "settings.json", {
        "schema": PACK_FILES["settings.json"], **common, "arm": arm,
        "engine": {"kind": exp.engine.kind, "model": str(exp.engine.model),
                   "args": exp.arm_args(arm), "env": arm_env,
                   "recorded": engine_rows[-1] if engine_rows else None},
        "request": _request_dict(needle), "declaration": target.declaration,
        "registration": header.get("registration")})
    _write_json(pack / "outputs.json", {
        "schema": PACK_FILES["outputs.json"], **common, "recorded": recorded,
        "divergence": None if div is None else {
            "position": div.position, "kind": div.kind, "label": div.label,
            "margin": _fin(div.margin) if div.margin is not None else None,
            "margin_is_bound": div.margin_is_bound,
            "reference_pass": div.reference.pass_index, "other_pass": div.other.pass_index},
        "conditions": conditions.conditions})
    _write_json(pack / "environment.json", {
        "schema": PACK_FILES["environment.json"], **common,
        "replay": collect_fingerprint(arm_env), "recorded": recorded_env})
    _write_json(pack / "probes.json", {
        "schema": PACK_FILES["probes.json"], **common,
        "alone_repeat_identical": sweep.repeat_same,
        "sweep": [{"n_fillers": p.n_fillers, "needle_position": p.position,
                   "identical": p.identical, "first_divergence": p.first_divergence,
                   "tokens_identical": p.tokens_identical,
                   "first_token_divergence": p.first_token_divergence,
                   "token_sha256": p.token_sha256, "logprob_sha256": p.logprob_sha256}
                  for p in sweep.points],
        "prefill_vs_decode": {"status": prefill.status, "detail": prefill.detail,
                              **dict(prefill.data)},
        "prefix_cache": {"status": cache.status, "detail": cache.detail, **dict(cache.data)}})
    (pack / "reproduce.sh").write_text(
        "#!/bin/sh\n# Re-run this repro pack's conditions and check the outputs bit for bit.\n"
        "set -e\nbistat reproduce \"$(dirname \"$0\")\"\n", encoding="utf-8")
    (pack / "reproduce.sh").chmod(0o755)
    (pack / "README.md").write_text(_readme(prompt_id, arm, header, exp.engine.kind,
                                            str(exp.engine.model), div, conditions.conditions,
                                            commands, sweep.points, prefill, cache),
                                    encoding="utf-8")
    _write_json(pack / "manifest.json", {
        "schema": REPRO_SCHEMA, **common, "run_id": str(header.get("run_id")),
        "prompt_id": prompt_id, "arm": arm,
        "files": {name: schema for name, schema in PACK_FILES.items()},
        "commands": commands})
    return conditions


def _readme(prompt_id: str, arm: str, header: Mapping[str, Any], kind: str, model: str,
            div: DivergenceAnatomy | None, conditions: Sequence[Mapping[str, Any]],
            commands: Sequence[str], sweep: Sequence[SweepPoint], prefill: ProbeResult,
            cache: ProbeResult) -> str:
    lines = [f"# Repro pack: prompt {prompt_id}, arm {arm}", "",
             f"From run `{header.get('run_id')}` (engine `{kind}`, model `{model}`), written by "
             f"bistat {__version__}.", ""]
    if div is not None:
        lines += [f"In the run, counted passes {div.reference.pass_index} and "
                  f"{div.other.pass_index} of this prompt first differ at token {div.position}: "
                  f"{div.reference.token_id} vs {div.other.token_id} ({div.label}, margin "
                  f"{'≥ ' if div.margin_is_bound else ''}"
                  f"{'—' if div.margin is None else f'{div.margin:.3g}'} nats).", ""]
    setup = ([f"The model is bistat's registered `{model}`: `bistat model fetch {model}` "
              "first on a new machine.", ""] if "/" not in model and "\\" not in model else
             [f"The model is the folder `{model}`: copy it to the same path (or edit "
              "`settings.json`, `declaration.engine.model`) on a new machine.", ""])
    lines += ["## Reproduce", "", *setup, "```sh", *commands[:1], "```", "",
              "or `sh reproduce.sh` from anywhere.", "",
              "It re-runs each condition below with the settings in `settings.json` and checks "
              "the needle's token ids and logprobs against the hashes in `outputs.json` "
              "(exit code 0 when every condition reproduces).", ""]
    for c in conditions:
        e = c["expected"]
        lines.append(f"- **{c['name']}** ({len(c['requests'])} request(s), needle at position "
                     f"{c['needle_position']}): token_sha256 `{e['token_sha256'][:16]}…`")
    if len(conditions) < 2:
        lines.append("- no batch of the sweep changed the output: only the alone output is "
                     "reproduced")
    lines += ["", "## Probes", ""]
    lines += [f"- with {p.n_fillers} filler(s): "
              + ("identical" if p.identical else
                 f"logprobs differ from token {p.first_divergence}" if p.tokens_identical else
                 f"tokens differ from token {p.first_token_divergence}") for p in sweep]
    lines += [f"- prefill vs decode: {prefill.status} ({prefill.detail})",
              f"- prefix cache cold vs warm: {cache.status} ({cache.detail})", "",
              "## Files", "",
              *[f"- `{n}` (`{s}`)" for n, s in PACK_FILES.items()],
              "", "To replay the whole probe set from the run directory:", "", "```sh",
              commands[1], "```", ""]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# reproduce
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ConditionCheck:
    name: str
    expected_token_sha256: str
    got_token_sha256: str | None
    expected_logprob_sha256: str | None
    got_logprob_sha256: str | None
    error: str | None = None

    @property
    def reproduced(self) -> bool:
        return (self.error is None and self.got_token_sha256 == self.expected_token_sha256
                and self.got_logprob_sha256 == self.expected_logprob_sha256)


@dataclass(frozen=True)
class ReproduceResult:
    pack_dir: Path
    checks: tuple[ConditionCheck, ...]

    @property
    def reproduced(self) -> bool:
        return all(c.reproduced for c in self.checks)

    def summary_lines(self) -> list[str]:
        lines = [f"repro pack {self.pack_dir}"]
        for c in self.checks:
            state = "reproduced" if c.reproduced else "NOT reproduced"
            extra = f" ({c.error})" if c.error else ""
            lines.append(f"  {c.name}: {state}{extra}")
        lines.append("all conditions reproduced" if self.reproduced else
                     "some conditions did not reproduce: compare environment.json with this "
                     "machine (`bistat doctor`)")
        return lines


def _read_pack_file(pack: Path, name: str) -> dict[str, Any]:
    path = pack / name
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ReplayError(f"{path}: not found; is {pack} a repro pack (bistat replay)?") from exc
    except ValueError as exc:
        raise ReplayError(f"{path}: not valid JSON ({exc})") from exc
    expected = PACK_FILES[name]
    found = data.get("schema") if isinstance(data, dict) else None
    if found != expected:
        kind = expected.rsplit("/", 1)[0]
        hint = ("; upgrade bistat to read newer packs"
                if isinstance(found, str) and found.startswith(kind + "/") else "")
        raise ReplayError(f"{path}: field 'schema' is {found!r}, expected {expected!r}{hint}")
    return data


def reproduce_pack(pack_dir: str | Path, *,
                   engine_factory: Callable[[Any, Any], Engine] | None = None
                   ) -> ReproduceResult:
    """Re-run a repro pack's conditions and check the needle's outputs against the recorded hashes."""
    pack = Path(pack_dir)
    _read_pack_file(pack, "manifest.json")
    settings = _read_pack_file(pack, "settings.json")
    outputs = _read_pack_file(pack, "outputs.json")
    backend = _backend(settings["declaration"], settings["arm"], engine_factory)
    checks = []
    try:
        for c in outputs["conditions"]:
            exp = c["expected"]
            reqs = [_request_from(r) for r in c["requests"]]
            try:
                res = backend.generate(reqs)[int(c["needle_position"])]
            except ReplayError as exc:
                checks.append(ConditionCheck(c["name"], exp["token_sha256"], None,
                                             exp.get("logprob_sha256"), None, str(exc)))
                continue
            checks.append(ConditionCheck(
                c["name"], exp["token_sha256"],
                None if res.error else token_sha256(res.token_ids),
                exp.get("logprob_sha256"), None if res.error else logprob_sha256(res.logprobs),
                res.error))
    finally:
        backend.stop()
    return ReproduceResult(pack, tuple(checks))
