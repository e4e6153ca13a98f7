"""Back-off with jitter, retry-forever for infrastructure failures, and poison isolation."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from runtime.backoff import Backoff, retry_forever
from sinks.poison import Poisoned, write_isolating_poison


class HighestJitter(random.Random):
    """An rng whose ``uniform`` always returns the upper bound (no jitter subtracted)."""

    def uniform(self, a: float, b: float) -> float:
        return b


class LowestJitter(random.Random):
    """An rng whose ``uniform`` always returns the lower bound."""

    def uniform(self, a: float, b: float) -> float:
        return a


class Infrastructure(Exception):
    """Stands for a transient failure (e.g. Postgres down)."""


class Poison(Exception):
    """Stands for a failure caused by the data itself."""


def is_transient(exc: BaseException) -> bool:
    return isinstance(exc, Infrastructure)


# --- Backoff --------------------------------------------------------------------------------


def test_delays_grow_from_1_second_doubling_up_to_60_seconds() -> None:
    backoff = Backoff(initial=1.0, maximum=60.0, rng=HighestJitter())

    delays = [backoff.delay(attempt) for attempt in range(9)]

    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0, 60.0]


def test_lowest_jitter_is_half_the_unjittered_delay_never_zero() -> None:
    backoff = Backoff(initial=1.0, maximum=60.0, rng=LowestJitter())

    delays = [backoff.delay(attempt) for attempt in range(8)]

    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]


def test_defaults_are_1_second_to_60_seconds() -> None:
    backoff = Backoff(rng=HighestJitter())

    assert (backoff.delay(0), backoff.delay(100)) == (1.0, 60.0)


@given(
    attempt=st.integers(min_value=0, max_value=10_000),
    seed=st.integers(min_value=0, max_value=2**32),
    initial=st.floats(min_value=0.001, max_value=10.0),
    maximum=st.floats(min_value=10.0, max_value=600.0),
)
def test_jittered_delay_lies_between_half_and_all_of_the_capped_delay(
    attempt: int, seed: int, initial: float, maximum: float
) -> None:
    backoff = Backoff(initial=initial, maximum=maximum, rng=random.Random(seed))
    capped = min(maximum, initial * 2**min(attempt, 64))

    delay = backoff.delay(attempt)

    assert capped / 2 <= delay <= capped
    assert 0 < delay <= maximum


# --- retry_forever ------------------------------------------------------------------------------


class Recorder:
    """Records the calls a retry loop makes to its hooks and to sleep."""

    def __init__(self) -> None:
        self.sleeps: list[float] = []
        self.retries: list[tuple[BaseException, int, float]] = []
        self.recovered: list[int] = []

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)

    def on_retry(self, exc: BaseException, attempt: int, delay: float) -> None:
        self.retries.append((exc, attempt, delay))

    def on_recovered(self, attempts: int) -> None:
        self.recovered.append(attempts)


def failing(times: int, error: Callable[[], Exception], result: str = "ok") -> Callable[[], str]:
    """An operation that raises ``error()`` ``times`` times, then returns ``result``."""
    calls = 0

    def operation() -> str:
        nonlocal calls
        calls += 1
        if calls <= times:
            raise error()
        return result

    return operation


def test_transient_failures_are_retried_with_growing_sleeps_until_success() -> None:
    recorder = Recorder()
    operation = failing(7, Infrastructure)

    result = retry_forever(
        operation,
        is_transient=is_transient,
        backoff=Backoff(rng=HighestJitter()),
        on_retry=recorder.on_retry,
        on_recovered=recorder.on_recovered,
        sleep=recorder.sleep,
    )

    assert result == "ok"
    assert recorder.sleeps == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0]
    assert [attempt for _, attempt, _ in recorder.retries] == [1, 2, 3, 4, 5, 6, 7]
    assert [delay for _, _, delay in recorder.retries] == recorder.sleeps
    assert all(isinstance(exc, Infrastructure) for exc, _, _ in recorder.retries)
    assert recorder.recovered == [7]


def test_on_retry_is_called_before_the_sleep() -> None:
    events: list[str] = []

    retry_forever(
        failing(1, Infrastructure),
        is_transient=is_transient,
        backoff=Backoff(rng=HighestJitter()),
        on_retry=lambda exc, attempt, delay: events.append("on_retry"),
        sleep=lambda seconds: events.append("sleep"),
    )

    assert events == ["on_retry", "sleep"]


def test_first_try_success_neither_sleeps_nor_reports_recovery() -> None:
    recorder = Recorder()

    result = retry_forever(
        lambda: "done",
        is_transient=is_transient,
        backoff=Backoff(),
        on_retry=recorder.on_retry,
        on_recovered=recorder.on_recovered,
        sleep=recorder.sleep,
    )

    assert result == "done"
    assert (recorder.sleeps, recorder.retries, recorder.recovered) == ([], [], [])


def test_non_transient_failure_is_raised_at_once_without_sleeping() -> None:
    recorder = Recorder()
    operation = failing(1, Poison)

    with pytest.raises(Poison):
        retry_forever(
            operation,
            is_transient=is_transient,
            backoff=Backoff(),
            on_retry=recorder.on_retry,
            on_recovered=recorder.on_recovered,
            sleep=recorder.sleep,
        )

    assert (recorder.sleeps, recorder.retries, recorder.recovered) == ([], [], [])


def test_non_transient_failure_after_transient_ones_is_raised_and_ends_the_pause() -> None:
    # The service answered (and refused the operation itself): whoever reported the pause
    # through on_retry must hear that the outage is over, or /readyz stays 503 for good.
    recorder = Recorder()
    errors: list[Exception] = [Infrastructure(), Infrastructure(), Poison()]

    def operation() -> str:
        raise errors.pop(0)

    with pytest.raises(Poison):
        retry_forever(
            operation,
            is_transient=is_transient,
            backoff=Backoff(rng=HighestJitter()),
            on_retry=recorder.on_retry,
            on_recovered=recorder.on_recovered,
            sleep=recorder.sleep,
        )

    assert recorder.sleeps == [1.0, 2.0]
    assert recorder.recovered == [2]


def test_recovery_without_an_on_recovered_hook_still_returns_the_result() -> None:
    recorder = Recorder()

    result = retry_forever(
        failing(2, Infrastructure, result="late"),
        is_transient=is_transient,
        backoff=Backoff(rng=LowestJitter()),
        on_retry=recorder.on_retry,
        sleep=recorder.sleep,
    )

    assert result == "late"
    assert recorder.sleeps == [0.5, 1.0]


def test_a_long_outage_keeps_retrying_at_the_60_second_cap() -> None:
    recorder = Recorder()

    retry_forever(
        failing(500, Infrastructure),
        is_transient=is_transient,
        backoff=Backoff(rng=HighestJitter()),
        on_retry=recorder.on_retry,
        sleep=recorder.sleep,
    )

    assert len(recorder.sleeps) == 500
    assert set(recorder.sleeps[6:]) == {60.0}


# --- write_isolating_poison -------------------------------------------------------------------


class FakeWriter:
    """Writes a batch unless it holds a bad item; records every call.

    A flaky item fails every batch it is in until it has failed ``flaky[item]`` lone attempts.
    """

    def __init__(self, bad: set[int], flaky: dict[int, int] | None = None) -> None:
        self.bad = bad
        self.lone_failures_left = dict(flaky or {})
        self.calls: list[tuple[int, ...]] = []

    def __call__(self, batch: Sequence[int]) -> list[int]:
        self.calls.append(tuple(batch))
        if any(item in self.bad for item in batch):
            raise Poison(f"bad item in {list(batch)}")
        for item in batch:
            if self.lone_failures_left.get(item, 0) > 0:
                if len(batch) == 1:
                    self.lone_failures_left[item] -= 1
                raise Poison(f"flaky item {item}")
        return list(batch)

    def lone_calls(self) -> Counter[int]:
        return Counter(call[0] for call in self.calls if len(call) == 1)


def flatten(results: list[list[int]]) -> list[int]:
    return [item for batch in results for item in batch]


def test_clean_batch_is_written_in_one_call() -> None:
    writer = FakeWriter(bad=set())

    results, poisoned = write_isolating_poison(list(range(10)), writer, attempts=3)

    assert results == [list(range(10))]
    assert poisoned == []
    assert len(writer.calls) == 1


def test_empty_batch_writes_nothing() -> None:
    writer = FakeWriter(bad=set())
    nothing: list[int] = []

    results, poisoned = write_isolating_poison(nothing, writer, attempts=3)

    assert (results, poisoned, writer.calls) == ([], [], [])


def test_one_poison_item_is_isolated_and_its_batch_mates_are_written() -> None:
    writer = FakeWriter(bad={5})

    results, poisoned = write_isolating_poison(list(range(8)), writer, attempts=3)

    assert flatten(results) == [0, 1, 2, 3, 4, 6, 7]
    assert [p.item for p in poisoned] == [5]
    assert poisoned[0].attempts == 3
    assert isinstance(poisoned[0].error, Poison)
    assert writer.lone_calls()[5] == 3


def test_lone_poison_item_gets_exactly_the_configured_attempts() -> None:
    writer = FakeWriter(bad={1})

    results, poisoned = write_isolating_poison([1], writer, attempts=3)

    assert results == []
    assert poisoned[0] == Poisoned(1, poisoned[0].error, 3)
    assert writer.calls == [(1,), (1,), (1,)]


def test_flaky_item_that_needs_more_lone_attempts_than_allowed_is_poisoned() -> None:
    writer = FakeWriter(bad=set(), flaky={2: 3})

    results, poisoned = write_isolating_poison([0, 1, 2, 3], writer, attempts=3)

    assert flatten(results) == [0, 1, 3]
    assert [(p.item, p.attempts) for p in poisoned] == [(2, 3)]


def test_single_attempt_poisons_a_lone_failure_at_once() -> None:
    writer = FakeWriter(bad={1})

    _, poisoned = write_isolating_poison([0, 1], writer, attempts=1)

    assert [p.item for p in poisoned] == [1]
    assert writer.lone_calls()[1] == 1


def test_flaky_item_that_succeeds_on_its_second_lone_attempt_is_not_poisoned() -> None:
    writer = FakeWriter(bad=set(), flaky={3: 1})

    results, poisoned = write_isolating_poison([0, 1, 2, 3], writer, attempts=3)

    assert poisoned == []
    assert flatten(results) == [0, 1, 2, 3]
    assert writer.lone_calls()[3] == 2


@given(
    data=st.data(),
    size=st.integers(min_value=1, max_value=64),
    attempts=st.integers(min_value=1, max_value=4),
)
def test_poison_isolation_writes_exactly_the_good_items_and_poisons_exactly_the_bad(
    data: st.DataObject, size: int, attempts: int
) -> None:
    items = list(range(size))
    bad = data.draw(st.sets(st.sampled_from(items), max_size=size), label="bad")
    writer = FakeWriter(bad=bad)

    results, poisoned = write_isolating_poison(items, writer, attempts=attempts)

    assert flatten(results) == [item for item in items if item not in bad]
    assert [p.item for p in poisoned] == sorted(bad)
    assert all(p.attempts == attempts for p in poisoned)
    lone = writer.lone_calls()
    assert all(lone[item] == attempts for item in bad)
    assert all(isinstance(p.error, Poison) for p in poisoned)
