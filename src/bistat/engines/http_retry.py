"""When an HTTP engine repeats a failed attempt, and after how long (:class:`RetryPolicy`, pure).

Transport errors, timeouts, 408 and 5xx answers and bodies that are not the expected JSON are
retried ``retries`` times with exponential backoff. A 429 (rate limited) is retried without using
up ``retries``: after at least its ``Retry-After`` (delay-seconds or an HTTP-date, RFC 9110 section
10.2.3: :func:`retry_after_s`, counted from the answer's ``Date``: :func:`answer_time`) and at
least the backoff, until the waits of one request would pass ``max_wait_s`` in total. A failed
attempt is a :class:`_Retryable` (:func:`_transport_failure`, :func:`_answer_failure`), or a
:class:`_Fatal` that is not repeated; :class:`_Tries` counts one request's attempts, as its result
records them.

The retry loop is bistat's own rather than tenacity's (which would fit): tenacity is not on the
lent GPU machine's image, where bistat is installed without its dependencies
(``scripts/device/install.sh``), and its wait and stop rules would be callables of our own here
anyway; HTTP-dates are parsed by the standard library (:func:`email.utils.parsedate_to_datetime`
reads all three forms RFC 9110 allows).
"""

from __future__ import annotations

import datetime as _dt
import email.utils
from dataclasses import dataclass
from typing import Mapping

import httpx


_RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})
RATE_LIMITED = 429


def retry_after_s(value: str | None, now: _dt.datetime) -> float | None:
    """Seconds to wait that a ``Retry-After`` header asks for, or None (absent or unreadable).

    ``value`` is delay-seconds (``"120"``) or an HTTP-date (``"Wed, 21 Oct 2015 07:28:00 GMT"``,
    and the obsolete RFC 850 and asctime forms), counted from ``now`` (the answer's ``Date``
    header where it has one, so the two clocks need not agree); a date in the past is 0.

    >>> now = _dt.datetime(2015, 10, 21, 7, 27, 30, tzinfo=_dt.timezone.utc)
    >>> retry_after_s("120", now), retry_after_s("Wed, 21 Oct 2015 07:28:00 GMT", now)
    (120.0, 30.0)
    """
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:  # an HTTP-date is always GMT
        when = when.replace(tzinfo=_dt.timezone.utc)
    return max(0.0, (when - now).total_seconds())


def answer_time(headers: Mapping[str, str]) -> _dt.datetime:
    """The answer's ``Date`` header, else this machine's clock."""
    try:
        when = email.utils.parsedate_to_datetime(headers.get("date", ""))
    except (TypeError, ValueError, IndexError):
        return _dt.datetime.now(_dt.timezone.utc)
    return when if when.tzinfo is not None else when.replace(tzinfo=_dt.timezone.utc)


@dataclass(frozen=True)
class RetryPolicy:
    """When a failed attempt is repeated, and after how long (pure).

    Attributes
    ----------
    retries : int
        Further attempts after failures other than 429 (transport errors, timeouts, 408, 5xx,
        bad bodies).
    backoff_s : float
        Wait before the first retry, doubled before each further one (429s included).
    backoff_max_s : float
        Longest backoff between two attempts (a longer ``Retry-After`` is still honoured).
    max_wait_s : float
        Longest total wait between the attempts of one request: the retry whose wait would pass
        it is not made, and the request fails.
    """

    retries: int = 3
    backoff_s: float = 0.5
    backoff_max_s: float = 10.0
    max_wait_s: float = 120.0

    def __post_init__(self) -> None:
        if self.retries < 0:
            raise ValueError(f"retries must be >= 0, got {self.retries}")
        if not self.backoff_s > 0:
            raise ValueError(f"backoff_s must be > 0 (the first retry's wait), got "
                             f"{self.backoff_s}")
        if not self.max_wait_s >= 0:
            raise ValueError(f"max_retry_wait_s must be >= 0, got {self.max_wait_s}")

    def next_wait(self, *, attempt: int, failures: int, waited_s: float, rate_limited: bool,
                  retry_after: float | None) -> tuple[float | None, str | None]:
        """``(seconds, None)`` to wait before attempt ``attempt + 1``, or ``(None, why)`` to give
        up (``why`` is None when the ``retries`` are used up, else the wait bound's reason).

        Parameters
        ----------
        attempt : int
            Attempts made so far (the one that just failed included).
        failures : int
            Failed attempts so far that were not 429s.
        waited_s : float
            Seconds already waited between this request's attempts.
        rate_limited : bool
            The attempt that just failed was answered 429.
        retry_after : float or None
            Its ``Retry-After`` in seconds (:func:`retry_after_s`).
        """
        if not rate_limited and failures > self.retries:
            return None, None
        backoff = min(self.backoff_max_s, self.backoff_s * 2 ** (attempt - 1))
        wait = backoff if retry_after is None else max(retry_after, backoff)
        if waited_s + wait > self.max_wait_s:
            asked = f"Retry-After {retry_after:g} s" if retry_after is not None else "backoff"
            return None, (f"the next wait ({asked}: {wait:g} s) would take the waits to "
                          f"{waited_s + wait:g} s, past max_retry_wait_s = {self.max_wait_s:g} s")
        return wait, None


class _Retryable(Exception):
    """A failed attempt worth repeating; ``dead_endpoint`` when the endpoint itself failed (the
    connection was refused or reset, or it answered 5xx), not the request; ``rate_limited`` when
    it was answered 429, with ``retry_after`` its ``Retry-After`` in seconds."""

    def __init__(self, message: str, dead_endpoint: bool = False, rate_limited: bool = False,
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.dead_endpoint = dead_endpoint
        self.rate_limited = rate_limited
        self.retry_after = retry_after


class _Fatal(Exception):
    """A failed attempt not worth repeating (the server rejected the request)."""


def _transport_failure(exc: httpx.HTTPError) -> _Retryable:
    """A transport error or timeout as a failed attempt (a timeout is not a dead endpoint)."""
    dead = isinstance(exc, httpx.TransportError) and not isinstance(exc, httpx.TimeoutException)
    return _Retryable(f"{type(exc).__name__}: {exc}", dead_endpoint=dead)


def _answer_failure(resp: httpx.Response) -> _Retryable | None:
    """An answer worth repeating the attempt for (408, 429, 5xx, with its ``Retry-After``: a 503
    may send one too) as a failed attempt; None for any other answer."""
    if resp.status_code not in _RETRY_STATUS:
        return None
    after = retry_after_s(resp.headers.get("retry-after"), answer_time(resp.headers))
    return _Retryable(f"HTTP {resp.status_code}: {resp.text[:300]}",
                      dead_endpoint=resp.status_code >= 500,
                      rate_limited=resp.status_code == RATE_LIMITED, retry_after=after)


@dataclass
class _Tries:
    """One request's attempts under a :class:`RetryPolicy`: the counts its result records."""

    policy: RetryPolicy
    attempts: int = 0
    failures: int = 0           # failed attempts that were not 429s
    rate_limited: int = 0       # attempts answered 429
    waited_s: float = 0.0       # seconds waited between the attempts
    gave_up: str | None = None  # why the wait bound ended them, if it did

    def wait_after(self, failed: _Retryable) -> float | None:
        """Count the failed attempt; the seconds to wait before the next one, or None to give
        up (``gave_up`` then says why, unless the ``retries`` were used up)."""
        self.rate_limited += failed.rate_limited
        self.failures += not failed.rate_limited
        wait, self.gave_up = self.policy.next_wait(
            attempt=self.attempts, failures=self.failures, waited_s=self.waited_s,
            rate_limited=failed.rate_limited, retry_after=failed.retry_after)
        if wait is not None:
            self.waited_s += wait
        return wait
