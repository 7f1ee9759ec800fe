"""Where two outputs of one prompt first differ: the one first-divergence function (pure).

Every reader that reports a first divergence uses :func:`first_divergence`: the analysis (the
finding's "First divergences" section and the trimmed compaction, through
:func:`divergence_position`), the divergence anatomy (``bistat.analysis.anatomy``), the probe
(``bistat.analysis.probe_report.compare_bitwise``), ``bistat diagnose`` and ``bistat replay``.
One definition, so a position shown in one place is the position every other place computed.

Definition: token ids are compared first; the first differing index is a ``"token"``
divergence, and when one output is a prefix of the other the shorter length is a ``"length"``
divergence. With both chosen-token logprob lists given, they are compared bitwise (float64 bit
patterns, so ``-0.0 != 0.0`` and one ulp counts; a null, written for -inf, equals only a null)
at the indices both outputs have, and a difference *before* the token position is a
``"logprob"`` divergence. With both texts given and nothing else differing, different texts are a
``"text"`` divergence at the reference's length.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["KINDS", "divergence_position", "first_divergence"]

#: How two outputs can first differ.
KINDS = ("token", "length", "logprob", "text")


def _first_mismatch(a: np.ndarray, b: np.ndarray) -> int | None:
    n = min(a.size, b.size)
    idx = np.flatnonzero(a[:n] != b[:n])
    return int(idx[0]) if idx.size else None


def _bits(logprobs: Sequence[float | None]) -> np.ndarray:
    # None (a recorded null, -inf) -> NaN, whose bit pattern equals only another null's
    return np.asarray(logprobs, dtype="<f8").view("<i8")


def first_divergence(ref_ids: Sequence[int], other_ids: Sequence[int],
                     ref_logprobs: Sequence[float | None] | None = None,
                     other_logprobs: Sequence[float | None] | None = None,
                     ref_text: str | None = None, other_text: str | None = None,
                     ) -> tuple[int, str] | None:
    """The first index where two outputs differ, and how (see the module docstring).

    Parameters
    ----------
    ref_ids, other_ids : sequence of int
        The two outputs' token ids (the reference first).
    ref_logprobs, other_logprobs : sequence of float or None, optional
        Chosen-token logprobs; compared only when both are given.
    ref_text, other_text : str, optional
        Texts; compared only when both are given and the ids and logprobs agree.

    Returns
    -------
    (int, str) or None
        ``(index, kind)`` with kind ``"token"``, ``"length"``, ``"logprob"`` or ``"text"``;
        None when the outputs are identical by what was given.

    Examples
    --------
    >>> first_divergence([1, 2, 3], [1, 5, 3])
    (1, 'token')
    >>> first_divergence([1, 2], [1, 2, 0])
    (2, 'length')
    >>> first_divergence([1, 2], [1, 2], [-0.5, -1.0], [-0.5, -1.25])
    (1, 'logprob')
    >>> first_divergence([1, 2], [1, 7], [-0.5, -1.0], [-0.5, -1.25])
    (1, 'token')
    >>> first_divergence([1], [1], ref_text="a", other_text="b")
    (1, 'text')
    """
    a = np.asarray(ref_ids, dtype=np.int64)
    b = np.asarray(other_ids, dtype=np.int64)
    found: tuple[int, str] | None = None
    tok = _first_mismatch(a, b)
    if tok is not None:
        found = (tok, "token")
    elif a.size != b.size:
        found = (min(a.size, b.size), "length")
    if ref_logprobs is not None and other_logprobs is not None:
        n = min(len(ref_logprobs), len(other_logprobs), a.size, b.size)
        if found is not None:
            n = min(n, found[0])
        lp = _first_mismatch(_bits(list(ref_logprobs)[:n]), _bits(list(other_logprobs)[:n]))
        if lp is not None:
            return (lp, "logprob")
    if found is None and ref_text is not None and other_text is not None \
            and ref_text != other_text:
        return (int(a.size), "text")
    return found


def divergence_position(ref_ids: Sequence[int], ids: Sequence[int],
                        ref_logprobs: Sequence[float | None] | None,
                        logprobs: Sequence[float | None] | None, unit: str) -> int | None:
    """Where ``ids`` first diverges from ``ref_ids`` by a declaration's match ``unit``: the
    position of :func:`first_divergence`, with the chosen-token logprobs compared bitwise for
    ``token_ids+logprobs`` and ignored otherwise. None: identical by ``unit`` (for ``text``, by
    the outputs' token ids). The finding's first divergences and the trimmed compaction's cut
    are this position.
    """
    with_lps = unit == "token_ids+logprobs"
    found = first_divergence(ref_ids, ids, ref_logprobs if with_lps else None,
                             logprobs if with_lps else None)
    return None if found is None else found[0]
