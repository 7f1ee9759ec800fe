"""One rounding: a decided value as a verdict shows it (pure: no I/O, no clock, no printing).

Every decided value a verdict shows is formatted by :func:`format_decided`: one rounding, with
more digits only where fewer would put the shown number on the other side of (or onto) the
bound it was compared with. The classifier's criteria and cost statements use it, and so does a
finding wherever it shows a number that was compared with a bound.
"""

from __future__ import annotations

import math
from typing import Sequence

__all__ = ["format_decided"]


def format_decided(x: float, bounds: Sequence[float] = (), digits: int = 4,
                   significant: bool = False) -> str:
    """A decided value as a finding shows it: ``digits`` decimals, more where needed.

    Parameters
    ----------
    x : float
        The value the classifier compared.
    bounds : sequence of float
        The bounds it was compared with.
    digits : int, default 4
        Decimals shown when they are enough.
    significant : bool, default False
        Count ``digits`` as significant digits instead (``g`` format: p-values such as
        ``3.018e-119``).

    Returns
    -------
    str
        ``x`` rounded once, to the fewest decimals (``digits`` or more, up to 17 significant
        digits) at which the shown number sits on the same side of every bound as ``x`` itself,
        and equals a bound only when ``x`` does. So a reader comparing the shown number with the
        threshold reaches the classifier's answer.

    Examples
    --------
    >>> format_decided(0.98996, [0.99])
    '0.98996'
    >>> format_decided(0.9, [0.9])
    '0.9000'
    >>> format_decided(0.8999999999999996, [0.9])
    '0.8999999999999996'
    >>> format_decided(3.0183e-119, [0.05], significant=True)
    '3.018e-119'
    """
    x = float(x)
    if not math.isfinite(x):
        return str(x)
    for d in range(digits, 18):
        shown = f"{x:.{d}g}" if significant else f"{x:.{d}f}"
        y = float(shown)
        if all((y < b) == (x < b) and (y == b) == (x == b) for b in bounds):
            return shown
    return repr(x)
