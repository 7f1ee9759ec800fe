"""The repro pack ``bistat replay`` writes, and ``bistat reproduce`` checks: one folder of versioned
JSON files -- ``manifest.json`` (``bistat.repro/1``), ``prompt.json``, ``settings.json``,
``outputs.json``, ``environment.json``, ``probes.json``, each with its ``schema`` -- plus
``README.md`` and ``reproduce.sh``. :func:`reproduce_pack` re-runs the pack's two conditions
(alone, and the smallest batch whose output differed) and checks their token ids and logprobs
against the recorded hashes.
"""

from __future__ import annotations

import datetime as _dt
import json
import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bistat import __version__
from bistat.analysis.anatomy import DivergenceAnatomy, load_pass_outputs
from bistat.engines.base import Engine, GenerationRequest, GenerationResult
from bistat.explain.replay_backends import ReplayError, _backend
from bistat.explain.replay_probes import ProbeResult, SweepPoint, _Sweep, _Target, _fin, _identical
from bistat.store.format import logprob_sha256, token_sha256


REPRO_SCHEMA = "bistat.repro/1"


PACK_FILES = {
    "manifest.json": "bistat.repro/1",
    "prompt.json": "bistat.repro-prompt/1",
    "settings.json": "bistat.repro-settings/1",
    "outputs.json": "bistat.repro-outputs/1",
    "environment.json": "bistat.repro-environment/1",
    "probes.json": "bistat.repro-probes/1",
}


#: Logprobs kept on each side of the divergence in outputs.json.
WINDOW = 3


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


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False,
                               allow_nan=False) + "\n", encoding="utf-8")


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
