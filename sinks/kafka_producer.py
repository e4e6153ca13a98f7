"""A confluent-kafka producer that reports, per record, whether the broker acknowledged it.

Idempotent, ``acks=all``: a retried send never duplicates on the broker side, and a record counts
as delivered only once every in-sync replica has it. Not Bytewax's ``KafkaSink``, which drops
failed deliveries.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from confluent_kafka import KafkaError, Message, Producer

from runtime.logs import LIBRDKAFKA_LOGGER
from runtime.settings import Settings

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


def build_producer(settings: Settings, client_suffix: str, **overrides: Any) -> Producer:
    """An idempotent ``acks=all`` producer with the service's connection/TLS/SASL settings."""
    config: dict[str, Any] = {
        **settings.kafka_client_config(),
        "client.id": f"{settings.kafka_client_id}-{client_suffix}",
        "enable.idempotence": True,
        "acks": "all",
        "linger.ms": 5,
        "compression.type": "lz4",
        "message.timeout.ms": 30_000,
        "delivery.report.only.error": True,
        "socket.connection.setup.timeout.ms": 5_000,
        "logger": LIBRDKAFKA_LOGGER,
    }
    config.update(overrides)
    return Producer(config)


def produce_and_wait(
    producer: Producer, records: Sequence[Producible], timeout: float = 35.0
) -> list[KafkaError | None]:
    """Produce ``records`` and wait until all are settled; the i-th result is i's error.

    ``None`` means acknowledged. The producer reports failures only
    (``delivery.report.only.error``), so the happy path runs no Python callback per record; if
    anything is still in flight when ``timeout`` passes, every record of the call counts as
    failed (``_TIMED_OUT``) and the caller retries them all (the idempotent producer and a
    stable MessageId make a retry safe; a duplicate is allowed, a loss is not).

    One delivery callback serves the whole call (no closure per record). A failure report is
    mapped back to its record by content, ``(topic, key, value)``, through an index built only
    when the first failure arrives (the happy path builds nothing). Equal records (an outbox
    value holds a unique MessageId, so only true duplicates) cannot be told apart: a failure of
    one marks all of them failed, which only costs a retry (the safe direction). A report that
    matches no record (not expected) marks every record of the call failed, for the same
    reason.

    A record's ``headers`` may be a list of ``(name, bytes)`` tuples or a dict (``str`` values
    are sent UTF-8 encoded), both passed to confluent-kafka as they are; any other sequence or
    mapping is copied into a list first (confluent-kafka rejects a tuple).
    """
    results: list[KafkaError | None] = [None] * len(records)
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

    produce = producer.produce
    for record in records:
        headers: Any = record.headers  # a list or a dict is passed on as it is, not copied
        if headers and not isinstance(headers, _PASSED_AS_IS):
            headers = _confluent_headers(headers)
        while True:
            try:
                if headers:
                    produce(record.topic, record.value, record.key, on_delivery=on_failure,
                            headers=headers)
                else:
                    produce(record.topic, record.value, record.key, on_delivery=on_failure)
                break
            except BufferError:
                producer.poll(0.05)  # local queue full: serve delivery reports, then retry
    if producer.flush(timeout) > 0:
        timed_out = KafkaError(KafkaError._TIMED_OUT)
        return [err or timed_out for err in results]
    return results


def _confluent_headers(headers: Headers) -> list[tuple[str, str | bytes]]:
    """``headers`` as a list, the form confluent-kafka accepts besides a dict."""
    if isinstance(headers, Mapping):
        return list(headers.items())
    return list(headers)
