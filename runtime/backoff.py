"""Exponential back-off with jitter, and the retry-forever loop for infrastructure failures.

The caller decides which exceptions are transient (by class or SQLSTATE, never message text).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Backoff:
    """Delays ``initial * 2**attempt`` capped at ``maximum``, with equal jitter (``[d/2, d]``)."""

    initial: float = 1.0
    maximum: float = 60.0
    rng: random.Random = field(default_factory=random.Random, compare=False)

    def delay(self, attempt: int) -> float:
        """The sleep before retry number ``attempt`` (0-based)."""
        capped = min(self.maximum, self.initial * (2 ** min(attempt, 32)))
        return float(capped / 2 + self.rng.uniform(0, capped / 2))


def retry_forever(operation: Callable[[], T], *, is_transient: Callable[[BaseException], bool],
                  backoff: Backoff, on_retry: Callable[[BaseException, int, float], None],
                  on_recovered: Callable[[int], None] | None = None,
                  sleep: Callable[[float], None]) -> T:
    """Run ``operation`` until it succeeds, sleeping between transient failures.

    A failure that is not transient is raised at once. ``on_retry(exc, attempt, delay)`` before
    each sleep; ``on_recovered(attempts)`` once the dependency answers again (also with a
    non-transient failure: the service is back).
    """
    attempt = 0
    while True:
        try:
            result = operation()
        except Exception as exc:
            if not is_transient(exc):
                if attempt and on_recovered is not None:
                    on_recovered(attempt)
                raise
            delay = backoff.delay(attempt)
            attempt += 1
            on_retry(exc, attempt, delay)
            sleep(delay)
            continue
        if attempt and on_recovered is not None:
            on_recovered(attempt)
        return result
