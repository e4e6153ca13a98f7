"""Confluent-kafka producers that report, per record, whether the broker acknowledged it.

Idempotent, ``acks=all`` (a retried send never duplicates on the broker), never creates a topic:
a deleted output topic is a service error until ``create-topics`` makes it again. Not Bytewax's
``KafkaSink``, which drops failed deliveries. :func:`hand_over` never raises for one record: a
record ``produce()`` refuses gets that error as its result. librdkafka's fatal state of the
idempotent producer is a restart (exit 75): :class:`KafkaProducer` settles every record still
waiting as ``_FATAL`` and requests the stop.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from runtime.logs import LIBRDKAFKA_LOGGER, log_event
from runtime.settings import Settings
from runtime.shutdown import Shutdown
from sinks.errors import kafka_error_of

logger = logging.getLogger(__name__)

@dataclass(frozen=True, slots=True)
class OutgoingRecord:
    """A record to produce."""

    topic: str
    key: bytes | None
    value: bytes | None
    headers: Sequence[tuple[str, bytes]] = ()


class Producible(Protocol):
    """What :func:`hand_over` sends: an outbox row as it is (``str`` header values UTF-8)."""

    @property
    def topic(self) -> str: ...  # noqa: D102

    @property
    def key(self) -> bytes | None: ...  # noqa: D102

    @property
    def value(self) -> bytes | None: ...  # noqa: D102

    @property
    def headers(self) -> Any: ...  # noqa: D102


def build_producer(settings: Settings, client_suffix: str, **overrides: Any) -> Producer:
    """An idempotent ``acks=all`` producer; its ``error_cb`` logs, then calls the given one."""
    client_id = f"{settings.kafka_client_id}-{client_suffix}"
    chained: Callable[[KafkaError], None] | None = overrides.pop("error_cb", None)

    def on_error(err: KafkaError) -> None:
        log_event(logger, "kafka-producer-fatal" if err.fatal() else "kafka-client-error",
                  logging.ERROR if err.fatal() else logging.WARNING, client=client_id,
                  code=err.name(), detail=err.str())
        if chained is not None:
            chained(err)

    config: dict[str, Any] = {
        **settings.kafka_client_config(),
        "client.id": client_id,
        "enable.idempotence": True,
        "acks": "all",
        "linger.ms": 5,
        "compression.type": "lz4",
        "message.timeout.ms": 30_000,
        # below the records' time-out: a hung (frozen) leader fails the request, whose records
        # librdkafka resends to the new leader with their sequence numbers (no copy), not we
        "socket.timeout.ms": 10_000,
        "allow.auto.create.topics": False,
        "delivery.report.only.error": True,
        "socket.connection.setup.timeout.ms": 5_000,
        "logger": LIBRDKAFKA_LOGGER,
        "error_cb": on_error,
    }
    config.update(overrides)
    return Producer(config)


def failure_reporter(records: Sequence[Producible], results: list[KafkaError | None]
                     ) -> Callable[[KafkaError | None, Message], None]:
    """One delivery callback for ``records``: a failure's error goes to ``results[i]``.

    A report is mapped back by ``(topic, key, value)``: equal records, or a report that matches
    none, fail together (a retry, the safe direction).
    """
    by_content: dict[tuple[str | None, bytes | None, bytes | None], list[int]] | None = None

    def on_failure(err: KafkaError | None, msg: Message) -> None:
        nonlocal by_content
        if err is None:
            return
        if by_content is None:  # built on the first failure only
            by_content = {}
            for index, record in enumerate(records):
                content = (record.topic, record.key or None, record.value or None)
                by_content.setdefault(content, []).append(index)
        # ``or None``: an empty key or value may come back as None
        indices = by_content.get((msg.topic(), msg.key() or None, msg.value() or None))
        for index in range(len(records)) if indices is None else indices:
            results[index] = err

    return on_failure


def hand_over(producer: Producer, records: Sequence[Producible], callback_of: Callable[[int], Any],
               refused: Callable[[int, KafkaError], None]) -> None:
    """``produce()`` each record; one refused before queueing goes to ``refused(index, error)``."""
    produce = producer.produce
    for index, record in enumerate(records):
        callback = callback_of(index)
        headers: Any = record.headers  # a list or a dict goes as it is (confluent: no tuple)
        if headers and not isinstance(headers, list | dict):
            headers = list(headers.items() if isinstance(headers, Mapping) else headers)
        while True:
            try:
                if headers:
                    produce(record.topic, record.value, record.key, on_delivery=callback,
                            headers=headers)
                else:
                    produce(record.topic, record.value, record.key, on_delivery=callback)
                break
            except BufferError:
                producer.poll(0.05)  # local queue full: serve delivery reports, then retry
            except KafkaException as exc:  # refused before queueing: this record's result
                refused(index, kafka_error_of(exc) or KafkaError(KafkaError._FAIL, str(exc)))
                break


@dataclass(eq=False, slots=True)
class Sending:
    """Records handed over by :meth:`KafkaProducer.send`; librdkafka's reports fill it in.

    A record not ``settled`` is still the client's (queued or in flight): it must be waited
    for, never produced again (a second copy is a second record to the idempotent producer).
    """

    producer: Producer | None
    results: list[KafkaError | None]
    """Per record: ``None`` acknowledged (once settled), else its error."""
    settled: list[bool]

    @property
    def done(self) -> bool:
        """Every record is settled."""
        return all(self.settled)


class KafkaProducer:
    """A producer built on first use; its fatal state requests a restart (module doc).

    :meth:`send` and :meth:`wait` need success reports (``delivery.report.only.error`` off).
    """

    def __init__(self, settings: Settings, client_suffix: str, *, stopping: Shutdown,
                 **overrides: Any) -> None:
        self._settings = settings
        self._stopping = stopping
        self._suffix = client_suffix
        self._overrides = overrides
        self._producer: Producer | None = None
        self._fatal: KafkaError | None = None

    @property
    def producer(self) -> Producer:
        """The confluent producer (built now if need be)."""
        if self._producer is None:
            self._producer = build_producer(self._settings, self._suffix,
                                            error_cb=self._on_error, **self._overrides)
        return self._producer

    def send(self, records: Sequence[Producible]) -> Sending:
        """Hand ``records`` over (success reports on); :meth:`wait` for their reports."""
        producer = self.producer
        count = len(records)
        sending = Sending(producer, [None] * count, [False] * count)

        def on_report(index: int, err: KafkaError | None, _msg: Message | None = None) -> None:
            sending.results[index] = err
            sending.settled[index] = True

        hand_over(producer, records, lambda index: functools.partial(on_report, index), on_report)
        fatal = next((e for e in sending.results if e is not None and e.fatal()), None)
        if fatal is not None:  # raised by produce() itself
            self._died(fatal)
        return sending

    def wait(self, sending: Sending, timeout: float = 35.0) -> list[KafkaError | None]:
        """Serve ``sending``'s reports for up to ``timeout`` s; one result per record.

        A record with no report yet is ``_TIMED_OUT`` and stays unsettled (wait again); after
        a fatal error it is settled as ``_FATAL`` (send it again, after the restart).
        """
        producer, deadline = sending.producer, time.monotonic() + timeout
        while (producer is not None and not sending.done
               and (rest := self._stopping.time_left(deadline - time.monotonic())) > 0):
            producer.flush(min(rest, 1.0))
        if self._fatal is not None and not sending.done:
            retry = KafkaError(KafkaError._FATAL, f"producer died ({self._fatal.name()})")
            for index, done in enumerate(sending.settled):
                if not done:
                    sending.results[index] = retry
                    sending.settled[index] = True
        timed_out = KafkaError(KafkaError._TIMED_OUT)
        return [err if done else timed_out
                for err, done in zip(sending.results, sending.settled, strict=True)]

    def close(self, timeout: float = 10.0) -> None:
        """Flush what is queued (bounded) and drop the producer."""
        if self._producer is not None:
            with contextlib.suppress(KafkaException, RuntimeError):
                self._producer.flush(self._stopping.time_left(timeout))
            self._producer = None

    def _on_error(self, err: KafkaError) -> None:
        if err.fatal():
            self._died(err)

    def _died(self, fatal: KafkaError) -> None:
        if self._fatal is None:
            self._fatal = fatal
            self._stopping.restart(f"the Kafka producer {self._suffix} is in its fatal state"
                                   f" ({fatal.name()})")
