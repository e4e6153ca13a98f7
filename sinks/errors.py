"""Classify failures as infrastructure (retry forever) or poison (isolate, then dead-letter).

By exception class, SQLSTATE and librdkafka error code only, never by message text (SPEC §5).
PostgreSQL: the SQLSTATE classes and states below (and client-side connection errors) are
infrastructure: the stream pauses and retries forever. Classes 22 and 23 are data errors; anything
else is a bug (isolated, then dead-lettered). Kafka: a record error (:data:`RECORD_ERROR_CODES`)
refuses this one record, so it is never retried forever: the caller dead-letters, reduces or parks
it. Every other code is a service error (broker down, time-outs, ACLs, a missing topic,
``_FATAL``, unknown codes): retried with back-off, nothing dead-lettered. Of those, the topic
errors (:data:`TOPIC_ERROR_CODES`) refuse one topic only: the outbox holds back its rows alone.
"""

from __future__ import annotations

import psycopg
from confluent_kafka import KafkaError, KafkaException

INFRASTRUCTURE_SQLSTATE_CLASSES = frozenset({"08", "42", "53", "57", "58"})
"""Connection, resources, operator intervention, system error; and 42: our SQL is fixed with
bound parameters, so a class 42 error means the schema and the code do not match (a rollout)."""

INFRASTRUCTURE_SQLSTATES = frozenset({
    "40001", "40P01", "55P03",  # serialization failure, deadlock detected, lock not available
    # the environment, not the message: every message would fail alike
    "25006",  # read_only_sql_transaction: connected to a standby after a failover
    "25P03", "25P04",  # idle_in_transaction_session_timeout, transaction_timeout (an operator's)
    "28000", "28P01",  # invalid authorization / password: credentials rotated
    "3D000",  # invalid_catalog_name: the database does not exist (yet)
})
"""SQLSTATEs outside those classes that are infrastructure too."""

DATA_SQLSTATE_CLASSES = frozenset({"22", "23"})
"""Data exception, integrity constraint violation: the message's data is at fault."""

_RECORD_ERROR_NAMES = (
    "MSG_SIZE_TOO_LARGE",  # 10: larger than the topic's max.message.bytes (or the producer's)
    "RECORD_LIST_TOO_LARGE",  # 18: the record's batch is over the broker's segment size
    "INVALID_MSG",  # 2: CORRUPT_MESSAGE, the record failed its CRC or validation
    "INVALID_MSG_SIZE",  # 4: a negative or impossible size
    "INVALID_TIMESTAMP",  # 32: outside message.timestamp.before/after.max.ms
    "INVALID_RECORD",  # 87: refused by the log validator (null key on a compacted topic)
    "_MSG_SIZE_TOO_LARGE",  # not in every librdkafka: included only where it exists
    "_INVALID_ARG",  # -186: produce() refused its arguments
    "_BAD_MSG",  # -199: a malformed record
    "_KEY_SERIALIZATION",  # -162: the key serializer failed (SerializingProducer)
    "_VALUE_SERIALIZATION",  # -161: the value serializer failed
)

RECORD_ERROR_CODES = frozenset(
    getattr(KafkaError, name) for name in _RECORD_ERROR_NAMES if hasattr(KafkaError, name)
)
"""librdkafka codes that reject one record; all others are service errors."""


TOPIC_ERROR_CODES = frozenset({KafkaError.TOPIC_AUTHORIZATION_FAILED,
                               KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC})
"""Service errors that refuse one topic (its ACL, its absence), not the broker (module doc)."""


class DeliveryFailedError(Exception):
    """The broker did not acknowledge a produced record; :attr:`error` drives the classification."""

    def __init__(self, error: KafkaError | str) -> None:
        super().__init__(error.name() if isinstance(error, KafkaError) else error)
        self.error = error if isinstance(error, KafkaError) else None


def is_record_error(err: KafkaError) -> bool:
    """True when ``err`` rejects one record (retrying it is useless); by error code only."""
    return err.code() in RECORD_ERROR_CODES


def is_topic_error(err: KafkaError) -> bool:
    """True when ``err`` refuses every record of one topic (and no other); by error code only."""
    return err.code() in TOPIC_ERROR_CODES


def kafka_error_of(exc: BaseException) -> KafkaError | None:
    """The ``KafkaError`` carried by a Kafka exception of ours or confluent-kafka's, or None."""
    if isinstance(exc, DeliveryFailedError):
        return exc.error
    if isinstance(exc, KafkaException) and exc.args and isinstance(exc.args[0], KafkaError):
        return exc.args[0]
    return None


def is_infrastructure_error(exc: BaseException) -> bool:
    """True for failures that another attempt later can cure: retry forever, never DLQ."""
    if isinstance(exc, (KafkaException, DeliveryFailedError)):
        err = kafka_error_of(exc)
        return err is None or not is_record_error(err)
    if isinstance(exc, (TimeoutError, ConnectionError)):
        return True
    if isinstance(exc, psycopg.Error):
        state = exc.sqlstate
        if state is None:  # the client lost or never had a connection
            return isinstance(exc, (psycopg.OperationalError, psycopg.InterfaceError))
        return state in INFRASTRUCTURE_SQLSTATES or state[:2] in INFRASTRUCTURE_SQLSTATE_CLASSES
    return False


def is_data_error(exc: BaseException) -> bool:
    """True when PostgreSQL rejected the data itself (SQLSTATE class 22 or 23)."""
    state = exc.sqlstate if isinstance(exc, psycopg.Error) else None
    return state is not None and state[:2] in DATA_SQLSTATE_CLASSES
