"""The chaos harness: paced streams of good and poison favorites, and their exact outcome.

Used by the chaos, clean-stop and rolling-restart tests (tests/e2e/): a :class:`Stream` of
:class:`Outgoing` records (good ones of seeded owners: devenv/harness/stream.py; poison of
every kind), produced at a steady rate by :class:`PacedProducer`;
:class:`HealthMonitor` samples a running job's health and metrics; :func:`assert_exact_outcome`
checks that every good message has exactly one row and its action-tracked event exactly once
(read_committed), and that the DLQ holds exactly the poison.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
import psycopg
import pytest

from dataflows.session_linking.decode import SignInMessage
from dataflows.session_linking.store import SessionLinksStore
from devenv.harness.jobs import HttpAnswer, JobProcess
from devenv.harness.messages import favorite_envelope
from devenv.harness.metrics import metric_sum
from devenv.harness.stream import Delivery, Outgoing, Stream, good_record
from runtime.settings import Settings
from schemas.dlq import (
    HEADER_ATTEMPTS,
    HEADER_EXCEPTION_TYPE,
    HEADER_FAILED_AT,
    HEADER_REASON,
    HEADER_SOURCE_OFFSET,
    HEADER_SOURCE_PARTITION,
    HEADER_SOURCE_TOPIC,
    DlqReason,
)
from tests.support import Consumed, consume_all

RETRIES = "user_activity_favorites_retries_total"
DLQ_TOTAL = "user_activity_favorites_dlq_total"
PAUSED_SECONDS = "user_activity_paused_seconds"
PUBLISHED = "user_activity_outbox_published_total"
GOOD_TRACEPARENT = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def refuse_in_the_database(database_url: str, records: Sequence[Outgoing]) -> None:
    """Make PostgreSQL refuse the action rows of ``records`` (fault injection, SQLSTATE 23514).

    A trigger on ``action_events`` raises ``check_violation`` for a FavoriteId listed in
    ``chaos.refused_favorites``; rows of every other test are untouched.
    """
    favorite_ids = [
        uuid.UUID(orjson.loads(r.value or b"{}")["Payload"]["FavoriteId"]) for r in records
    ]
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("SELECT pg_advisory_lock(4242)")  # concurrent tests create it once
        conn.execute("CREATE SCHEMA IF NOT EXISTS chaos")
        conn.execute("CREATE TABLE IF NOT EXISTS chaos.refused_favorites (id uuid PRIMARY KEY)")
        conn.execute("""
            CREATE OR REPLACE FUNCTION chaos.refuse_favorite() RETURNS trigger
            LANGUAGE plpgsql AS $$
            BEGIN
                IF EXISTS (SELECT 1 FROM chaos.refused_favorites WHERE id = NEW.favorite_id) THEN
                    RAISE EXCEPTION 'refused by the chaos test' USING ERRCODE = 'check_violation';
                END IF;
                RETURN NEW;
            END;
            $$""")
        conn.execute("""CREATE OR REPLACE TRIGGER trg_chaos_refuse_favorite
                        BEFORE INSERT ON user_activity.action_events
                        FOR EACH ROW EXECUTE FUNCTION chaos.refuse_favorite()""")
        conn.execute("SELECT pg_advisory_unlock(4242)")
        conn.execute("INSERT INTO chaos.refused_favorites (id) SELECT unnest(%s::uuid[])"
                     " ON CONFLICT DO NOTHING", (favorite_ids,))


def poison_records(settings: Settings, rng: random.Random, devices: Sequence[uuid.UUID],
                   users: Sequence[uuid.UUID], per_kind: int) -> list[Outgoing]:
    """``per_kind`` records of each poison kind, each with a unique key and value."""
    records: list[Outgoing] = []
    for index in range(per_kind):
        marker = uuid.uuid4()
        key = f"poison-{marker}".encode()
        topic = settings.topic_favorite_added if index % 2 else settings.topic_favorite_removed
        envelope = favorite_envelope(anonymous_id=rng.choice(devices))
        misfits: list[dict[str, Any]] = [
            {**envelope, "MessageId": f"not-a-uuid-{marker}"},
            {**envelope, "Payload": {**envelope["Payload"], "OccurredAt": "2026-11-29T08:00:00"}},
            {k: v for k, v in envelope.items() if k != "Payload"},
            {**envelope, "Payload": {**envelope["Payload"], "PropertyObjectId": None}},
        ]
        records += [
            Outgoing(topic, key + b"-tombstone", None, reason=DlqReason.TOMBSTONE),
            Outgoing(topic, key + b"-utf8", b"\xff\xfe" + marker.bytes + b"\xc3\x28",
                     reason=DlqReason.NOT_UTF8),
            Outgoing(topic, key + b"-json", f'{{"MessageId": "{marker}", oops'.encode(),
                     reason=DlqReason.INVALID_JSON),
            Outgoing(topic, key + b"-schema", orjson.dumps(misfits[index % len(misfits)]),
                     reason=DlqReason.SCHEMA_MISMATCH),
            # Decodes and has a session, but the database refuses its row (SQLSTATE 23514, see
            # refuse_in_the_database): what a data error looks like, since every field we
            # write is bounded and checked before the write.
            good_record(settings, rng, devices, users,
                        headers=(("traceparent", GOOD_TRACEPARENT),), reason=DlqReason.DATA_ERROR),
        ]
    return records


# ---- watching the job ------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """One look at the job's health endpoints and metrics."""

    at: float
    ready: HttpAnswer | None
    live: HttpAnswer | None
    retries: float | None
    paused_seconds: float | None
    published: float | None = None
    """Outbox rows the broker acknowledged so far (read after ``/readyz``)."""

    @property
    def ready_state(self) -> str | None:
        return None if self.ready is None else str(self.ready.json()["state"])


class HealthMonitor(threading.Thread):
    """Samples ``/readyz``, ``/livez`` and then ``/metrics`` every ``interval`` seconds."""

    def __init__(self, job: JobProcess, interval: float = 0.5) -> None:
        super().__init__(name="health-monitor", daemon=True)
        self._job = job
        self._interval = interval
        self._done = threading.Event()
        self.samples: list[Sample] = []

    def run(self) -> None:
        while not self._done.is_set():
            at, ready, live = time.monotonic(), self._job.get("/readyz"), self._job.get("/livez")
            metrics = self._job.metrics()
            self.samples.append(Sample(
                at, ready, live, metrics.get(RETRIES), metrics.get(PAUSED_SECONDS),
                metric_sum(metrics, PUBLISHED) if metrics else None,
            ))
            self._done.wait(self._interval)

    def stop(self) -> list[Sample]:
        self._done.set()
        self.join(10)
        return self.samples

    def between(self, start: float, end: float) -> list[Sample]:
        return [s for s in self.samples if start <= s.at <= end]


@contextlib.contextmanager
def outbox_locked(database_url: str) -> Iterator[threading.Event]:
    """Hold SHARE mode on the outbox (inserts wait inside PostgreSQL) until the event is set.

    Set on leaving at the latest; the holding connection's thread is joined.
    """
    release, locked = threading.Event(), threading.Event()

    def hold() -> None:
        with psycopg.connect(database_url) as conn, conn.transaction():
            conn.execute("LOCK TABLE user_activity.outbox IN SHARE MODE")
            locked.set()
            release.wait(30)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    assert locked.wait(10)
    try:
        yield release
    finally:
        release.set()
        holder.join(10)


def count_rows(database_url: str, message_ids: Sequence[uuid.UUID]) -> int:
    with psycopg.connect(database_url, autocommit=True, connect_timeout=5) as conn:
        row = conn.execute(
            "SELECT count(*) FROM user_activity.action_events WHERE source_message_id = ANY(%s)",
            (list(message_ids),),
        ).fetchone()
    assert row is not None
    return int(row[0])


def unpublished(database_url: str, topic: str) -> int:
    with psycopg.connect(database_url, autocommit=True, connect_timeout=5) as conn:
        row = conn.execute(
            "SELECT count(*) FROM user_activity.outbox_unpublished WHERE topic = %s",
            (topic,),
        ).fetchone()
    assert row is not None
    return int(row[0])


def wait_for_rows(job: JobProcess, database_url: str, stream: Stream, at_least: int,
                  timeout: float) -> float:
    ids = stream.good_ids
    return job.wait_until(lambda: count_rows(database_url, ids) >= at_least, timeout,
                          f"{at_least} rows", interval=0.25)


def wait_until_drained(job: JobProcess, database_url: str, stream: Stream,
                       timeout: float = 180) -> float:
    """Every good message recorded and every outbox row of this test published."""
    ids = stream.good_ids
    topic = job.settings.topic_action_tracked
    return job.wait_until(
        lambda: count_rows(database_url, ids) >= len(ids) and unpublished(database_url, topic) == 0,
        timeout, f"{len(ids)} rows and an empty outbox", interval=0.5,
    )


# ---- the exact counts ------------------------------------------------------------------------


@dataclass
class Counts:
    """What the final checks counted."""

    good: int = 0
    rows: int = 0
    tracked_records: int = 0
    tracked_distinct: int = 0
    dlq: int = 0
    letters: list[Consumed] = field(default_factory=list)


def assert_exact_outcome(
    settings: Settings, database_url: str, stream: Stream, deliveries: Sequence[Delivery]
) -> Counts:
    """Rows, action-tracked and DLQ hold exactly what ``stream`` must produce, nothing else."""
    good = stream.good_ids
    poison = stream.poison
    with psycopg.connect(database_url, autocommit=True) as conn:
        # Joined here, not in SQL: the planner, with no statistics yet on a fresh outbox, chose
        # a nested loop over every outbox row for every action row (minutes).
        actions = conn.execute(
            "SELECT id, source_message_id FROM user_activity.action_events"
            " WHERE source_message_id = ANY(%s)",
            (good,),
        ).fetchall()
        announced = {  # thin rows (migration 0008) name their action
            action for (action,) in conn.execute(
                "SELECT action_event_id FROM user_activity.outbox WHERE topic = %s",
                (settings.topic_action_tracked,),
            ).fetchall()
        }
        rows = [(row_id, source) for row_id, source in actions if row_id in announced]
        all_rows = conn.execute(
            "SELECT count(*) FROM user_activity.action_events WHERE source_message_id = ANY(%s)",
            ([*good, *(_envelope_id(p) for p in poison if p.reason is DlqReason.DATA_ERROR)],),
        ).fetchone()
    # Every good message: exactly one row (and its one outbox row); the poison: none.
    per_message = Counter(source for _id, source in rows)
    assert set(per_message) == set(good), "a good message has no row"
    assert max(per_message.values()) == 1, "a good message has more than one row"
    assert all_rows == (len(good),), "a poison message has a row"
    row_ids = {row_id for row_id, _source in rows}

    tracked = consume_all(settings, settings.topic_action_tracked,
                          expect_at_least=len(good), timeout=60, settle=2.0)
    by_event: dict[str, set[str]] = {}
    for record in tracked:
        envelope = record.json()
        by_event.setdefault(envelope["AggregateId"], set()).add(envelope["MessageId"])
    assert set(by_event) == {str(r) for r in row_ids}, "action-tracked is missing a row's event"
    assert all(len(ids) == 1 for ids in by_event.values()), "a row announced with 2 MessageIds"
    copies = Counter(record.json()["MessageId"] for record in tracked)
    twice = sorted((r.json()["MessageId"], r.partition, r.offset) for r in tracked
                   if copies[r.json()["MessageId"]] > 1)
    assert not twice, f"{len(twice)} copies of events published twice (read_committed):" \
                      f" {twice[:12]}"

    dlq = consume_all(settings, settings.topic_favorites_dlq,
                      expect_at_least=len(poison), timeout=60, settle=1.0)
    assert_dlq_holds_exactly(dlq, stream, deliveries)
    return Counts(len(good), len(rows), len(tracked), len(by_event), len(dlq), dlq)


def assert_dlq_holds_exactly(
    dlq: Sequence[Consumed], stream: Stream, deliveries: Sequence[Delivery]
) -> None:
    """The DLQ is exactly the poison records: same key, value, headers; right reason/source."""
    expected = {
        (d.topic, d.partition, d.offset): r
        for r, d in zip(stream.records, deliveries, strict=True) if r.reason is not None
    }
    good_values = {r.value for r in stream.records if r.message_id is not None}
    assert not [c for c in dlq if c.value in good_values], "a good message is in the DLQ"
    letters = {}
    for letter in dlq:
        source = (
            (letter.header(HEADER_SOURCE_TOPIC) or b"").decode(),
            int(letter.header(HEADER_SOURCE_PARTITION) or b"-1"),
            int(letter.header(HEADER_SOURCE_OFFSET) or b"-1"),
        )
        assert source not in letters, f"{source} dead-lettered twice"
        letters[source] = letter
    assert set(letters) == set(expected)
    for source, record in expected.items():
        letter = letters[source]
        assert (letter.key, letter.value) == (record.key, record.value), source
        assert letter.header(HEADER_REASON) == str(record.reason).encode(), source
        assert letter.header(HEADER_ATTEMPTS) == str(record.attempts).encode(), source
        assert letter.header(HEADER_EXCEPTION_TYPE), source
        assert letter.header(HEADER_FAILED_AT), source
        original = [h for h in letter.headers if not h[0].startswith("x-")]
        assert tuple(original) == record.headers, source


def _envelope_id(record: Outgoing) -> uuid.UUID:
    assert record.value is not None
    return uuid.UUID(orjson.loads(record.value)["MessageId"])


def report(record_property: Any, name: str, values: dict[str, Any]) -> None:
    """Print the measurements (``pytest -s``) and attach them to the test's report."""
    print(f"\n[chaos {name}] " + "  ".join(f"{k}={v}" for k, v in values.items()), flush=True)
    for key, value in values.items():
        record_property(key, value)


def stop_job(job: JobProcess) -> dict[str, Any]:
    """Stop the job the way Kubernetes does (a signal, then SIGKILL); exit code, seconds.

    The seconds are the job's own (its log timestamps; None without a stop's two lines).
    """
    code = job.terminate()
    return {"stop_s": job.stop_seconds(), "stop_exit_code": code}


def count_log_events(job: JobProcess, event: str, run: int | None = None) -> int:
    return sum(1 for e in job.log_events(run) if e.get("event") == event)



def fail_sign_in_batches_of(monkeypatch: pytest.MonkeyPatch, device: uuid.UUID) -> None:
    """Session-linking store batches holding a sign-in of ``device`` raise, in this process.

    A bug triggered by that one message; other batches go through unchanged.
    """
    link_batch = SessionLinksStore.link_batch

    def failing(store: SessionLinksStore, conn: Any, messages: list[SignInMessage]) -> Any:
        if any(m.anonymous_id == device for m in messages):
            raise RuntimeError("a bug triggered by this one message")
        return link_batch(store, conn, messages)

    monkeypatch.setattr(SessionLinksStore, "link_batch", failing)
