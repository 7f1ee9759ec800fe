"""The canonical form a registration's seal hashes, and the one format of its times: sorted keys,
no whitespace, UTF-8, no NaN (pyperf's ``json.dump(data, fp, sort_keys=True)`` made canonical), and
UTC times to the microsecond with a ``Z``.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from typing import Any


def canonical_json(obj: Any) -> bytes:
    """The canonical serialization that is hashed: sorted keys, no whitespace, UTF-8, no NaN."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False).encode("utf-8")


def sha256_hex(obj: Any) -> str:
    """SHA-256 (hex) of ``canonical_json(obj)``."""
    return hashlib.sha256(canonical_json(obj)).hexdigest()


def format_time(t: dt.datetime) -> str:
    """ISO 8601 UTC with microseconds and a ``Z``: ``2026-11-29T10:14:01.123456Z``."""
    return t.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
