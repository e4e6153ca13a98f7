"""Chaos on real services (SPEC §5, AC7): the real job in a subprocess, real Kafka and PostgreSQL.

(a) PostgreSQL stopped >= 20 s in the middle of a 20k-message stream, then started;
(b) the Kafka broker stopped and restarted in the middle of the stream;
(c) the job SIGKILLed three times at different points and restarted on the same recovery dir;
(d) 5 % poison of every kind mixed into good messages.

Each ends with exact counts: every good message has exactly one row; action-tracked holds exactly
one distinct MessageId per row (redelivered copies of it allowed, none missing); the DLQ holds
exactly the poison (original key/value, reason code, source coordinates), nothing good; no job
process is left running. Measurements are printed (``pytest -s``) and recorded as properties.
"""

from __future__ import annotations

import logging
import random
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest
from confluent_kafka import KafkaError, Message, Producer

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
from tests.conftest import SettingsFactory
from tests.jobs import FavoritesJob, HttpAnswer, JobSupervisor, supervised_jobs
from tests.support import Consumed, consume_all, favorite_envelope

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

RETRIES = "user_activity_favorites_retries_total"
DLQ_TOTAL = "user_activity_favorites_dlq_total"
PAUSED_SECONDS = "user_activity_paused_seconds"
GOOD_TRACEPARENT = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
POSTGRES_DOWN_SECONDS = 22.0
KAFKA_DOWN_SECONDS = 35.0
"""Longer than the producers' ``message.timeout.ms`` (30 s): deliveries fail and are retried."""


# ---- the stream ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Outgoing:
    """A record to produce, and what the job must make of it."""

    topic: str
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...] = ()
    message_id: uuid.UUID | None = None  # set for good messages (one row each)
    reason: DlqReason | None = None  # set for poison (one dead letter each)
    attempts: int = 1


@dataclass
class Stream:
    """Good messages and poison, in production order."""

    records: list[Outgoing]

    @property
    def good_ids(self) -> list[uuid.UUID]:
        return [r.message_id for r in self.records if r.message_id is not None]

    @property
    def poison(self) -> list[Outgoing]:
        return [r for r in self.records if r.reason is not None]


def seed_owners(database_url: str, devices: int, users: int) -> tuple[list[uuid.UUID], ...]:
    """Active sessions in bulk: ``devices`` guest devices and ``users`` linked (device, user)."""
    anonymous = [uuid.uuid4() for _ in range(devices + users)]
    user_ids: list[uuid.UUID | None] = [None] * devices + [uuid.uuid4() for _ in range(users)]
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            """INSERT INTO user_activity.sessions
                   (id, anonymous_id, user_id, linked_at, status, started_at, last_activity_at)
               SELECT gen_random_uuid(), a, u, CASE WHEN u IS NULL THEN NULL ELSE now() END,
                      'Active', now() - interval '1 hour', now()
                 FROM unnest(%s::uuid[], %s::uuid[]) AS t (a, u)""",
            (anonymous, user_ids),
        )
    return anonymous[:devices], [u for u in user_ids if u is not None]


def good_stream(settings: Settings, database_url: str, count: int, seed: int) -> Stream:
    """``count`` valid favorites events of seeded owners on both topics (80 % guests)."""
    rng = random.Random(seed)
    devices, users = seed_owners(database_url, 400, 100)
    return Stream([good_record(settings, rng, devices, users) for _ in range(count)])


def good_record(
    settings: Settings, rng: random.Random, devices: Sequence[uuid.UUID],
    users: Sequence[uuid.UUID], *, headers: tuple[tuple[str, bytes], ...] = (),
    reason: DlqReason | None = None,
) -> Outgoing:
    topic = (settings.topic_favorite_added if rng.random() < 0.7
             else settings.topic_favorite_removed)
    if rng.random() < 0.8:
        envelope = favorite_envelope(anonymous_id=rng.choice(devices))
    else:
        envelope = favorite_envelope(user_id=rng.choice(users))
    message_id = uuid.UUID(envelope["MessageId"])
    return Outgoing(
        topic, str(envelope["AggregateId"]).encode(), orjson.dumps(envelope), headers,
        message_id=None if reason else message_id, reason=reason,
        attempts=3 if reason else 1,
    )


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


@dataclass
class Delivery:
    """Where the broker put a produced record."""

    topic: str
    partition: int
    offset: int


class PacedProducer(threading.Thread):
    """Produces a stream at a steady rate in the background (a live upstream service).

    Idempotent with a 5-minute delivery timeout, so a broker outage delays records but never
    loses or duplicates them. ``deliveries[i]`` is where record ``i`` landed.
    """

    def __init__(self, settings: Settings, records: Sequence[Outgoing], rate: float) -> None:
        super().__init__(name="paced-producer", daemon=True)
        self._config = {
            **settings.kafka_client_config(),
            "enable.idempotence": True,
            "acks": "all",
            "linger.ms": 5,
            "message.timeout.ms": 300_000,
            "logger": logging.getLogger("tests.paced_producer"),  # not raw stderr
        }
        self._records = records
        self._rate = rate
        self.deliveries: list[Delivery | None] = [None] * len(records)
        self.errors: list[str] = []
        self.produced = 0
        self.started_at = self.finished_at = 0.0
        self._failure: BaseException | None = None

    def run(self) -> None:
        try:
            self._produce()
        except BaseException as exc:  # re-raised by result()
            self._failure = exc

    def _produce(self) -> None:
        producer = Producer(self._config)
        started = self.started_at = time.monotonic()
        for index, record in enumerate(self._records):
            due = started + index / self._rate
            while (wait := due - time.monotonic()) > 0:
                producer.poll(min(wait, 0.05))
            while True:
                try:
                    producer.produce(
                        record.topic, key=record.key, value=record.value,
                        headers=list(record.headers), on_delivery=self._report(index),
                    )
                    break
                except BufferError:
                    producer.poll(0.05)
            self.produced = index + 1
        remaining = producer.flush(300)
        self.finished_at = time.monotonic()
        if remaining:
            self.errors.append(f"{remaining} records not delivered")

    def _report(self, index: int) -> Any:
        def on_delivery(err: KafkaError | None, msg: Message) -> None:
            if err is not None:
                self.errors.append(err.name())
                return
            self.deliveries[index] = Delivery(msg.topic() or "", msg.partition() or 0,
                                              msg.offset() or 0)
        return on_delivery

    @property
    def seconds(self) -> float:
        """How long producing and delivering everything took."""
        return round(self.finished_at - self.started_at, 1)

    def result(self, timeout: float = 320) -> list[Delivery]:
        """Wait until every record is acknowledged; where each landed."""
        self.join(timeout)
        assert not self.is_alive(), "the producer did not finish"
        if self._failure is not None:
            raise self._failure
        assert self.errors == []
        assert all(d is not None for d in self.deliveries)
        return [d for d in self.deliveries if d is not None]


# ---- watching the job ------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """One look at the job's health endpoints and metrics."""

    at: float
    ready: HttpAnswer | None
    live: HttpAnswer | None
    retries: float | None
    paused_seconds: float | None

    @property
    def ready_state(self) -> str | None:
        return None if self.ready is None else str(self.ready.json()["state"])


class HealthMonitor(threading.Thread):
    """Samples ``/readyz``, ``/livez`` and ``/metrics`` every ``interval`` seconds."""

    def __init__(self, job: FavoritesJob, interval: float = 0.5) -> None:
        super().__init__(name="health-monitor", daemon=True)
        self._job = job
        self._interval = interval
        self._done = threading.Event()
        self.samples: list[Sample] = []

    def run(self) -> None:
        while not self._done.is_set():
            metrics = self._job.metrics()
            self.samples.append(Sample(
                time.monotonic(), self._job.get("/readyz"), self._job.get("/livez"),
                metrics.get(RETRIES), metrics.get(PAUSED_SECONDS),
            ))
            self._done.wait(self._interval)

    def stop(self) -> list[Sample]:
        self._done.set()
        self.join(10)
        return self.samples

    def between(self, start: float, end: float) -> list[Sample]:
        return [s for s in self.samples if start <= s.at <= end]


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
            "SELECT count(*) FROM user_activity.outbox WHERE topic = %s AND published_at IS NULL",
            (topic,),
        ).fetchone()
    assert row is not None
    return int(row[0])


def wait_for_rows(job: FavoritesJob, database_url: str, stream: Stream, at_least: int,
                  timeout: float) -> float:
    ids = stream.good_ids
    return job.wait_until(lambda: count_rows(database_url, ids) >= at_least, timeout,
                          f"{at_least} rows", interval=0.25)


def wait_until_drained(job: FavoritesJob, database_url: str, stream: Stream,
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
        rows = conn.execute(
            """SELECT e.id, e.source_message_id
                 FROM user_activity.action_events e
                 JOIN user_activity.outbox o ON o.topic = %s
                      AND o.key = convert_to(e.id::text, 'UTF8')
                WHERE e.source_message_id = ANY(%s)""",
            (settings.topic_action_tracked, good),
        ).fetchall()
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


def stop_job(job: FavoritesJob) -> dict[str, Any]:
    """Stop the job the way Kubernetes does (a signal, then SIGKILL); how long it took."""
    started = time.monotonic()
    code = job.terminate()
    return {"stop_s": round(time.monotonic() - started, 1), "stop_exit_code": code}


def count_log_events(job: FavoritesJob, event: str, run: int | None = None) -> int:
    return sum(1 for e in job.log_events(run) if e.get("event") == event)


# ---- fixtures --------------------------------------------------------------------------------


@pytest.fixture
def jobs(tmp_path: Path) -> Iterator[JobSupervisor]:
    """Jobs of this test; all of them are killed at the end, and none may be left running."""
    with supervised_jobs(tmp_path) as supervisor:
        yield supervisor


def _chaos_settings(make_settings: SettingsFactory) -> Settings:
    return make_settings(retry_initial_seconds=0.5, retry_max_seconds=4.0)


# ---- (a) PostgreSQL down ---------------------------------------------------------------------


def test_postgres_down_20s_mid_stream_pauses_then_records_all_20k_exactly_once(
    make_settings: SettingsFactory, database_url: str, postgres_server: Any,
    jobs: JobSupervisor, record_property: Any,
) -> None:
    if postgres_server is None:
        pytest.skip("needs the suite's own PostgreSQL server (external one configured)")
    settings = _chaos_settings(make_settings)
    stream = good_stream(settings, database_url, 20_000, seed=1)
    job = jobs.job(settings)
    job.start()
    began = time.monotonic()
    monitor = HealthMonitor(job)
    monitor.start()
    producer = PacedProducer(settings, stream.records, rate=800)
    producer.start()

    wait_for_rows(job, database_url, stream, 5_000, timeout=90)
    retries_before = job.metric(RETRIES)
    produced_at_stop = producer.produced
    rows_at_stop = count_rows(database_url, stream.good_ids)
    postgres_server.stop()
    try:
        stopped = time.monotonic()
        time.sleep(POSTGRES_DOWN_SECONDS)
        down_seconds = time.monotonic() - stopped
        produced_at_start = producer.produced
    finally:  # never leave the session's server down for the tests that follow
        postgres_server.start()
    restarted = time.monotonic()
    retries_at_start = job.metric(RETRIES)
    resumed_after = job.wait_until(
        lambda: (s := job.get("/readyz")) is not None and s.status == 200, 60, "/readyz 200",
    )
    deliveries = producer.result()
    wait_until_drained(job, database_url, stream)
    drained_after = time.monotonic() - restarted
    retries_after = job.metric(RETRIES)
    dlq_total = job.metric(DLQ_TOTAL)
    samples = monitor.stop()
    shutdown = stop_job(job)

    outage = [s for s in samples if stopped <= s.at <= restarted]
    paused = [s for s in outage if s.ready is not None and s.ready.status == 503]
    assert paused, "readyz never reported the pause"
    assert all(s.ready_state == "paused" for s in paused)
    bodies = [s.ready.json() for s in paused if s.ready is not None]
    first_paused = paused[0].at - stopped
    steady = [s for s in outage if s.at >= paused[0].at]
    assert all(s.ready_state == "paused" for s in steady), "readyz flapped while Postgres was down"
    assert down_seconds >= 20
    assert all(s.live is not None and s.live.status == 200 for s in samples), "livez failed"
    assert max(s.paused_seconds or 0.0 for s in outage) > 10
    assert retries_at_start - retries_before >= 5
    counts = assert_exact_outcome(settings, database_url, stream, deliveries)
    assert counts.dlq == 0 and dlq_total == 0
    assert counts.rows == counts.tracked_distinct == 20_000
    assert job.leftover_pids() == []
    report(record_property, "a-postgres-down", {
        "rows_at_stop": rows_at_stop,
        "postgres_down_s": round(down_seconds, 1),
        "readyz_paused_s": round(paused[-1].at - paused[0].at, 1),
        "readyz_paused_after_stop_s": round(first_paused, 1),
        "readyz_dependencies": sorted({str(b["dependency"]) for b in bodies}),
        "max_attempt_seen": max(int(b["attempt"]) for b in bodies),
        "max_paused_seconds_gauge": round(max(s.paused_seconds or 0.0 for s in outage), 1),
        "retries_during_outage": retries_at_start - retries_before,
        "retries_total": retries_after,
        "produced_during_outage": produced_at_start - produced_at_stop,
        "ready_again_after_start_s": round(resumed_after, 1),
        "drained_after_start_s": round(drained_after, 1),
        "produce_s": producer.seconds,
        "rows": counts.rows, "action_tracked_records": counts.tracked_records,
        "action_tracked_distinct": counts.tracked_distinct, "dlq": counts.dlq,
        **shutdown,
        "took_s": round(time.monotonic() - began, 1),
    })


# ---- (b) Kafka down --------------------------------------------------------------------------


def test_kafka_broker_restart_mid_stream_loses_and_duplicates_nothing(
    make_settings: SettingsFactory, database_url: str, kafka_broker: Any,
    jobs: JobSupervisor, record_property: Any,
) -> None:
    if kafka_broker is None:
        pytest.skip("needs the suite's own Kafka broker (external one configured)")
    settings = _chaos_settings(make_settings)
    stream = good_stream(settings, database_url, 8_000, seed=2)
    job = jobs.job(settings)
    job.start()
    began = time.monotonic()
    monitor = HealthMonitor(job)
    monitor.start()
    producer = PacedProducer(settings, stream.records, rate=800)
    producer.start()

    wait_for_rows(job, database_url, stream, 2_000, timeout=60)
    retries_before = job.metric(RETRIES)
    rows_at_stop = count_rows(database_url, stream.good_ids)
    stopping = time.monotonic()
    kafka_broker.stop()
    try:
        stopped = time.monotonic()
        time.sleep(KAFKA_DOWN_SECONDS)
        rows_while_down = count_rows(database_url, stream.good_ids)
        starting = time.monotonic()
    finally:  # never leave the session's broker down for the tests that follow
        kafka_broker.start()
    restarted = time.monotonic()
    deliveries = producer.result()
    wait_until_drained(job, database_url, stream)
    drained_after = time.monotonic() - restarted
    job.wait_until(lambda: (s := job.get("/readyz")) is not None and s.status == 200, 60,
                   "/readyz 200")
    retries_after = job.metric(RETRIES)
    dlq_total = job.metric(DLQ_TOTAL)
    samples = monitor.stop()
    shutdown = stop_job(job)

    outage = monitor.between(stopped, restarted)
    paused = [s for s in outage if s.ready is not None and s.ready.status == 503]
    assert paused and all(s.ready_state == "paused" for s in paused), "no pause reported"
    bodies = [s.ready.json() for s in paused if s.ready is not None]
    # The input's consumers report "kafka"; past message.timeout.ms (30 s) the outbox publisher
    # reports its own pause ("outbox") as well.
    assert "kafka" in {b["dependency"] for b in bodies} <= {"kafka", "outbox"}
    steady = monitor.between(paused[0].at, starting)
    assert all(s.ready_state == "paused" for s in steady), "readyz flapped while Kafka was down"
    assert all(s.live is not None and s.live.status == 200 for s in samples), "livez failed"
    consumer_retries = count_log_events(job, "kafka-consumer-retry")
    assert consumer_retries > 0 and count_log_events(job, "kafka-consumer-recovered") > 0
    counts = assert_exact_outcome(settings, database_url, stream, deliveries)
    assert counts.dlq == 0 and dlq_total == 0
    assert counts.rows == counts.tracked_distinct == len(stream.good_ids)
    assert job.leftover_pids() == []
    report(record_property, "b-kafka-restart", {
        "broker_stop_s": round(stopped - stopping, 1),
        "broker_down_s": round(restarted - stopped, 1),
        "readyz_paused_s": round(paused[-1].at - paused[0].at, 1),
        "readyz_paused_after_stop_s": round(paused[0].at - stopped, 1),
        "readyz_pauses": sorted({f'{b["dependency"]}:{b["last_error"]}' for b in bodies}),
        "rows_at_stop": rows_at_stop,
        "rows_while_down": rows_while_down,
        "consumer_retry_lines": consumer_retries,
        "retries_total_delta": retries_after - retries_before,
        "outbox_retries_logged": count_log_events(job, "outbox-publish-retry"),
        "drained_after_start_s": round(drained_after, 1),
        "produce_s": producer.seconds,
        "rows": counts.rows, "action_tracked_records": counts.tracked_records,
        "action_tracked_distinct": counts.tracked_distinct, "dlq": counts.dlq,
        **shutdown,
        "took_s": round(time.monotonic() - began, 1),
    })


# ---- (c) SIGKILL x3 --------------------------------------------------------------------------


def test_job_sigkilled_three_times_resumes_from_its_recovery_dir_exactly_once(
    make_settings: SettingsFactory, database_url: str, jobs: JobSupervisor, record_property: Any,
) -> None:
    settings = _chaos_settings(make_settings)
    stream = good_stream(settings, database_url, 8_000, seed=3)
    good = len(stream.good_ids)
    job = jobs.job(settings)
    job.start()
    began = time.monotonic()
    producer = PacedProducer(settings, stream.records, rate=600)
    producer.start()
    kills: list[dict[str, Any]] = []

    def kill_and_restart(point: str) -> None:
        job.kill()
        kills.append({"point": point, "rows": count_rows(database_url, stream.good_ids),
                      "produced": producer.produced})
        job.start()

    # 1: in steady processing, a fifth of the way in.
    wait_for_rows(job, database_url, stream, good // 5, timeout=60)
    kill_and_restart("steady-20%")
    # 2: right after the restart, before its first snapshot (-s 1) has surely been taken.
    time.sleep(0.3)
    kill_and_restart("just-restarted")
    # 3: later, with the producer still writing.
    wait_for_rows(job, database_url, stream, good * 7 // 10, timeout=60)
    kill_and_restart("steady-70%")
    deliveries = producer.result()
    drained_after = wait_until_drained(job, database_url, stream)
    shutdown = stop_job(job)

    counts = assert_exact_outcome(settings, database_url, stream, deliveries)
    assert counts.dlq == 0
    assert counts.rows == counts.tracked_distinct == good
    assert len(job.pids) == 4 and job.exit_codes[:3] == [-9, -9, -9]
    assert job.leftover_pids() == []
    duplicates = [count_log_events(job, "skipped-duplicate", run) for run in range(1, 5)]
    recorded = [count_log_events(job, "recorded", run) for run in range(1, 5)]
    # The database decides: at most one "recorded" per message, ever (fewer only if a kill hit
    # between a commit and its log lines).
    assert sum(recorded) <= good
    # Each restart resumed from its snapshot: a replay from the start would re-read (and skip as
    # duplicates) every message recorded before the kill.
    for run in (1, 2, 3):
        assert duplicates[run] < max(1, kills[run - 1]["rows"]), (run, duplicates, kills)
    report(record_property, "c-sigkill-x3", {
        "kills": kills,
        "recorded_per_run": recorded,
        "redelivered_skipped_per_run": duplicates,
        "drained_after_producer_done_s": round(drained_after, 1),
        "produce_s": producer.seconds,
        "rows": counts.rows, "action_tracked_records": counts.tracked_records,
        "action_tracked_distinct": counts.tracked_distinct, "dlq": counts.dlq,
        **shutdown,
        "took_s": round(time.monotonic() - began, 1),
    })


# ---- (d) poison ------------------------------------------------------------------------------


def test_five_percent_poison_of_every_kind_is_dead_lettered_and_good_messages_all_recorded(
    make_settings: SettingsFactory, database_url: str, db: psycopg.Connection[Any],
    jobs: JobSupervisor, record_property: Any,
) -> None:
    settings = _chaos_settings(make_settings)
    rng = random.Random(4)
    devices, users = seed_owners(database_url, 400, 100)
    per_kind = 40
    poison = poison_records(settings, rng, devices, users, per_kind)
    refuse_in_the_database(database_url, [p for p in poison if p.reason is DlqReason.DATA_ERROR])
    records = [
        good_record(settings, rng, devices, users,
                    headers=(("traceparent", GOOD_TRACEPARENT),) if i % 10 == 0 else ())
        for i in range(19 * len(poison))
    ]
    for record in poison:
        records.insert(rng.randrange(len(records) + 1), record)
    stream = Stream(records)
    job = jobs.job(settings)
    job.start()
    began = time.monotonic()
    producer = PacedProducer(settings, stream.records, rate=1500)
    producer.start()

    deliveries = producer.result()
    drained_after = wait_until_drained(job, database_url, stream)
    job.wait_until(lambda: job.metric(DLQ_TOTAL) >= len(poison), 60, "every dead letter")
    dlq_total = job.metric(DLQ_TOTAL)
    retries = job.metric(RETRIES)
    shutdown = stop_job(job)

    counts = assert_exact_outcome(settings, database_url, stream, deliveries)
    assert counts.dlq == dlq_total == len(poison) == 5 * per_kind
    assert len(poison) * 20 == len(records)  # 5 %
    assert counts.rows == counts.tracked_distinct == len(stream.good_ids)
    failed = [e for e in job.log_events() if e.get("event") == "record-failed"]
    assert len(failed) == per_kind
    assert {(e["sqlstate"], e["error"]) for e in failed} == {("23514", "CheckViolation")}
    data_errors = [c for c in counts.letters if c.header(HEADER_REASON) == b"data-error"]
    assert len(data_errors) == per_kind
    assert {c.header(HEADER_EXCEPTION_TYPE) for c in data_errors} == {b"CheckViolation"}
    assert {c.header("traceparent") for c in data_errors} == {GOOD_TRACEPARENT}
    assert retries == 0
    assert job.leftover_pids() == []
    reasons = Counter(str(p.reason) for p in poison)
    report(record_property, "d-poison", {
        "messages": len(records), "good": counts.good, "poison": len(poison),
        "poison_by_reason": dict(sorted(reasons.items())),
        "data_error_sqlstate": "23514",
        "drained_s": round(drained_after, 1),
        "produce_s": producer.seconds,
        "rows": counts.rows, "action_tracked_records": counts.tracked_records,
        "action_tracked_distinct": counts.tracked_distinct, "dlq": counts.dlq,
        **shutdown,
        "took_s": round(time.monotonic() - began, 1),
    })
