"""The reorder step keyed by device shard: each device in order, bounded state, bounded memory."""

from __future__ import annotations

import contextlib
import pickle
import sqlite3
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import orjson
from bytewax.recovery import RecoveryConfig, init_db_dir
from bytewax.testing import TestingSink, TestingSource, run_main
from hypothesis import given, settings
from hypothesis import strategies as st

from dataflows.session_linking import build_flow
from dataflows.session_linking.decode import SignInMessage, decode_sign_in
from dataflows.session_linking.flow import SessionLinkingSinks
from dataflows.session_linking.reorder import (
    ReorderBuffer,
    ReorderLogic,
    ReorderState,
    ShardReorder,
)
from devenv.harness.messages import sign_in_envelope
from runtime.settings import Settings
from schemas.kafka_record import SourceRecord

T0 = datetime(2026, 11, 30, 12, 0, 0, tzinfo=UTC)
DEVICES = [uuid.uuid4() for _ in range(4)]


def _sign_in(device: uuid.UUID, seconds: float, offset: int = 0) -> SignInMessage:
    envelope = sign_in_envelope(user_id=uuid.uuid4(), anonymous_id=device,
                                signed_in_at=(T0 + timedelta(seconds=seconds)).isoformat())
    decoded = decode_sign_in(SourceRecord("t", 0, offset, b"k", orjson.dumps(envelope)))
    assert isinstance(decoded, SignInMessage)
    return decoded


def _at(seconds: float) -> float:
    return (T0 + timedelta(seconds=seconds)).timestamp()


steps = st.lists(
    st.tuples(st.integers(0, len(DEVICES) - 1), st.integers(-30, 60), st.integers(0, 15)),
    min_size=1, max_size=30)
"""(device, the sign-in's SignedInAt in seconds after T0, seconds the clock then moves on).

The model is a device's own buffer, dropped when empty: what the step keyed by device did
(Bytewax discarded an empty key's state, watermark and all)."""


@settings(max_examples=200, deadline=None)
@given(steps=steps, lateness=st.sampled_from([0.0, 5.0, 10.0]))
def test_a_shard_releases_each_device_exactly_as_that_devices_own_buffer(
    steps: list[tuple[int, int, int]], lateness: float,
) -> None:
    shard = ShardReorder(lateness, max_pending=1_000)
    model = {device: ReorderBuffer(lateness) for device in DEVICES}
    released: dict[uuid.UUID, list[uuid.UUID]] = {device: [] for device in DEVICES}
    expected: dict[uuid.UUID, list[uuid.UUID]] = {device: [] for device in DEVICES}
    now = 0.0
    for index, (device_index, signed_in, later) in enumerate(steps):
        device = DEVICES[device_index]
        message = _sign_in(device, signed_in, index)
        for out in shard.add([message], _at(now)):
            released[out.anonymous_id].append(out.message_id)
        expected[device] += [m.message_id for m in model[device].add([message], _at(now))]
        if not len(model[device]):
            model[device] = ReorderBuffer(lateness)
        now += later
        for out in shard.release(_at(now)):
            released[out.anonymous_id].append(out.message_id)
        for each in DEVICES:
            expected[each] += [m.message_id for m in model[each].release(_at(now))]
            if not len(model[each]):  # an empty device's state is dropped, watermark and all
                model[each] = ReorderBuffer(lateness)
        assert len(shard) == sum(len(buffer) for buffer in model.values())
        due = [d for b in model.values() if (d := b.next_release_at()) is not None]
        assert shard.next_release_at() == (min(due) if due else None)
    restored = pickle.loads(pickle.dumps(shard.snapshot()))
    assert set(restored.devices) == {str(d) for d, b in model.items() if len(b)}
    for out in ShardReorder(lateness, 1_000, restored).flush():
        released[out.anonymous_id].append(out.message_id)
    for each in DEVICES:
        expected[each] += [m.message_id for m in model[each].flush()]
    assert released == expected
    assert shard.released_early == 0


def test_over_its_bound_a_shard_releases_the_devices_due_first_early_in_order() -> None:
    shard = ShardReorder(10.0, max_pending=3)
    first = [_sign_in(DEVICES[0], 0), _sign_in(DEVICES[0], -1)]
    shard.add(first, _at(0))
    shard.add([_sign_in(DEVICES[1], 2)], _at(2))

    early = shard.add([_sign_in(DEVICES[2], 3)], _at(3))  # a fourth: over the bound

    assert [m.message_id for m in early] == [first[1].message_id, first[0].message_id]
    assert (len(shard), shard.released_early) == (2, 2)
    assert set(shard.snapshot().devices) == {str(DEVICES[1]), str(DEVICES[2])}


def test_a_device_keyed_state_of_an_earlier_version_is_released_when_due() -> None:
    pending = _sign_in(DEVICES[0], 0)
    legacy = ReorderState((pending,), _at(0), datetime.now(UTC).timestamp() - 20)

    logic = ReorderLogic(10.0, legacy, flush_on_eof=False, max_pending=100)

    assert logic.notify_at() is not None
    released, discard = logic.on_eof()
    assert (released, discard) == ([], False)  # a tailing job keeps it for its time
    assert ReorderLogic(10.0, legacy, flush_on_eof=True, max_pending=100).on_eof() == (
        [pending], True)


def test_the_recovery_store_holds_a_row_per_shard_not_per_device(tmp_path: Path) -> None:
    # Keyed by device, the step left a row in the store for every device ever seen (a
    # discarded key's last row stays): 250 B a device for good, restarts quadratic in them.
    store = tmp_path / "recovery"
    store.mkdir()
    init_db_dir(store, 1)
    now = datetime.now(UTC).isoformat()
    records = [
        SourceRecord("signed-in", 0, offset, None, orjson.dumps(sign_in_envelope(
            user_id=uuid.uuid4(), anonymous_id=uuid.uuid4(), signed_in_at=now)))
        for offset in range(3_000)
    ]
    linked: list[tuple[str, SignInMessage]] = []
    flow = build_flow(Settings(tail=True, http_port=0, session_linking_lateness_seconds=0),
                      source=TestingSource(records, batch_size=500),
                      sinks=SessionLinkingSinks(TestingSink(linked), TestingSink([])))

    run_main(flow, epoch_interval=timedelta(milliseconds=50),
             recovery_config=RecoveryConfig(str(store), timedelta(0)))

    assert len(linked) == len(records)
    with contextlib.closing(sqlite3.connect(store / "part-0.sqlite3")) as conn:
        [(keys,)] = conn.execute("SELECT count(DISTINCT state_key) FROM snaps WHERE step_id ="
                                 " 'session_linking.reorder_by_signed_in_at'").fetchall()
    assert 0 < keys <= 16
