"""DedupWindow: one owner's recently seen ids, each forgotten ``ttl`` seconds after first seen."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from dataflows.dedup import DedupWindow

TTL = 60.0
A = b"A" + bytes(16)
B = b"A" + bytes(15) + b"\x01"
C = b"R" + bytes(16)


def test_first_sighting_is_admitted_and_a_redelivery_within_the_ttl_is_not() -> None:
    window = DedupWindow(TTL)

    first = window.admit(A, now=100.0)
    again = window.admit(A, now=100.0 + TTL - 0.001)

    assert (first, again) == (True, False)
    assert len(window) == 1


def test_distinct_ids_are_each_admitted() -> None:
    window = DedupWindow(TTL)

    admitted = [window.admit(dedup_id, now=100.0) for dedup_id in (A, B, C)]

    assert admitted == [True, True, True]
    assert len(window) == 3


def test_id_is_admitted_again_once_its_ttl_has_passed() -> None:
    window = DedupWindow(TTL)
    window.admit(A, now=100.0)

    readmitted = window.admit(A, now=100.0 + TTL)

    assert readmitted is True
    assert window.snapshot() == {A: 100.0 + 2 * TTL}


def test_duplicate_does_not_extend_the_expiry() -> None:
    window = DedupWindow(TTL)
    window.admit(A, now=100.0)

    window.admit(A, now=130.0)

    assert window.snapshot() == {A: 100.0 + TTL}


def test_readmitted_id_moves_behind_younger_ids_in_expiry_order() -> None:
    window = DedupWindow(TTL)
    window.admit(A, now=0.0)
    window.admit(B, now=30.0)

    window.admit(A, now=TTL)

    assert list(window.snapshot()) == [B, A]
    assert window.next_expiry() == 30.0 + TTL


def test_empty_window_has_no_next_expiry() -> None:
    window = DedupWindow(TTL)

    assert window.next_expiry() is None
    assert len(window) == 0


def test_next_expiry_is_the_oldest_ids_expiry() -> None:
    window = DedupWindow(TTL)
    window.admit(A, now=10.0)
    window.admit(B, now=20.0)

    assert window.next_expiry() == 10.0 + TTL


def test_evict_forgets_exactly_the_ids_whose_expiry_has_passed() -> None:
    window = DedupWindow(TTL)
    window.admit(A, now=10.0)
    window.admit(B, now=20.0)
    window.admit(C, now=30.0)

    window.evict(now=20.0 + TTL)

    assert window.snapshot() == {C: 30.0 + TTL}
    assert window.next_expiry() == 30.0 + TTL


def test_evict_before_any_expiry_keeps_everything() -> None:
    window = DedupWindow(TTL)
    window.admit(A, now=10.0)

    window.evict(now=10.0 + TTL - 0.001)

    assert window.snapshot() == {A: 10.0 + TTL}


def test_evict_of_everything_empties_the_window() -> None:
    window = DedupWindow(TTL)
    window.admit(A, now=10.0)
    window.admit(B, now=20.0)

    window.evict(now=1_000.0)

    assert len(window) == 0
    assert window.next_expiry() is None


def test_snapshot_is_a_copy_that_later_admissions_do_not_change() -> None:
    window = DedupWindow(TTL)
    window.admit(A, now=10.0)

    snapshot = window.snapshot()
    window.admit(B, now=20.0)
    window.evict(now=10.0 + TTL)

    assert snapshot == {A: 10.0 + TTL}


def test_mutating_a_snapshot_does_not_change_the_window() -> None:
    window = DedupWindow(TTL)
    window.admit(A, now=10.0)

    snapshot = window.snapshot()
    snapshot.clear()

    assert window.snapshot() == {A: 10.0 + TTL}


def test_window_restored_from_a_snapshot_remembers_its_ids_and_owns_its_state() -> None:
    original = DedupWindow(TTL)
    original.admit(A, now=10.0)
    original.admit(B, now=20.0)
    state = original.snapshot()

    restored = DedupWindow(TTL, state)
    duplicate = restored.admit(A, now=30.0)
    restored.admit(C, now=30.0)

    assert duplicate is False
    assert restored.next_expiry() == 10.0 + TTL
    assert state == {A: 10.0 + TTL, B: 20.0 + TTL}, "restoring must copy the snapshot"


class DedupWindowMachine(RuleBasedStateMachine):
    """The window against a plain model: id -> expiry, with a clock that never goes back."""

    def __init__(self) -> None:
        super().__init__()
        self.ttl = 5.0
        self.now = 0.0
        self.window = DedupWindow(self.ttl)
        self.model: dict[bytes, float] = {}

    ids = st.sampled_from([A, B, C, b"R" + bytes(15) + b"\x02"])

    @rule(step=st.floats(min_value=0.0, max_value=4.0, allow_nan=False))
    def advance_clock(self, step: float) -> None:
        self.now += step

    @rule(dedup_id=ids)
    def admit(self, dedup_id: bytes) -> None:
        expiry = self.model.get(dedup_id)
        expected = expiry is None or expiry <= self.now
        if expected:
            self.model[dedup_id] = self.now + self.ttl

        admitted = self.window.admit(dedup_id, self.now)

        assert admitted is expected

    @rule()
    def evict(self) -> None:
        self.model = {k: v for k, v in self.model.items() if v > self.now}

        self.window.evict(self.now)

        assert set(self.window.snapshot()) == set(self.model)

    @precondition(lambda self: len(self.window) > 0)
    @rule()
    def snapshot_and_restore(self) -> None:
        self.window = DedupWindow(self.ttl, self.window.snapshot())

    @invariant()
    def state_matches_the_model(self) -> None:
        assert self.window.snapshot() == self.model
        assert len(self.window) == len(self.model)

    @invariant()
    def next_expiry_is_the_earliest_expiry(self) -> None:
        expected = min(self.model.values()) if self.model else None
        assert self.window.next_expiry() == expected

    @invariant()
    def snapshot_is_in_expiry_order(self) -> None:
        expiries = list(self.window.snapshot().values())
        assert expiries == sorted(expiries)


TestDedupWindowAgainstModel = DedupWindowMachine.TestCase


@given(
    arrivals=st.lists(
        st.tuples(st.sampled_from([A, B, C]), st.floats(min_value=0.0, max_value=10.0)),
        max_size=30,
    ),
    ttl=st.floats(min_value=0.1, max_value=20.0),
)
def test_an_id_is_admitted_at_most_once_per_ttl(
    arrivals: list[tuple[bytes, float]], ttl: float
) -> None:
    window = DedupWindow(ttl)
    now = 0.0
    admitted_at: dict[bytes, list[float]] = {}

    for dedup_id, step in arrivals:
        now += step
        if window.admit(dedup_id, now):
            admitted_at.setdefault(dedup_id, []).append(now)
        window.evict(now)

    for times in admitted_at.values():
        assert all(later >= earlier + ttl for earlier, later in itertools.pairwise(times))
