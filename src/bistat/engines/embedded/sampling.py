"""Token selection and logprobs, one request's row at a time.

Everything here works on one row of logits and one request's own random generator, so a request's
choices never depend on its neighbours in the batch: a seeded request draws one uniform number per
generated token from ``numpy.random.default_rng(seed)`` (PCG64).

Conventions (those of vLLM's sampler):

* ``temperature == 0`` is greedy: the arg-max, the lowest token id on a tie.
* ``top_k == -1`` (or 0) is off; otherwise the tokens whose logit is below the k-th largest are
  removed (ties at the k-th value are kept).
* ``top_p < 1`` keeps the smallest set of most likely tokens whose probability reaches ``top_p``
  (always at least the most likely one), after temperature and top-k.
* The logprobs returned are those of the model's distribution, ``log_softmax(logits)`` in float32,
  before temperature / top-k / top-p (vLLM's default "raw" logprobs).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1


def select_token(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator | None) -> int:
    """Choose the next token from one row of float32 logits [V]."""
    if params.temperature <= 0.0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / params.temperature  # [V]
    order = np.argsort(-z, kind="stable")  # [V], most likely first, ties by token id
    zs = z[order]
    if 0 < params.top_k < zs.size:
        keep = int(np.searchsorted(-zs, -zs[params.top_k - 1], side="right"))
        zs, order = zs[:keep], order[:keep]
    p = np.exp(zs - zs[0])
    p /= p.sum()
    if params.top_p < 1.0:
        cum = np.cumsum(p)
        keep = int(np.searchsorted(cum, params.top_p, side="left")) + 1
        p, order = p[:keep], order[:keep]
    cdf = np.cumsum(p)
    u = rng.random() * cdf[-1]
    idx = min(int(np.searchsorted(cdf, u, side="right")), cdf.size - 1)
    return int(order[idx])


def top_logprobs(logits: np.ndarray, lse: np.float32, k: int) -> list[tuple[int, float]]:
    """The ``k`` most likely tokens of a row as ``(token_id, logprob)``, best first, ties by id."""
    if k <= 0:
        return []
    if k == 1:
        t = int(np.argmax(logits))
        return [(t, float(logits[t] - lse))]
    k = min(k, logits.size)
    cand = np.argpartition(-logits, k - 1)[:k]  # [k], unordered
    cand = cand[np.lexsort((cand, -logits[cand]))]  # by logit desc, then id
    return [(int(t), float(logits[t] - lse)) for t in cand]
