"""A tailing session-linking job SIGKILLed while it holds sign-ins: real broker, real PostgreSQL.

A tailing job holds each device's sign-ins for the allowed lateness before applying them, in
SignedInAt order (``dataflows/session_linking/reorder.py``). Once their input offsets are in a
snapshot, the held sign-ins exist only in the reorder step's snapshot: the next start does not
read them again. Killed then (twice), the job must still apply each of them exactly once, in
SignedInAt order: the sessions the rules give, one session-linked MessageId per linked session,
no conflict, nothing lost.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from confluent_kafka import Consumer, TopicPartition

from devenv.harness.jobs import SESSION_LINKING_FLOW, JobProcess, JobSupervisor
from devenv.harness.messages import new_id, sign_in_envelope
from devenv.harness.sessions import insert_session
from runtime.settings import Settings
from tests.conftest import SettingsFactory
from tests.support import Produced, consume_all, envelope_record, produce

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

LATENESS = 5.0
OUTCOMES = ("linked", "relinked", "started", "already-linked", "skipped-duplicate",
            "late-conflict", "skipped-superseded")


@dataclass(frozen=True)
class Device:
    """A device, its seeded guest session (if any) and its two sign-ins' users."""

    anonymous_id: uuid.UUID
    guest: uuid.UUID | None
    earlier: uuid.UUID
    """The user of the earlier SignedInAt (it arrives second)."""
    later: uuid.UUID

    def expected(self) -> list[tuple[uuid.UUID | None, uuid.UUID, str]]:
        """(the guest session's id or None for a new session, user, status), in start order."""
        if self.earlier == self.later:  # the same user twice: linked once, nothing else
            return [(self.guest, self.later, "Active")]
        return [(self.guest, self.earlier, "Ended"), (None, self.later, "Active")]


def _devices(db: psycopg.Connection[Any], per_kind: int) -> list[Device]:
    """Guest + two users, no session + two users, guest + one user twice."""
    devices = []
    for kind in range(3):
        for _ in range(per_kind):
            anonymous, earlier = new_id(), new_id()
            guest = None if kind == 1 else insert_session(
                db, anonymous_id=anonymous,
                last_activity_at=datetime.now(UTC) - timedelta(minutes=5))
            devices.append(Device(anonymous, guest, earlier, earlier if kind == 2 else new_id()))
    return devices


def _sign_ins(settings: Settings, devices: list[Device]) -> tuple[list[Produced], list[str]]:
    """Each device's later sign-in first, then its earlier one (1 s before, another user's)."""
    now = datetime.now(UTC)
    later, earlier = [], []
    for device in devices:
        later.append(sign_in_envelope(user_id=device.later, anonymous_id=device.anonymous_id,
                                      signed_in_at=now.isoformat()))
        earlier.append(sign_in_envelope(
            user_id=device.earlier, anonymous_id=device.anonymous_id,
            signed_in_at=(now - timedelta(seconds=1)).isoformat()))
    envelopes = later + earlier
    return ([envelope_record(settings.topic_user_signed_in, e) for e in envelopes],
            [f"user-activity-signed-in:{e['MessageId']}" for e in envelopes])


def _snapshotted(settings: Settings) -> bool:
    """Whether the job's snapshots cover the whole input topic.

    The input commits each partition's snapshotted offset to the consumer group (for lag tools):
    equal to the high watermark, every record is behind a snapshot.
    """
    consumer = Consumer({**settings.kafka_client_config(),
                         "group.id": settings.consumer_group_session_linking,
                         "enable.auto.commit": False})
    try:
        topic = settings.topic_user_signed_in
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        committed = consumer.committed([TopicPartition(topic, p) for p in partitions], timeout=10)
        return all(c.offset == consumer.get_watermark_offsets(c, timeout=10)[1]
                   for c in committed)
    finally:
        consumer.close()


def _applied(db: psycopg.Connection[Any], marks: list[str]) -> int:
    row = db.execute("SELECT count(*) FROM user_activity.consumer_idempotency_marks"
                     " WHERE key = ANY(%s)", (marks,)).fetchone()
    assert row is not None
    return int(row[0])


def _outcomes(job: JobProcess) -> list[Counter[str]]:
    return [Counter(e["event"] for e in job.log_events(run) if e.get("event") in OUTCOMES)
            for run in range(1, len(job.log_paths) + 1)]


def test_a_tailing_job_sigkilled_twice_while_holding_sign_ins_applies_each_once_in_order(
    make_settings: SettingsFactory, db: psycopg.Connection[Any], jobs: JobSupervisor,
) -> None:
    settings = make_settings(session_linking_lateness_seconds=LATENESS)
    devices = _devices(db, per_kind=4)
    records, marks = _sign_ins(settings, devices)
    job = jobs.job(settings, flow=SESSION_LINKING_FLOW)  # tailing, a snapshot every second
    job.start()
    produce(settings, records)
    read_at = time.monotonic()
    job.wait_until(lambda: _snapshotted(settings), 10, "a snapshot past every sign-in")
    time.sleep(1.2)  # one more snapshot interval: the snapshot is in the store
    assert time.monotonic() - read_at < LATENESS, "too slow to kill within the lateness"
    assert _applied(db, marks) == 0  # all held: they now live only in the reorder snapshot

    job.kill()
    job.start()
    time.sleep(1.5)  # restored, still held (the lateness runs again from the start)
    job.kill()
    job.start()
    job.wait_until(lambda: _applied(db, marks) == len(marks), LATENESS + 15,
                   "every held sign-in to be applied")

    sessions: list[uuid.UUID] = []
    for device in devices:
        rows = db.execute("SELECT id, user_id, status FROM user_activity.sessions"
                          " WHERE anonymous_id = %s ORDER BY started_at, id",
                          (device.anonymous_id,)).fetchall()
        sessions += [row[0] for row in rows]
        found = [(row[0] if row[0] == device.guest else None, row[1], row[2]) for row in rows]
        assert found == device.expected(), device  # in SignedInAt order, not arrival order
    guests = [d.guest for d in devices if d.guest is not None]
    outbox = Counter(topic for (topic,) in db.execute(
        "SELECT topic FROM user_activity.outbox WHERE key = ANY(%s)",
        ([str(s).encode() for s in sessions],)).fetchall())
    assert outbox == {settings.topic_session_linked: len(guests),  # one per guest session
                      settings.topic_session_started: 12, settings.topic_session_ended: 8}
    linked = consume_all(settings, settings.topic_session_linked,
                         expect_at_least=len(guests), timeout=10, settle=0.5)
    message_ids: dict[bytes | None, set[str]] = {}
    for record in linked:
        message_ids.setdefault(record.key, set()).add(record.json()["MessageId"])
    assert set(message_ids) == {str(g).encode() for g in guests}
    assert all(len(ids) == 1 for ids in message_ids.values())  # one MessageId per session
    assert db.execute("SELECT count(*) FROM user_activity.sign_in_conflicts"
                      " WHERE anonymous_id = ANY(%s)",
                      ([d.anonymous_id for d in devices],)).fetchone() == (0,)
    assert job.terminate() == 0
    assert job.exit_codes == [-9, -9, 0]
    # Nothing was applied before the kills, and the last start applied every sign-in once.
    assert _outcomes(job) == [Counter(), Counter(), Counter(
        {"linked": 8, "relinked": 8, "started": 4, "already-linked": 4})]
    assert job.leftover_pids() == []
