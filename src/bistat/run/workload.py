"""The requests of a pass: which prompts (:mod:`bistat.declare.prompts`, re-exported here) are sent
in which order, with which sampling seed and output length.
"""

from __future__ import annotations

import zlib
from typing import Sequence

import numpy as np

from bistat.declare.prompts import (  # noqa: F401 - re-exported: the prompts a pass sends
    CHAT_CAPACITY,
    CHAT_TEMPLATES,
    CHAT_TOPICS,
    SOURCES,
    Prompt,
    WorkloadError,
    builtin_chat_prompts,
    file_prompts,
    load_prompts,
    prompts_sha256,
    token_id_prompts,
)
from bistat.engines.base import GenerationRequest

__all__ = [
    "CHAT_TEMPLATES",
    "CHAT_TOPICS",
    "Prompt",
    "WorkloadError",
    "builtin_chat_prompts",
    "file_prompts",
    "load_prompts",
    "output_length",
    "pass_order",
    "prompt_seed",
    "prompts_sha256",
    "requests_for_pass",
    "token_id_prompts",
]


def _stable_int(text: str) -> int:
    """A process-independent 32-bit integer for a string (``hash()`` is salted per process)."""
    return zlib.crc32(text.encode("utf-8"))


def prompt_seed(seed: int, prompt_index: int) -> int:
    """The sampling seed sent with prompt ``prompt_index``: the same in every pass and arm.

    Sampling seeds are always sent explicitly (a model's generation_config can change a server's
    defaults), and they must not vary between passes, or sampled outputs would differ for reasons
    that have nothing to do with batching.
    """
    return int(np.random.SeedSequence([seed, prompt_index]).generate_state(1, dtype=np.uint32)[0] >> 1)


def pass_order(n_prompts: int, *, seed: int, arm: str, pass_index: int, shuffle: bool) -> list[int]:
    """The submission order of a pass: a permutation of ``range(n_prompts)``.

    Shuffled with ``default_rng(SeedSequence([seed, crc32(arm), pass_index]))`` so that each pass
    of each arm submits the prompts in a different, reproducible order, and batches hold different
    neighbours from pass to pass: the comparison between passes is then a test of batch
    invariance. With ``shuffle = False`` the declared order is kept.
    """
    if not shuffle:
        return list(range(n_prompts))
    rng = np.random.default_rng(np.random.SeedSequence([seed, _stable_int(arm), pass_index]))
    return [int(i) for i in rng.permutation(n_prompts)]


def output_length(seed: int, index: int, max_tokens: int, max_tokens_min: int | None) -> int:
    """Prompt ``index``'s output length: ``max_tokens``, or with ``max_tokens_min`` a uniform draw
    from ``[max_tokens_min, max_tokens]`` seeded by ``(seed, index)`` alone (never by arm or pass).

    >>> output_length(0, 5, 110, None)
    110
    >>> output_length(0, 5, 110, 90) == output_length(0, 5, 110, 90)
    True
    """
    if max_tokens_min is None:
        return max_tokens
    rng = np.random.default_rng(np.random.SeedSequence([seed, index, 2]))
    return int(rng.integers(max_tokens_min, max_tokens + 1))


def requests_for_pass(
    prompts: Sequence[Prompt],
    *,
    seed: int,
    arm: str,
    pass_index: int,
    shuffle: bool,
    max_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    ignore_eos: bool,
    logprobs: int = 1,
    max_tokens_min: int | None = None,
) -> list[GenerationRequest]:
    """The requests of one pass, in submission order (see :func:`pass_order`).

    With ``max_tokens_min``, prompt *i* asks for :func:`output_length` tokens, drawn uniformly
    from ``[max_tokens_min, max_tokens]`` — the same in every pass and arm (the published
    throughput workload: output lengths uniform in 90–110, EOS ignored).
    """
    order = pass_order(len(prompts), seed=seed, arm=arm, pass_index=pass_index, shuffle=shuffle)
    return [
        prompts[i].request(
            max_tokens=output_length(seed, prompts[i].index, max_tokens, max_tokens_min),
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=prompt_seed(seed, prompts[i].index),
            ignore_eos=ignore_eos,
            logprobs=logprobs,
        )
        for i in order
    ]
