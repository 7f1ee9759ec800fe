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

This module holds :func:`replay_prompt` and names its parts, each a module of its own:
:mod:`bistat.explain.replay_backends` (how an engine is driven), :mod:`bistat.explain.replay_probes`
(the probes and their results) and :mod:`bistat.explain.repro_pack` (the pack written and
reproduced).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from bistat.engines.base import Engine
from bistat.explain.replay_backends import ReplayError, _EmbeddedBackend, _backend
from bistat.explain.replay_probes import (ProbeResult, ReplayReport, SweepPoint, _prefill_vs_decode,
                                          _prefix_cache, _replay_target, _sweep, sweep_sizes)
from bistat.explain.repro_pack import REPRO_SCHEMA, ReproduceResult, _write_pack, reproduce_pack
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
