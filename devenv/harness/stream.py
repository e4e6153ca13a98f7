"""A live upstream: favorites of seeded owners, produced at a steady rate in the background.

:func:`good_stream` draws a :class:`Stream` of valid favorites (80 % guests) of owners it seeds;
:class:`PacedProducer` produces it idempotently (``acks=all``, 5-minute delivery time-out), so a
broker outage delays records but never loses or duplicates them; ``deliveries[i]`` is where
record ``i`` landed. Shared by the e2e tests and the benchmark's timing phase.
"""

from __future__ import annotations

import logging
import random
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from confluent_kafka import KafkaError, Message, Producer

from devenv.harness.messages import favorite_envelope
from devenv.harness.sessions import seed_owners
from runtime.settings import Settings
from schemas.dlq import DlqReason

logger = logging.getLogger(__name__)


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
        """The MessageIds that must each get exactly one row."""
        return [r.message_id for r in self.records if r.message_id is not None]

    @property
    def poison(self) -> list[Outgoing]:
        """The records that must each get exactly one dead letter."""
        return [r for r in self.records if r.reason is not None]


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
    """One favorite of a seeded owner (70 % added); with ``reason``, poison of that kind."""
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


@dataclass
class Delivery:
    """Where the broker put a produced record."""

    topic: str
    partition: int
    offset: int


class PacedProducer(threading.Thread):
    """Produces a stream at ``rate`` records/s in the background (module docstring).

    ``overrides``: librdkafka settings on top.
    """

    def __init__(self, settings: Settings, records: Sequence[Outgoing], rate: float,
                 **overrides: Any) -> None:
        super().__init__(name="paced-producer", daemon=True)
        self._config = {
            **settings.kafka_client_config(),
            "enable.idempotence": True,
            "acks": "all",
            "linger.ms": 5,
            "message.timeout.ms": 300_000,
            "logger": logger,  # not raw stderr
            **overrides,
        }
        self._records = records
        self._rate = rate
        self.deliveries: list[Delivery | None] = [None] * len(records)
        self.errors: list[str] = []
        self.produced = 0
        self.started_at = self.finished_at = 0.0
        self._failure: BaseException | None = None
        self._hurry = threading.Event()
        self._purged: set[int] = set()

    def hurry(self) -> None:
        """Produce the records not produced yet at once (a backlog), not at the rate."""
        self._hurry.set()

    def run(self) -> None:
        """Produce every record at its time, then flush."""
        try:
            self._produce()
        except BaseException as exc:  # noqa: BLE001 - re-raised by result()
            self._failure = exc

    def _produce(self) -> None:
        producer = Producer(self._config)
        started = self.started_at = time.monotonic()
        for index, record in enumerate(self._records):
            due = started + index / self._rate
            while (wait := due - time.monotonic()) > 0 and not self._hurry.is_set():
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
        remaining = self._flushed(producer)
        self.finished_at = time.monotonic()
        if remaining:
            self.errors.append(f"{remaining} records not delivered")

    def _flushed(self, producer: Producer) -> int:
        """Flush; records left queued (never sent) a minute on are sent by a new producer.

        librdkafka can keep a partition's leader unknown after a broker restart ("new leader-1
        not found in cache") while later metadata lists it: what waits for that partition never
        goes. Only records never sent are purged and produced again, so none lands twice.
        """
        deadline = time.monotonic() + 300
        while (remaining := producer.flush(60)) and time.monotonic() < deadline:
            self._purged.clear()
            producer.purge(in_queue=True, in_flight=False, blocking=True)
            while producer.poll(0.1):  # the purged records' callbacks
                pass
            if not self._purged:
                continue  # only records in flight: their requests decide
            logger.warning("paced producer: %d records queued a minute, sent anew",
                           len(self._purged))
            producer.flush(max(0.0, deadline - time.monotonic()))  # those in flight
            producer = Producer(self._config)
            for index in sorted(self._purged):
                record = self._records[index]
                producer.produce(record.topic, key=record.key, value=record.value,
                                 headers=list(record.headers), on_delivery=self._report(index))
        return remaining

    def _report(self, index: int) -> Any:
        def on_delivery(err: KafkaError | None, msg: Message) -> None:
            if err is not None and err.code() == KafkaError._PURGE_QUEUE:
                self._purged.add(index)  # never sent: produced again (_flushed)
                return
            if err is not None:
                self.errors.append(err.name())
                return
            self.deliveries[index] = Delivery(msg.topic() or "", msg.partition() or 0,
                                              msg.offset() or 0)
        return on_delivery

    @property
    def acknowledged(self) -> int:
        """How many records the broker has acknowledged so far."""
        return sum(d is not None for d in self.deliveries)

    @property
    def seconds(self) -> float:
        """How long producing and delivering everything took."""
        return round(self.finished_at - self.started_at, 1)

    def result(self, timeout: float = 320) -> list[Delivery]:
        """Wait until every record is acknowledged; where each landed.

        Raises AssertionError if one was not (or the producer failed: its exception).
        """
        self.join(timeout)
        if self.is_alive():
            raise AssertionError("the producer did not finish")
        if self._failure is not None:
            raise self._failure
        if self.errors or not all(d is not None for d in self.deliveries):
            raise AssertionError(f"records not delivered: {self.errors}")
        return [d for d in self.deliveries if d is not None]
