"""The newest release of an engine package known to the package index (PyPI's JSON API).

"Benchmarks run on the latest release or they don't count": a finding says how the engine version
it measured compares with the newest release. The newest release is a fact about the moment and
the machine that asked, so it is recorded where it is asked — in the registration's seal (the
machine that registers reaches PyPI), in a run's events when the run's machine reaches it, and
printed by ``bistat doctor`` — and a finding reads only what was recorded (it regenerates byte for
byte). When the index cannot be reached the check records why, and the newest release is unknown.

``GET {index}/{package}/json`` (https://warehouse.pypa.io/api-reference/json.html): ``info.version``
is the index's latest release (a final release unless the project has only pre-releases). The
index is ``$BISTAT_PACKAGE_INDEX`` (default ``https://pypi.org/pypi``); ``BISTAT_PACKAGE_INDEX=off``
records "not checked" without a request (the test suite sets it; the lent GPU machine, which
reaches no index, sets it in ``scripts/device/env.sh``).
"""

from __future__ import annotations

import datetime as _dt
import os
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Mapping

from packaging.version import InvalidVersion, Version

if TYPE_CHECKING:  # pragma: no cover
    import httpx

__all__ = ["DEFAULT_INDEX", "INDEX_ENV", "ReleaseCheck", "check_newest_release"]

INDEX_ENV = "BISTAT_PACKAGE_INDEX"
DEFAULT_INDEX = "https://pypi.org/pypi"
#: A check must not hold up a registration or a run for long.
DEFAULT_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class ReleaseCheck:
    """One look at the package index: the newest release of ``package``, or why it is unknown.

    Attributes
    ----------
    package : str
    newest : str or None
        The index's latest release; None when the check failed or was not made.
    checked_utc : str
        When the check was made (``YYYY-MM-DDTHH:MM:SSZ``).
    index : str
        The JSON API asked (``off`` when checks are switched off).
    error : str or None
        Why ``newest`` is unknown (unreachable index, HTTP error, unreadable answer, switched off).
    """

    package: str
    newest: str | None
    checked_utc: str
    index: str
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ReleaseCheck":
        return cls(package=str(data.get("package")), newest=data.get("newest"),
                   checked_utc=str(data.get("checked_utc")), index=str(data.get("index")),
                   error=data.get("error"))


def _utc(now: _dt.datetime | None) -> str:
    now = now or _dt.datetime.now(_dt.timezone.utc)
    return now.astimezone(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def check_newest_release(package: str = "vllm", *, index: str | None = None,
                         transport: httpx.BaseTransport | None = None,
                         timeout_s: float = DEFAULT_TIMEOUT_S,
                         now: _dt.datetime | None = None) -> ReleaseCheck:
    """Ask the package index for ``package``'s newest release; never raises for a failed check.

    Parameters
    ----------
    package : str
        The distribution name (``vllm``).
    index : str, optional
        The JSON API's base URL; default ``$BISTAT_PACKAGE_INDEX`` or :data:`DEFAULT_INDEX`;
        ``off`` makes no request.
    transport : httpx transport, optional
        For tests (``httpx.MockTransport``); default: the network.
    timeout_s : float
        Connect, read and write timeout.
    now : datetime, optional
        The check's time (default: now).

    Returns
    -------
    ReleaseCheck
        ``newest`` set, or None with ``error`` saying why.
    """
    index = (index or os.environ.get(INDEX_ENV) or DEFAULT_INDEX).rstrip("/")
    when = _utc(now)
    if index == "off":
        return ReleaseCheck(package, None, when, "off",
                            f"not checked ({INDEX_ENV}=off)")
    url = f"{index}/{package}/json"
    import httpx   # here: the declaration stage imports this module without checking a release

    try:
        with httpx.Client(transport=transport, timeout=timeout_s, follow_redirects=True) as client:
            resp = client.get(url, headers={"Accept": "application/json"})
        if resp.status_code != 200:
            return ReleaseCheck(package, None, when, index,
                                f"the index answered HTTP {resp.status_code}")
        newest = str(resp.json()["info"]["version"])
        Version(newest)  # a version the comparison can read
    except httpx.HTTPError as exc:
        return ReleaseCheck(package, None, when, index,
                            f"the index could not be reached ({type(exc).__name__}: {exc})")
    except (ValueError, KeyError, TypeError, InvalidVersion) as exc:
        return ReleaseCheck(package, None, when, index,
                            f"the index's answer has no readable info.version ({type(exc).__name__})")
    return ReleaseCheck(package, newest, when, index)
