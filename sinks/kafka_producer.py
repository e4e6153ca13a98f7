"""A confluent-kafka producer that reports, per record, whether the broker acknowledged it.

Idempotent, ``acks=all``: a retried send never duplicates on the broker side, and a record counts
as delivered only once every in-sync replica has it. Not Bytewax's ``KafkaSink``, which drops
failed deliveries.

- :func:`produce_and_wait` never raises for one record: a record the client refuses at
  ``produce()`` (``KafkaException``, e.g. a local ``MSG_SIZE_TOO_LARGE``) gets that error as its
  result, the others are still sent. The caller classifies each result with
  :func:`sinks.errors.is_record_error`.
- :class:`KafkaProducer` heals: when librdkafka puts the idempotent producer into its fatal
  state (``error_cb`` with ``err.fatal()``), the records of the call are reported failed with a
  service error (the caller retries them) and a new confluent ``Producer`` is built before the
  next call.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from runtime.logs import LIBRDKAFKA_LOGGER, log_event
from runtime.settings import Settings
from runtime.shutdown import Shutdown
from sinks.errors import is_record_error

logger = logging.getLogger(__name__)

_NEVER_STOPPING = Shutdown()
"""The stop of a producer not told of the process's: never requested."""

Headers = Sequence[tuple[str, bytes]] | Mapping[str, str | bytes]
"""Kafka headers: ``(name, value)`` pairs, or a mapping (``str`` values are sent UTF-8 encoded)."""

_PASSED_AS_IS = (list, dict)  # the header containers confluent-kafka accepts (not a tuple)


class Producible(Protocol):
    """What :func:`produce_and_wait` reads from a record.

    An :class:`OutgoingRecord`, or any object with these attributes (an ``OutboxRow`` is
    produced as it is, without a copy into an intermediate object).
    """

    @property
    def topic(self) -> str:
        """The topic to produce to."""

    @property
    def key(self) -> bytes | None:
        """The key bytes (``None``: no key)."""

    @property
    def value(self) -> bytes | None:
        """The value bytes (``None``: a tombstone)."""

    @property
    def headers(self) -> Headers:
        """The headers (empty: none)."""


@dataclass(frozen=True, slots=True)
class OutgoingRecord:
    """A record to produce."""

    topic: str
    key: bytes | None
    value: bytes | None
    headers: Sequence[tuple[str, bytes]] = ()


class ObservedProducer(Producer):
    """A confluent ``Producer`` whose ``error_cb`` records librdkafka's fatal state."""

    _fatal: KafkaError | None = None

    @property
    def fatal_error(self) -> KafkaError | None:
        """The fatal error that killed this producer, or None while it is usable."""
        return self._fatal

    def mark_fatal(self, err: KafkaError) -> None:
        """Record ``err`` as the fatal error (the first one wins)."""
        if self._fatal is None:
            self._fatal = err


def fatal_error_of(producer: object) -> KafkaError | None:
    """The fatal error recorded on ``producer`` (None: healthy, or not an observed producer)."""
    err = getattr(producer, "fatal_error", None)
    return err if isinstance(err, KafkaError) else None


def build_producer(settings: Settings, client_suffix: str, **overrides: Any) -> Producer:
    """An idempotent ``acks=all`` producer with the service's connection/TLS/SASL settings.

    It is an :class:`ObservedProducer`: its ``error_cb`` logs client errors and marks the
    producer dead on a fatal one (:func:`fatal_error_of`); an ``error_cb`` in ``overrides`` is
    called too. It never creates a topic (``allow.auto.create.topics`` off; a producer's default
    is on): a deleted output topic pauses the publisher (``UNKNOWN_TOPIC_OR_PART``, a service
    error: retried, alerted as a stalled outbox) until ``create-topics`` makes it again with
    its partitions and limits, instead of a broker with ``auto.create.topics.enable`` making it
    with its defaults.
    """
    client_id = f"{settings.kafka_client_id}-{client_suffix}"
    chained: Callable[[KafkaError], None] | None = overrides.pop("error_cb", None)
    # the callback needs the producer it is given to; a weak reference, no cycle through
    # librdkafka's config
    holder: list[weakref.ref[ObservedProducer]] = []

    def on_error(err: KafkaError) -> None:
        if err.fatal():
            target = holder[0]() if holder else None
            if target is not None:
                target.mark_fatal(err)
            log_event(logger, "kafka-producer-fatal", logging.ERROR, client=client_id,
                      code=err.name(), detail=err.str())
        else:
            log_event(logger, "kafka-client-error", logging.WARNING, client=client_id,
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
        "allow.auto.create.topics": False,
        "delivery.report.only.error": True,
        "socket.connection.setup.timeout.ms": 5_000,
        "logger": LIBRDKAFKA_LOGGER,
        "error_cb": on_error,
    }
    config.update(overrides)
    producer = ObservedProducer(config)
    holder.append(weakref.ref(producer))
    return producer


def produce_and_wait(
    producer: Producer,
    records: Sequence[Producible],
    timeout: float = 35.0,
    *,
    exact_reports: bool = False,
    stopping: Shutdown | None = None,
) -> list[KafkaError | None]:
    """Produce ``records`` and wait until all are settled; the i-th result is i's error.

    ``None`` means acknowledged. Never raises for one record: a ``KafkaException`` that
    ``produce()`` raises for a record (the client refused it before queueing: a local
    ``MSG_SIZE_TOO_LARGE``, ``_INVALID_ARG``, ``_FATAL`` once the producer is dead) becomes that
    record's result, and the loop goes on with the others. A full local queue (``BufferError``)
    is served and the record retried.

    The producer reports failures only (``delivery.report.only.error``), so the happy path
    runs no Python callback per record; if anything is still in flight when ``timeout``
    passes, every record of the call counts as failed (``_TIMED_OUT``) and the caller retries
    them all (the idempotent producer and a stable MessageId make a retry safe; a duplicate is
    allowed, a loss is not).

    One delivery callback serves the whole call (no closure per record). A failure report is
    mapped back to its record by content, ``(topic, key, value)``, through an index built only
    when the first failure arrives (the happy path builds nothing). Equal records (an outbox
    value holds a unique MessageId, so only true duplicates) cannot be told apart: a failure of
    one marks all of them failed, which only costs a retry (the safe direction). A report that
    matches no record (not expected) marks every record of the call failed, for the same
    reason.

    ``exact_reports=True`` (for a producer built with ``delivery.report.only.error=False``, as
    :class:`KafkaProducer` does with ``exact_reports``): one callback per record, bound to its
    index, and success reports are kept, so on a time-out only the records with no report yet
    count as failed: a record the broker acknowledged is never reported failed (a retry never
    re-sends it). For low-volume producers (the DLQ).

    A record's ``headers`` may be a list of ``(name, bytes)`` tuples or a dict (``str`` values
    are sent UTF-8 encoded), both passed to confluent-kafka as they are; any other sequence or
    mapping is copied into a list first (confluent-kafka rejects a tuple). A requested stop
    (``stopping``) waits no longer than its grace.
    """
    return _produce_and_wait(producer, records, timeout, exact_reports, stopping)[0]


def _produce_and_wait(
    producer: Producer, records: Sequence[Producible], timeout: float, exact_reports: bool,
    stopping: Shutdown | None,
) -> tuple[list[KafkaError | None], list[bool] | None]:
    """:func:`produce_and_wait`, plus (with ``exact_reports``) which records got a report."""
    results: list[KafkaError | None] = [None] * len(records)
    settled: list[bool] | None = [False] * len(records) if exact_reports else None
    by_content: dict[tuple[str | None, bytes | None, bytes | None], list[int]] | None = None

    def on_failure(err: KafkaError | None, msg: Message) -> None:
        nonlocal by_content
        if err is None:  # a success report (only if delivery.report.only.error is off)
            return
        if by_content is None:
            by_content = {}
            for index, record in enumerate(records):
                content = (record.topic, record.key or None, record.value or None)
                by_content.setdefault(content, []).append(index)
        # ``or None``: an empty key or value may come back as None
        indices = by_content.get((msg.topic(), msg.key() or None, msg.value() or None))
        for index in range(len(records)) if indices is None else indices:
            results[index] = err

    def on_report(index: int, err: KafkaError | None, _msg: Message) -> None:
        results[index] = err
        assert settled is not None
        settled[index] = True

    def refused(index: int, err: KafkaError) -> None:
        results[index] = err
        if settled is not None:
            settled[index] = True

    if settled is None:
        _hand_over(producer, records, lambda _index: on_failure, refused)
    else:
        _hand_over(producer, records, lambda index: functools.partial(on_report, index), refused)
    deadline = time.monotonic() + timeout
    left = producer.flush(min(timeout, 1.0))  # as soon as all is settled, in steps of a second
    time_left = _NEVER_STOPPING.time_left if stopping is None else stopping.time_left
    while left > 0 and (rest := time_left(deadline - time.monotonic())) > 0:
        left = producer.flush(min(rest, 1.0))  # a stop past its grace waits no longer
    if left > 0:
        timed_out = KafkaError(KafkaError._TIMED_OUT)
        if settled is None:
            return [err or timed_out for err in results], None
        return [err if done else timed_out for err, done in zip(results, settled, strict=True)], (
            [True] * len(records)
        )
    if settled is not None:  # flushed: every record is settled (no report: only-error mode)
        settled = [True] * len(records)
    return results, settled


def _hand_over(
    producer: Producer, records: Sequence[Producible], callback_of: Callable[[int], Any],
    refused: Callable[[int, KafkaError], None],
) -> None:
    """``produce()`` each record with ``callback_of(index)`` as its delivery callback.

    A full local queue (``BufferError``) is served and the record retried; a record the client
    refuses before queueing (``KafkaException``) goes to ``refused(index, error)``.
    """
    produce = producer.produce
    for index, record in enumerate(records):
        callback = callback_of(index)
        headers: Any = record.headers  # a list or a dict is passed on as it is, not copied
        if headers and not isinstance(headers, _PASSED_AS_IS):
            headers = _confluent_headers(headers)
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
                refused(index, _error_of(exc))
                break


def _error_of(exc: KafkaException) -> KafkaError:
    """The ``KafkaError`` a ``KafkaException`` carries (a generic ``_FAIL`` if none)."""
    if exc.args and isinstance(exc.args[0], KafkaError):
        return exc.args[0]
    return KafkaError(KafkaError._FAIL, str(exc))


@dataclass(eq=False, slots=True)
class Sending:
    """Records handed to a producer by :meth:`KafkaProducer.send`, and their reports so far.

    librdkafka's callbacks fill ``results`` and ``settled`` in, also after the call that handed
    the records over returned. A record not ``settled`` is still the client's (queued, or in
    flight to a broker that has not answered): it must be waited for, never produced again. A
    second copy is a second record: the idempotent producer de-duplicates its own retries (the
    same sequence number), not a record produced twice.
    """

    producer: Producer | None
    """The client the records were handed to (None: refused before any client had them)."""
    results: list[KafkaError | None]
    """Per record: ``None`` acknowledged (once settled), else its error."""
    settled: list[bool]
    """Per record: its report came (or it was refused, or given up with a dead client)."""

    @property
    def done(self) -> bool:
        """Every record is settled."""
        return all(self.settled)


ProducerFactory = Callable[..., Producer]
"""Builds a confluent producer: ``factory(settings, client_suffix, **overrides)``."""


class KafkaProducer:
    """A producer that heals: rebuilt after librdkafka's fatal state, nothing lost.

    ``produce_and_wait(records)`` works as :func:`produce_and_wait`. When the underlying
    producer went fatal (``error_cb`` with ``err.fatal()``, or a ``_FATAL`` result) during a
    call, every record of that call that is neither acknowledged for sure nor refused with a
    record error is reported failed with a ``_FATAL`` service error, so the caller retries it;
    the dead producer is purged and a new one is built before the next call. Both the fatal
    error (``kafka-producer-fatal``) and the rebuild (``kafka-producer-rebuilt``) are logged.

    ``exact_reports=True`` turns delivery success reports on (``delivery.report.only.error``
    false) and keeps them per record: a record the broker acknowledged is never reported
    failed, even on a time-out or a fatal error. Costs one Python callback per record.
    """

    def __init__(
        self,
        settings: Settings,
        client_suffix: str,
        *,
        exact_reports: bool = False,
        factory: ProducerFactory = build_producer,
        stopping: Shutdown | None = None,
        **overrides: Any,
    ) -> None:
        """``stopping``: a requested stop bounds the waits by its grace."""
        self._settings = settings
        self._stopping = stopping or _NEVER_STOPPING
        self._suffix = client_suffix
        self._exact = exact_reports
        self._factory = factory
        self._overrides = dict(overrides)
        if exact_reports:
            self._overrides["delivery.report.only.error"] = False
        self._producer: Producer | None = None
        self._dead: KafkaError | None = None
        self.rebuilds = 0
        """How many times a dead producer was replaced."""

    @property
    def producer(self) -> Producer:
        """The current confluent producer (built, or rebuilt after a fatal error, now)."""
        producer = self._producer
        if producer is not None and (self._dead or fatal_error_of(producer)) is not None:
            self._replace(producer)
            producer = None
        if producer is None:
            producer = self._producer = self._factory(
                self._settings, self._suffix, **self._overrides
            )
        return producer

    def produce_and_wait(
        self, records: Sequence[Producible], timeout: float = 35.0
    ) -> list[KafkaError | None]:
        """Produce ``records`` and wait; one ``KafkaError | None`` per record, never raises."""
        producer = self.producer
        results, settled = _produce_and_wait(producer, records, timeout, self._exact,
                                             self._stopping)
        fatal = fatal_error_of(producer) or next(
            (err for err in results if err is not None and err.code() == KafkaError._FATAL), None
        )
        if fatal is None:
            return results
        self._dead = fatal
        retry = KafkaError(KafkaError._FATAL, f"producer died ({fatal.name()}): send again")
        out: list[KafkaError | None] = []
        for index, err in enumerate(results):
            if err is not None and is_record_error(err):
                out.append(err)
            elif err is None and settled is not None and settled[index]:
                out.append(None)  # acknowledged before the producer died
            else:
                out.append(retry)
        return out

    def send(self, records: Sequence[Producible]) -> Sending:
        """Hand ``records`` over; their reports come into the returned :class:`Sending`.

        For a producer with ``exact_reports``. Use :meth:`wait` for the reports: a record whose
        report has not come by then is still in flight and is waited for again, not sent again
        (with ``message.timeout.ms`` 0 librdkafka retries it with its sequence number until the
        broker answers, and the broker writes it once whatever it had received before).
        """
        if not self._exact:
            raise RuntimeError("send() needs a producer with exact_reports")
        producer = self.producer
        count = len(records)
        sending = Sending(producer, [None] * count, [False] * count)

        def on_report(index: int, err: KafkaError | None, _msg: Message | None = None) -> None:
            sending.results[index] = err
            sending.settled[index] = True

        _hand_over(producer, records, lambda index: functools.partial(on_report, index),
                   on_report)
        return sending

    def wait(self, sending: Sending, timeout: float = 35.0) -> list[KafkaError | None]:
        """Serve ``sending``'s reports for up to ``timeout`` s (less past a stop's grace).

        One result per record: ``None`` acknowledged, a record error or a service error from its
        report, ``_TIMED_OUT`` while it has no report yet (``sending.settled`` stays False: still
        in flight, wait again). When the client went fatal, its records with no report are
        given up (settled, ``_FATAL``: send them again; the client is replaced before the next
        call, its queue purged).
        """
        producer = sending.producer
        if producer is not None and not sending.done:
            deadline = time.monotonic() + timeout
            while (not sending.done and
                   (rest := self._stopping.time_left(deadline - time.monotonic())) > 0):
                producer.flush(min(rest, 1.0))
        fatal = None if producer is None else fatal_error_of(producer)
        if fatal is not None and not sending.done:
            if producer is self._producer:
                self._dead = fatal
            retry = KafkaError(KafkaError._FATAL, f"producer died ({fatal.name()}): send again")
            for index, done in enumerate(sending.settled):
                if not done:
                    sending.results[index] = retry
                    sending.settled[index] = True
        timed_out = KafkaError(KafkaError._TIMED_OUT)
        return [err if done else timed_out
                for err, done in zip(sending.results, sending.settled, strict=True)]

    def flush(self, timeout: float = 10.0) -> int:
        """Wait up to ``timeout`` for queued records; return how many are still queued."""
        if self._producer is None:
            return 0
        return int(self._producer.flush(timeout))

    def close(self, timeout: float = 10.0) -> None:
        """Flush what is queued (bounded) and drop the producer."""
        if self._producer is not None:
            with contextlib.suppress(KafkaException, RuntimeError):
                self._producer.flush(self._stopping.time_left(timeout))
            self._producer = None

    def _replace(self, dead: Producer) -> None:
        err = self._dead or fatal_error_of(dead)
        with contextlib.suppress(KafkaException, RuntimeError):
            dead.purge()  # what is still queued was already reported failed to the caller
            dead.flush(0)
        self._producer = None
        self._dead = None
        self.rebuilds += 1
        log_event(
            logger,
            "kafka-producer-rebuilt",
            logging.WARNING,
            client=f"{self._settings.kafka_client_id}-{self._suffix}",
            code=None if err is None else err.name(),
            detail=None if err is None else err.str(),
            rebuilds=self.rebuilds,
        )


def _confluent_headers(headers: Headers) -> list[tuple[str, str | bytes]]:
    """``headers`` as a list, the form confluent-kafka accepts besides a dict."""
    if isinstance(headers, Mapping):
        return list(headers.items())
    return list(headers)
