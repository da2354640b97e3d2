"""Retry policy: per-attempt client settings, exponential backoff with jitter, ``Retry-After``
(delta-seconds or an HTTP date, a lower bound), and the shared pause after a 429."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import Any, Mapping


#: The attempt timeout when ``generation.timeout_s`` is not set: at least this many seconds ...
DEFAULT_TIMEOUT_S = 600.0
#: ... and long enough for ``max_tokens`` at this many tokens a second (a slow provider's pace):
#: an answer still arriving at the deadline is cut, and asked again, and a provider bills each one
SLOWEST_TOKENS_PER_S = 10.0


def attempt_timeout_s(g: Mapping[str, Any]) -> float:
    """The per-attempt deadline of a dataset's ``generation`` settings ``g``: ``timeout_s`` when set,
    else :data:`DEFAULT_TIMEOUT_S` or the time ``max_tokens`` take at :data:`SLOWEST_TOKENS_PER_S`
    (plus a minute), whichever is longer (32,768 tokens: about 56 minutes)."""
    if g.get("timeout_s") is not None:
        return float(g["timeout_s"])
    return max(DEFAULT_TIMEOUT_S, float(g.get("max_tokens") or 4096) / SLOWEST_TOKENS_PER_S + 60.0)


@dataclass(frozen=True)
class ClientSettings:
    """How one dataset's requests are sent (``generation.*`` settings that shape no answer)."""

    url: str
    backend: str
    headers: Mapping[str, str]
    concurrency: int
    max_attempts: int
    timeout_s: float
    backoff_base_s: float
    backoff_max_s: float
    job_timeout_s: float | None = None
    drain_timeout_s: float = 60.0

    @classmethod
    def from_generation(cls, g: Mapping[str, Any], url: str, backend: str, headers: Mapping[str, str]) -> "ClientSettings":
        """From a dataset's ``generation`` settings (defaults as in the config schema)."""
        job = g.get("job_timeout_s")
        return cls(url, backend, dict(headers), int(g.get("concurrency", 16)), int(g.get("max_attempts", 6)),
                   attempt_timeout_s(g), float(g.get("backoff_base_s", 1.0)), float(g.get("backoff_max_s", 60.0)),
                   float(job) if job is not None else None, float(g.get("drain_timeout_s", 60.0)))


def retry_after_seconds(value: str | None) -> float | None:
    """``Retry-After`` as seconds (delta-seconds or an HTTP date); ``None`` when absent/unusable."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


def backoff_delay(attempt: int, base: float, cap: float, retry_after: float | None = None) -> float:
    """Exponential backoff with jitter (50-100 % of ``base * 2**(attempt-1)``, capped); a
    ``Retry-After`` is honoured as a lower bound."""
    delay = min(cap, base * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)
    if retry_after is not None:
        delay = max(delay, retry_after * random.uniform(1.0, 1.1))
    return delay


class RateGate:
    """Shared pause after a 429 with ``Retry-After``: the limit is per key, so every worker waits,
    not only the one that was told."""

    def __init__(self) -> None:
        self.until = 0.0

    def hold(self, seconds: float) -> None:
        self.until = max(self.until, time.monotonic() + seconds)

    async def wait(self) -> None:
        while (delay := self.until - time.monotonic()) > 0:
            await asyncio.sleep(delay)

