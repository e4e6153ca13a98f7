"""Kafka I/O and row reads shared by integration and e2e tests.

Envelopes and session rows come from :mod:`devenv.harness.messages` and
:mod:`devenv.harness.sessions`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import orjson
import psycopg
from bytewax.dataflow import Dataflow
from bytewax.testing import cluster_main, run_main
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from cli.migrate import apply_migrations
from runtime.process import Process
from runtime.settings import Settings
from sinks.outbox import OutboxPublisher


@dataclass(frozen=True)
class Produced:
    topic: str
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...] = ()
    partition: int | None = None


def _arguments(record: Produced) -> dict[str, Any]:
    """``Producer.produce`` keyword arguments for ``record`` (all but its topic)."""
    kwargs: dict[str, Any] = {"key": record.key, "value": record.value,
                              "headers": list(record.headers)}
    if record.partition is not None:
        kwargs["partition"] = record.partition
    return kwargs


def produce(settings: Settings, records: Iterable[Produced], **overrides: Any) -> int:
    """Produce ``records`` in order per partition and fail unless every one is acknowledged.

    Idempotent, so a retried request (a topic's leader not known yet) cannot land after the
    records produced behind it. ``overrides``: producer settings, with ``_`` for ``.``
    (``compression_type="zstd"``).
    """
    producer = Producer({**settings.kafka_client_config(), "acks": "all", "linger.ms": 5,
                         "enable.idempotence": True,
                         **{key.replace("_", "."): value for key, value in overrides.items()}})
    errors: list[Any] = []
    count = 0
    for record in records:
        kwargs = _arguments(record)
        while True:
            try:
                producer.produce(
                    record.topic, on_delivery=lambda err, _m: errors.append(err) if err else None,
                    **kwargs,
                )
                break
            except BufferError:
                producer.poll(0.1)
        count += 1
    assert producer.flush(60) == 0
    assert errors == []
    return count


def produce_in_transactions(
    settings: Settings, transactions: Sequence[tuple[Sequence[Produced], bool]]
) -> None:
    """Produce each ``(records, commit)`` in a transaction of its own, committed or aborted.

    Returns once every touched partition's markers are written: a transaction's end returns
    before its markers reach the partitions, and until then a ``read_committed`` consumer
    (ours) sees the partitions end where the transaction began.
    """
    config = settings.kafka_client_config()
    producer = Producer({**config, "transactional.id": f"test-tx-{uuid.uuid4().hex[:8]}"})
    producer.init_transactions(30)
    touched: set[tuple[str, int]] = set()

    def delivered(err: Any, msg: Any) -> None:
        assert err is None, err
        touched.add((msg.topic(), msg.partition()))

    for records, commit in transactions:
        producer.begin_transaction()
        for record in records:
            producer.produce(record.topic, on_delivery=delivered, **_arguments(record))
        assert producer.flush(30) == 0
        if commit:
            producer.commit_transaction(30)
        else:
            producer.abort_transaction(30)
    views = [Consumer({**config, "group.id": "test-watermarks", "isolation.level": level})
             for level in ("read_committed", "read_uncommitted")]
    try:
        deadline = time.monotonic() + 30
        for topic, partition in sorted(touched):
            handle = TopicPartition(topic, partition)
            while (views[0].get_watermark_offsets(handle, timeout=10)[1]
                   != views[1].get_watermark_offsets(handle, timeout=10)[1]):
                assert time.monotonic() < deadline, f"markers of {topic}[{partition}] not written"
                time.sleep(0.05)
    finally:
        for view in views:
            view.close()


def envelope_record(topic: str, envelope: dict[str, Any], **kwargs: Any) -> Produced:
    key = str(envelope["AggregateId"]).encode()
    return Produced(topic, key, orjson.dumps(envelope), **kwargs)


@dataclass(frozen=True)
class Consumed:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...]

    def json(self) -> Any:
        assert self.value is not None
        return orjson.loads(self.value)

    def header(self, name: str) -> bytes | None:
        return next((v for k, v in self.headers if k == name), None)


def consume_all(
    settings: Settings, topic: str, *, expect_at_least: int = 0, timeout: float = 30.0,
    settle: float = 1.0, isolation: str = "read_committed",
) -> list[Consumed]:
    """Everything on ``topic`` (all partitions, from the beginning), as CRM reads it.

    Waits until at least ``expect_at_least`` records arrived (or ``timeout``), then ``settle``
    seconds more so that unexpected extra records are seen too. ``isolation``
    ``read_uncommitted`` also sees the records of aborted transactions.
    """
    consumer = Consumer({
        **settings.kafka_client_config(),
        "group.id": f"test-{uuid.uuid4()}",
        "enable.auto.commit": False,
        "enable.partition.eof": False,
        "isolation.level": isolation,
    })
    try:
        metadata = consumer.list_topics(topic, timeout=10)
        partitions = sorted(metadata.topics[topic].partitions)
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
        found: list[Consumed] = []
        deadline = time.monotonic() + timeout
        settle_until: float | None = None
        while True:
            now = time.monotonic()
            if settle_until is None and (len(found) >= expect_at_least or now > deadline):
                settle_until = now + settle
            if settle_until is not None and now > settle_until:
                return found
            for msg in consumer.consume(500, 0.2):
                if msg.error() is not None:
                    continue
                found.append(Consumed(
                    msg.topic() or topic, msg.partition() or 0, msg.offset() or 0, msg.key(),
                    msg.value(), tuple(msg.headers() or ()),  # type: ignore[arg-type]
                ))
    finally:
        consumer.close()


def action_rows(conn: psycopg.Connection[Any], source_message_ids: Sequence[uuid.UUID]) -> list[
    dict[str, Any]
]:
    with conn.cursor(row_factory=psycopg.rows.dict_row) as cur:
        cur.execute(
            "SELECT * FROM user_activity.action_events WHERE source_message_id = ANY(%s)",
            (list(source_message_ids),),
        )
        return list(cur.fetchall())


def partitions(db: psycopg.Connection[Any], parent: str) -> set[str]:
    """The names of the partitions of ``user_activity.<parent>``."""
    rows = db.execute(
        "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid"
        " WHERE i.inhparent = %s::regclass", (f"user_activity.{parent}",),
    ).fetchall()
    return {row[0] for row in rows}


def with_database(url: str, name: str) -> str:
    """The same server URL with another database (yoyo needs the URL form)."""
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, f"/{name}", parts.query, parts.fragment))


@contextlib.contextmanager
def scratch_database(database_url: str, prefix: str = "scratch", *, migrated: bool = False
                     ) -> Iterator[str]:
    """A new database on the suite's server (its URL; empty or ``migrated``), dropped after."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    admin = with_database(database_url, "postgres")
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        if migrated:
            apply_migrations(with_database(database_url, name))
        yield with_database(database_url, name)
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def recreate_topic(admin: AdminClient, topic: str, partitions: int) -> None:
    """Delete ``topic`` and create it again (the delete finishes asynchronously)."""
    admin.delete_topics([topic])[topic].result()
    deadline = time.monotonic() + 30
    while True:
        try:
            admin.create_topics([NewTopic(topic, partitions, 1)])[topic].result()
            return
        except KafkaException:
            assert time.monotonic() < deadline, f"{topic} not created again in 30 s"
            time.sleep(0.5)


def _thread_states(pid: int) -> set[str]:
    """The scheduler states (``R``, ``S``, ``T``, ...) of ``pid``'s threads."""
    states = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that just ended
            states.add((task / "stat").read_text().rpartition(")")[2].split()[0])
    return states


@contextlib.contextmanager
def frozen(pid: int) -> Iterator[None]:
    """``pid`` stopped with SIGSTOP, every thread of it seen stopped, then SIGCONT on leaving.

    Its kernel still accepts connections and buffers requests; nothing answers them. Leaving
    the block also checks it stayed stopped throughout, so a test's premise is proven, not
    assumed.
    """
    os.kill(pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 10.0
        while (states := _thread_states(pid)) != {"T"}:
            assert time.monotonic() < deadline, f"pid {pid} not stopped by SIGSTOP: {states}"
            time.sleep(0.01)
        yield
        assert _thread_states(pid) == {"T"}, f"pid {pid} went on while it should be stopped"
    finally:
        os.kill(pid, signal.SIGCONT)


def start_publisher(publisher: Any) -> Callable[[], None]:
    """Run ``publisher.run`` in a thread, as the composition root does; the call that stops it.

    The returned call sets the stop, joins the thread and closes the publisher (its last drain).
    """
    stop = threading.Event()
    thread = threading.Thread(target=publisher.run, args=(stop,), daemon=True,
                              name="test-outbox-publisher")
    thread.start()

    def stopped() -> None:
        if not stop.is_set():
            stop.set()
            thread.join(60)
            assert not thread.is_alive(), "the publisher did not stop"
            publisher.close()

    return stopped


@contextlib.contextmanager
def publishing(settings: Settings) -> Iterator[OutboxPublisher | None]:
    """The outbox publisher of a flow run in this process, drained and stopped at the end."""
    publisher = OutboxPublisher(settings, process=Process()) if settings.outbox_enabled else None
    stop = start_publisher(publisher) if publisher is not None else None
    try:
        yield publisher
    finally:
        if stop is not None:
            stop()


def run_flow(build: Callable[..., Dataflow], settings: Settings, *, workers: int = 1,
             **run_options: Any) -> None:
    """Run ``build(settings)``'s flow to its end in this process, as a job does.

    Its outbox rows are published (the publisher drained at the end); ``workers`` > 1 runs that
    many workers in this one Bytewax process.
    """
    with publishing(settings) as publisher:
        flow = build(settings, publisher=publisher)
        if workers > 1:
            cluster_main(flow, addresses=[], proc_id=0, worker_count_per_proc=workers,
                         **run_options)
        else:
            run_main(flow, **run_options)
