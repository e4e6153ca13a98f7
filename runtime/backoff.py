"""Exponential back-off with jitter, and the retry-forever loop for infrastructure failures.

Pure logic plus ``time.sleep``: which exceptions count as infrastructure is decided by the caller
(adapters classify by exception class / SQLSTATE, never by message text).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Backoff:
    """Delays ``initial * 2**attempt`` capped at ``maximum``, with equal jitter.

    The jittered delay lies in ``[d/2, d]`` for the un-jittered ``d``: never zero (no hot loop),
    and never above ``maximum``.
    """

    initial: float = 1.0
    maximum: float = 60.0
    rng: random.Random = field(default_factory=random.Random, compare=False)

    def delay(self, attempt: int) -> float:
        """The sleep before retry number ``attempt`` (0-based)."""
        capped = min(self.maximum, self.initial * (2 ** min(attempt, 32)))
        return float(capped / 2 + self.rng.uniform(0, capped / 2))


def retry_forever(
    operation: Callable[[], T], *, is_transient: Callable[[BaseException], bool],
    backoff: Backoff, on_retry: Callable[[BaseException, int, float], None],
    on_recovered: Callable[[int], None] | None = None, sleep: Callable[[float], None],
) -> T:
    """Run ``operation`` until it succeeds, sleeping between transient failures.

    A failure for which ``is_transient`` is false is raised at once (it is the caller's to
    classify as poison). ``on_retry(exc, attempt, delay)`` is called before each sleep;
    ``on_recovered(attempts)`` once the dependency answers after at least one transient
    failure: a success, or a failure that is not transient (the service is back and refused
    the operation itself; a pause reported by ``on_retry`` must end then too).
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
