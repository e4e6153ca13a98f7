"""DedupWindow: one owner's recently seen ids, each forgotten ``ttl`` seconds after first seen."""

from __future__ import annotations

import itertools
import math
import pickle
import struct
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import bytewax.operators as op
import pytest
from bytewax.dataflow import Dataflow
from bytewax.recovery import RecoveryConfig, init_db_dir
from bytewax.testing import TestingSink, TestingSource, run_main
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from prometheus_client import REGISTRY

from dataflows.dedup import DedupState, DedupWindow
from dataflows.operators import DedupBound, DedupLogic, DedupMeter, deduplicated

TTL = 60.0
A = b"A" + bytes(16)
B = b"A" + bytes(15) + b"\x01"
C = b"R" + bytes(16)
# X + Y contains STRADDLE at byte 9: its bytes are in the window, but not as one record.
X = b"A" * 17
Y = b"B" * 17
STRADDLE = b"A" * 8 + b"B" * 9


def entries(window: DedupWindow) -> dict[bytes, float]:
    """The window's ids and expiries in expiry order, decoded from its snapshot."""
    return decode(window.snapshot())


def decode(state: DedupState) -> dict[bytes, float]:
    ids, expiries = state
    count = len(expiries) // 4
    width = len(ids) // count if count else 0
    times = struct.unpack(f"<{count}I", expiries)
    return {ids[i * width : (i + 1) * width]: float(times[i]) for i in range(count)}


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
    assert entries(window) == {A: 100.0 + 2 * TTL}


def test_expired_id_is_readmitted_even_before_any_evict() -> None:
    window = DedupWindow(TTL)
    window.admit(A, now=100.0)
    window.admit(B, now=100.0)

    verdicts = [window.admit(A, now=200.0), window.admit(A, now=201.0), window.admit(B, now=202.0)]

    assert verdicts == [True, False, True]
    assert entries(window) == {A: 260.0, B: 262.0}


def test_expiry_is_rounded_up_to_a_whole_second_so_an_id_is_never_forgotten_early() -> None:
    window = DedupWindow(TTL)
    window.admit(A, now=100.25)

    verdicts = [window.admit(A, now=160.25), window.admit(A, now=160.999), window.admit(A, 161.0)]

    assert verdicts == [False, False, True]
    assert entries(window) == {A: 221.0}


def test_duplicate_does_not_extend_the_expiry() -> None:
    window = DedupWindow(TTL)
    window.admit(A, now=100.0)

    window.admit(A, now=130.0)

    assert entries(window) == {A: 100.0 + TTL}


def test_readmitted_id_moves_behind_younger_ids_in_expiry_order() -> None:
    window = DedupWindow(TTL)
    window.admit(A, now=0.0)
    window.admit(B, now=30.0)

    window.admit(A, now=TTL)

    assert list(entries(window)) == [B, A]
    assert window.next_expiry() == 30.0 + TTL


def test_a_clock_going_back_never_shortens_the_memory_of_an_id() -> None:
    window = DedupWindow(TTL)
    window.admit(A, now=100.0)

    window.admit(B, now=90.0)

    assert entries(window) == {A: 160.0, B: 160.0}
    assert window.admit(B, now=155.0) is False


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

    assert entries(window) == {C: 30.0 + TTL}
    assert window.next_expiry() == 30.0 + TTL
    assert len(window) == 1


def test_evict_before_any_expiry_keeps_everything() -> None:
    window = DedupWindow(TTL)
    window.admit(A, now=10.0)

    window.evict(now=10.0 + TTL - 0.001)

    assert entries(window) == {A: 10.0 + TTL}


def test_evict_of_everything_empties_the_window() -> None:
    window = DedupWindow(TTL)
    window.admit(A, now=10.0)
    window.admit(B, now=20.0)

    window.evict(now=1_000.0)

    assert len(window) == 0
    assert window.next_expiry() is None
    assert window.snapshot() == (b"", b"")


def test_evictions_in_small_steps_forget_in_insertion_order() -> None:
    window = DedupWindow(1_000.0)
    ids = [b"A" + i.to_bytes(16, "big") for i in range(100)]
    for i, dedup_id in enumerate(ids):
        window.admit(dedup_id, now=float(i))

    remembered = []
    for i in range(100):
        window.evict(now=i + 1_000.0)
        remembered.append(list(entries(window)))

    assert remembered == [ids[i + 1 :] for i in range(100)]
    assert [window.admit(dedup_id, now=1_100.0) for dedup_id in ids] == [True] * 100


def test_an_id_straddling_two_records_is_not_seen() -> None:
    window = DedupWindow(TTL)
    window.admit(X, now=10.0)
    window.admit(Y, now=10.0)
    assert STRADDLE in window.snapshot()[0]

    first = window.admit(STRADDLE, now=11.0)
    again = window.admit(STRADDLE, now=12.0)

    assert (first, again) == (True, False)
    assert list(entries(window)) == [X, Y, STRADDLE]


def test_a_straddling_match_before_the_real_record_does_not_hide_it() -> None:
    window = DedupWindow(TTL)
    for dedup_id in (X, Y, STRADDLE):
        window.admit(dedup_id, now=10.0)

    assert [window.admit(dedup_id, now=11.0) for dedup_id in (X, Y, STRADDLE)] == [False] * 3


def test_window_of_16_byte_ids_works_the_same() -> None:
    window = DedupWindow(TTL)
    ids = [bytes([i]) * 16 for i in range(3)]

    verdicts = [window.admit(dedup_id, now=1.0) for dedup_id in [*ids, *ids]]

    assert verdicts == [True] * 3 + [False] * 3
    assert DedupWindow(TTL, window.snapshot()).admit(ids[0], now=2.0) is False


def test_an_id_of_another_length_is_refused() -> None:
    window = DedupWindow(TTL)
    window.admit(A, now=1.0)

    with pytest.raises(ValueError, match="16 bytes in a window of 17-byte ids"):
        window.admit(A[1:], now=1.0)
    with pytest.raises(ValueError, match="empty dedup id"):
        DedupWindow(TTL).admit(b"", now=1.0)


def test_snapshot_is_immutable_bytes_that_later_admissions_do_not_change() -> None:
    window = DedupWindow(TTL)
    window.admit(A, now=10.0)

    snapshot = window.snapshot()
    window.admit(B, now=20.0)
    window.evict(now=10.0 + TTL)

    assert snapshot == (A, struct.pack("<I", 70))
    assert all(type(part) is bytes for part in snapshot)
    assert isinstance(snapshot, tuple)


def test_snapshot_survives_pickle_and_costs_about_21_bytes_per_id() -> None:
    window = DedupWindow(TTL)
    ids = [b"R" + i.to_bytes(16, "little") for i in range(1000)]
    for i, dedup_id in enumerate(ids):
        window.admit(dedup_id, now=1_000.0 + i / 100)

    pickled = pickle.dumps(window.snapshot(), protocol=pickle.HIGHEST_PROTOCOL)
    restored = DedupWindow(TTL, pickle.loads(pickled))

    assert entries(restored) == entries(window)
    assert [restored.admit(dedup_id, now=1_050.0) for dedup_id in ids[:5]] == [False] * 5
    assert len(pickled) <= 21 * 1000 + 64


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
    assert decode(state) == {A: 10.0 + TTL, B: 20.0 + TTL}, "restoring must copy the snapshot"


def test_empty_states_restore_an_empty_window() -> None:
    states: list[DedupState] = [(b"", b""), DedupWindow(TTL).snapshot()]
    for state in states:
        window = DedupWindow(TTL, state)

        assert (len(window), window.next_expiry()) == (0, None)
        assert window.admit(A[1:], now=1.0) is True  # the width is not fixed yet


def test_inconsistent_snapshots_are_refused() -> None:
    for state in ((A, b"\x00\x00\x00"), (A, b""), (A[:5], struct.pack("<2I", 1, 2))):
        with pytest.raises(ValueError, match="dedup snapshot"):
            DedupWindow(TTL, state)


def test_a_large_window_uses_its_index_and_stays_exact() -> None:
    window = DedupWindow(TTL, index_above=64)
    ids = [b"A" + i.to_bytes(16, "big") for i in range(1_000)]

    first = [window.admit(dedup_id, now=float(i // 100)) for i, dedup_id in enumerate(ids)]
    again = [window.admit(dedup_id, now=20.0) for dedup_id in ids]
    window.evict(now=TTL + 4)  # the ids of seconds 0..4 are forgotten, the rest compacted
    after = [window.admit(dedup_id, now=TTL + 4) for dedup_id in ids]

    assert first == [True] * 1_000
    assert again == [False] * 1_000
    assert after == [True] * 500 + [False] * 500
    assert len(window) == 1_000


def test_a_large_restored_window_uses_its_index() -> None:
    small = DedupWindow(TTL)
    for i in range(300):
        small.admit(b"A" + i.to_bytes(16, "big"), now=0.0)

    large = DedupWindow(TTL, small.snapshot(), index_above=100)

    assert large.admit(b"A" + (7).to_bytes(16, "big"), now=1.0) is False
    assert large.admit(b"A" + (300).to_bytes(16, "big"), now=1.0) is True


def test_a_full_window_forgets_its_oldest_id_for_each_new_one_and_counts_it() -> None:
    window = DedupWindow(TTL, max_ids=2)

    admitted = [window.admit(dedup_id, now=100.0) for dedup_id in (A, B, C)]
    a_again = window.admit(A, now=101.0)  # forgotten early (not expired): admitted again
    c_again = window.admit(C, now=101.0)

    assert admitted == [True, True, True]
    assert (a_again, c_again) == (True, False)
    assert list(entries(window)) == [C, A]
    assert window.forgotten_early == 2  # A, then B


def test_a_bounded_window_of_a_huge_stream_keeps_its_memory_bounded() -> None:
    window = DedupWindow(TTL, max_ids=1_000)

    for i in range(200_000):
        window.admit(b"A" + i.to_bytes(16, "big"), now=100.0)

    assert len(window) == 1_000
    assert window.forgotten_early == 199_000
    ids, expiries = window.snapshot()
    assert (len(ids), len(expiries)) == (17_000, 4_000)
    # live records plus at most as many dead ones awaiting compaction, and the hash index
    assert window.__sizeof__() + sum(map(sys.getsizeof, _buffers(window))) < 200_000


def test_a_state_larger_than_a_lowered_bound_is_restored_with_its_newest_ids() -> None:
    earlier = DedupWindow(TTL)
    for dedup_id in (A, B, C):
        earlier.admit(dedup_id, now=100.0)

    window = DedupWindow(TTL, earlier.snapshot(), max_ids=2)

    assert list(entries(window)) == [B, C]
    assert window.forgotten_early == 1
    assert window.admit(C, now=101.0) is False


def test_a_bound_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="max_ids"):
        DedupWindow(TTL, max_ids=0)


def _buffers(window: DedupWindow) -> list[object]:
    return [getattr(window, name) for name in ("_ids", "_exp", "_index")]


@dataclass(frozen=True)
class _Message:
    dedup_id: bytes


def test_dedup_logic_resumes_from_a_recovery_snapshot_and_snapshots_packed() -> None:
    duplicates: list[_Message] = []
    earlier = DedupWindow(TTL)
    earlier.admit(A, now=time.time())
    logic: DedupLogic[_Message] = DedupLogic(TTL, earlier.snapshot(), duplicates.append)

    fresh, discard = logic.on_batch([_Message(A), _Message(B), _Message(B)])

    assert (fresh, discard) == ([_Message(B)], False)
    assert duplicates == [_Message(A), _Message(B)]
    assert logic.notify_at() is not None
    snapshot = pickle.loads(pickle.dumps(logic.snapshot()))
    assert list(decode(snapshot)) == [A, B]
    assert DedupLogic(TTL, snapshot, duplicates.append).on_batch([_Message(A)]) == ([], False)


def test_bounded_dedup_logic_counts_the_ids_it_holds_and_those_it_forgot_early(
    caplog: pytest.LogCaptureFixture,
) -> None:
    bound = DedupBound("unit-bounded", max_ids=4, keys=2)  # 2 ids per key's window
    held = ("user_activity_dedup_ids", {"flow": "unit-bounded"})
    forgotten = ("user_activity_dedup_forgotten_early_total", {"flow": "unit-bounded"})
    earlier = DedupWindow(TTL)
    earlier.admit(A, now=time.time())
    logics: list[DedupLogic[_Message]] = []

    def step(state: DedupState | None) -> DedupLogic[_Message]:
        logics.append(DedupLogic(TTL, state, lambda _m: None, meter))
        return logics[-1]

    meter = DedupMeter(bound)
    step(earlier.snapshot())  # restored: counted at once
    step(None)
    after_restore = REGISTRY.get_sample_value(*held)
    with caplog.at_level("INFO", logger="dataflows.operators"):
        logics[0].on_batch([_Message(B), _Message(C)])  # A forgotten early
        logics[1].on_batch([_Message(A), _Message(B), _Message(C)])  # A forgotten early

    assert bound.per_key == 2
    assert after_restore == 1.0
    assert REGISTRY.get_sample_value(*held) == 4.0
    assert REGISTRY.get_sample_value(*forgotten) == 2.0
    lines = [r for r in caplog.records if r.getMessage() == "dedup-window-full"]
    assert len(lines) == 1  # once per ten minutes
    logics[0].on_notify()
    assert REGISTRY.get_sample_value(*held) == 4.0  # nothing expired yet


def _dedup_flow(
    inputs: list[object], out: list[tuple[str, _Message]], duplicates: list[_Message],
) -> Dataflow:
    flow = Dataflow("dedup_resume")
    keyed: Any = op.key_on("key", op.input("in", flow, TestingSource(inputs)), lambda m: "owner")
    fresh = deduplicated("dedup_by_message_id", keyed, TTL, duplicates.append)
    op.output("out", fresh, TestingSink(out))
    return flow


def test_a_flow_resumed_from_its_recovery_store_remembers_the_ids_it_saw(tmp_path: Path) -> None:
    init_db_dir(tmp_path, 1)
    recovery = RecoveryConfig(str(tmp_path))
    inputs = [_Message(A), _Message(B), TestingSource.ABORT(), _Message(A), _Message(C)]
    first_out: list[tuple[str, _Message]] = []
    run_main(_dedup_flow(inputs, first_out, []),  # stops at the ABORT
             epoch_interval=timedelta(0), recovery_config=recovery)
    out: list[tuple[str, _Message]] = []
    duplicates: list[_Message] = []

    run_main(_dedup_flow(inputs, out, duplicates), epoch_interval=timedelta(0),
             recovery_config=recovery)

    assert [m.dedup_id for _, m in first_out] == [A, B]
    assert [m.dedup_id for _, m in out] == [C]
    assert _Message(A) in duplicates


IDS = [A, B, C, b"R" + bytes(15) + b"\x02", X, Y, STRADDLE]


class DedupWindowMachine(RuleBasedStateMachine):
    """The window against a plain model: id -> expiry, with a clock that never goes back.

    The model's dict keeps insertion order, which is the window's expiry order; with
    ``max_ids`` its oldest entry goes when it holds more.
    """

    index_above = 1024
    max_ids: int | None = None

    def __init__(self) -> None:
        super().__init__()
        self.ttl = 5.0
        self.now = 0.0
        self.window = DedupWindow(self.ttl, index_above=self.index_above, max_ids=self.max_ids)
        self.model: dict[bytes, float] = {}

    @rule(step=st.floats(min_value=0.0, max_value=4.0, allow_nan=False))
    def advance_clock(self, step: float) -> None:
        self.now += step

    @rule(dedup_id=st.sampled_from(IDS))
    def admit(self, dedup_id: bytes) -> None:
        self.model = {k: v for k, v in self.model.items() if v > self.now}
        expected = dedup_id not in self.model
        if expected:
            self.model[dedup_id] = math.ceil(self.now + self.ttl)
            if self.max_ids is not None and len(self.model) > self.max_ids:
                del self.model[next(iter(self.model))]

        admitted = self.window.admit(dedup_id, self.now)

        assert admitted is expected

    @rule()
    def evict(self) -> None:
        self.model = {k: v for k, v in self.model.items() if v > self.now}

        self.window.evict(self.now)

        assert entries(self.window) == self.model

    @precondition(lambda self: len(self.window) > 0)
    @rule()
    def snapshot_and_restore(self) -> None:
        state = pickle.loads(pickle.dumps(self.window.snapshot()))
        self.window = DedupWindow(self.ttl, state, index_above=self.index_above,
                                  max_ids=self.max_ids)

    @invariant()
    def live_state_matches_the_model(self) -> None:
        live = {k: v for k, v in entries(self.window).items() if v > self.now}
        assert live == {k: v for k, v in self.model.items() if v > self.now}

    @invariant()
    def next_expiry_is_the_earliest_expiry(self) -> None:
        remembered = entries(self.window)
        expected = min(remembered.values()) if remembered else None
        assert self.window.next_expiry() == expected
        assert len(self.window) == len(remembered)

    @invariant()
    def snapshot_is_in_expiry_order(self) -> None:
        expiries = list(entries(self.window).values())
        assert expiries == sorted(expiries)

    @invariant()
    def never_holds_more_than_its_bound(self) -> None:
        assert self.max_ids is None or len(self.window) <= self.max_ids


class IndexedDedupWindowMachine(DedupWindowMachine):
    """The same, with the hash index from the second id on (as a window above the threshold)."""

    index_above = 1


class BoundedDedupWindowMachine(DedupWindowMachine):
    """The same, holding at most 3 of the 7 ids: the oldest are forgotten first."""

    max_ids = 3


class BoundedIndexedDedupWindowMachine(DedupWindowMachine):
    """Bounded and indexed: forgetting moves records that the hash index points at."""

    index_above = 1
    max_ids = 2


TestDedupWindowAgainstModel = DedupWindowMachine.TestCase
TestIndexedDedupWindowAgainstModel = IndexedDedupWindowMachine.TestCase
TestBoundedDedupWindowAgainstModel = BoundedDedupWindowMachine.TestCase
TestBoundedIndexedDedupWindowAgainstModel = BoundedIndexedDedupWindowMachine.TestCase


@given(
    operations=st.lists(
        st.tuples(
            st.sampled_from(["admit", "evict"]),
            st.integers(min_value=0, max_value=40),
            st.floats(min_value=0.0, max_value=3.0),
        ),
        max_size=300,
    ),
    index_above=st.sampled_from([0, 4, 1024]),
)
def test_random_admits_and_evicts_agree_with_a_dict_model(
    operations: list[tuple[str, int, float]], index_above: int
) -> None:
    ttl = 10.0
    window = DedupWindow(ttl, index_above=index_above)
    model: dict[bytes, float] = {}
    now = 0.0

    for operation, n, step in operations:
        now += step
        # ids that share bytes, so that concatenations contain misaligned copies of others
        dedup_id = bytes([n % 3]) * (n % 17) + bytes([n % 5]) * (17 - n % 17)
        if operation == "admit":
            expected = model.get(dedup_id, -1.0) <= now
            if expected:
                model[dedup_id] = math.ceil(now + ttl)
            assert window.admit(dedup_id, now) is expected
        else:
            window.evict(now)
            model = {k: v for k, v in model.items() if v > now}
            assert entries(window) == dict(sorted(model.items(), key=lambda kv: kv[1]))


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
