"""A confluent-kafka producer that reports, per record, whether the broker acknowledged it.

Idempotent, ``acks=all``: a retried send never duplicates on the broker side, and a record counts
as delivered only once every in-sync replica has it. Not Bytewax's ``KafkaSink``, which drops
failed deliveries.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from confluent_kafka import KafkaError, Message, Producer

from runtime.logs import LIBRDKAFKA_LOGGER
from runtime.settings import Settings


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
    producer: Producer, records: Sequence[OutgoingRecord], timeout: float = 35.0
) -> list[KafkaError | None]:
    """Produce ``records`` and wait until all are settled; the i-th result is i's error.

    ``None`` means acknowledged. The producer reports failures only
    (``delivery.report.only.error``), so the happy path runs no Python callback per record; if
    anything is still in flight when ``timeout`` passes, every record of the call counts as
    failed (``_TIMED_OUT``) and the caller retries them all (the idempotent producer and a
    stable MessageId make a retry safe; a duplicate is allowed, a loss is not).
    """
    results: list[KafkaError | None] = [None] * len(records)

    def report(index: int) -> Any:
        def on_delivery(err: KafkaError | None, _msg: Message) -> None:
            if err is not None:
                results[index] = err

        return on_delivery

    for index, record in enumerate(records):
        while True:
            try:
                producer.produce(
                    record.topic,
                    value=record.value,
                    key=record.key,
                    headers=list(record.headers),
                    on_delivery=report(index),
                )
                break
            except BufferError:
                producer.poll(0.05)  # local queue full: serve delivery reports, then retry
    if producer.flush(timeout) > 0:
        timed_out = KafkaError(KafkaError._TIMED_OUT)
        return [err or timed_out for err in results]
    return results
