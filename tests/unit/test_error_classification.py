"""sinks.errors: infrastructure (retry forever) vs data (poison), by class, SQLSTATE, error code.

Kafka record errors vs service errors by librdkafka code only; the real-broker cases are in
tests/integration/test_kafka_error_classes.py.
"""

from __future__ import annotations

import psycopg
import psycopg.errors
import psycopg_pool
import pytest
from confluent_kafka import KafkaError, KafkaException

from sinks.errors import RECORD_ERROR_CODES as RECORD_CODES
from sinks.errors import (
    DeliveryFailedError,
    is_data_error,
    is_infrastructure_error,
    is_record_error,
    kafka_error_of,
)

INFRASTRUCTURE_ERRORS: list[type[psycopg.Error]] = [
    psycopg.errors.AdminShutdown,  # 57P01
    psycopg.errors.CrashShutdown,  # 57P02
    psycopg.errors.CannotConnectNow,  # 57P03
    psycopg.errors.QueryCanceled,  # 57014, statement_timeout
    psycopg.errors.SerializationFailure,  # 40001
    psycopg.errors.DeadlockDetected,  # 40P01
    psycopg.errors.LockNotAvailable,  # 55P03
    psycopg.errors.TooManyConnections,  # 53300
    psycopg.errors.OutOfMemory,  # 53200
    psycopg.errors.DiskFull,  # 53100
    psycopg.errors.ConnectionFailure,  # 08006
    psycopg.errors.ConnectionException,  # 08000
    psycopg.errors.SqlclientUnableToEstablishSqlconnection,  # 08001
    psycopg.errors.IoError,  # 58030
    psycopg.errors.ReadOnlySqlTransaction,  # 25006, a standby after failover
    psycopg.errors.IdleInTransactionSessionTimeout,  # 25P03, the server ended the session
    psycopg.errors.TransactionTimeout,  # 25P04 (PostgreSQL 17), the server ended the session
    psycopg.errors.InvalidPassword,  # 28P01, rotated credentials
    psycopg.errors.InvalidCatalogName,  # 3D000
    psycopg.errors.InsufficientPrivilege,  # 42501
    psycopg.errors.UndefinedTable,  # 42P01, migrations not applied
    psycopg.errors.UndefinedColumn,  # 42703, the schema and the code do not match
    psycopg.errors.UndefinedFunction,  # 42883
    psycopg.errors.SyntaxError,  # 42601
    psycopg.errors.DatatypeMismatch,  # 42804
]

DATA_ERRORS: list[type[psycopg.Error]] = [
    psycopg.errors.UniqueViolation,  # 23505
    psycopg.errors.ForeignKeyViolation,  # 23503
    psycopg.errors.CheckViolation,  # 23514
    psycopg.errors.NotNullViolation,  # 23502
    psycopg.errors.NumericValueOutOfRange,  # 22003
    psycopg.errors.InvalidTextRepresentation,  # 22P02
    psycopg.errors.InvalidDatetimeFormat,  # 22007
    psycopg.errors.StringDataRightTruncation,  # 22001
]

NEITHER_ERRORS: list[type[psycopg.Error]] = [
    psycopg.errors.InFailedSqlTransaction,  # 25P02
    psycopg.errors.RaiseException,  # P0001, a trigger's own error
    psycopg.errors.InternalError_,  # XX000
]


def by_name(error: type[BaseException]) -> str:
    return error.__name__


def type_name(exc: BaseException) -> str:
    return type(exc).__name__


def test_psycopg_errors_built_directly_carry_their_class_sqlstate() -> None:
    error = psycopg.errors.AdminShutdown()

    assert error.sqlstate == "57P01"
    assert psycopg.errors.UniqueViolation().sqlstate == "23505"


def test_sqlstate_lookup_maps_to_the_same_class_the_classifier_sees() -> None:
    error = psycopg.errors.lookup("40P01")()

    assert isinstance(error, psycopg.errors.DeadlockDetected)
    assert is_infrastructure_error(error)


@pytest.mark.parametrize("error", INFRASTRUCTURE_ERRORS, ids=by_name)
def test_connection_shutdown_resource_and_concurrency_errors_are_infrastructure(
    error: type[psycopg.Error],
) -> None:
    exc = error("the server says something")

    assert is_infrastructure_error(exc)
    assert not is_data_error(exc)


@pytest.mark.parametrize("error", DATA_ERRORS, ids=by_name)
def test_data_exceptions_and_constraint_violations_are_data_errors(
    error: type[psycopg.Error],
) -> None:
    exc = error("the server says something")

    assert is_data_error(exc)
    assert not is_infrastructure_error(exc)


@pytest.mark.parametrize("error", NEITHER_ERRORS, ids=by_name)
def test_programming_errors_are_neither_infrastructure_nor_data(
    error: type[psycopg.Error],
) -> None:
    exc = error()

    assert not is_infrastructure_error(exc)
    assert not is_data_error(exc)


@pytest.mark.parametrize(
    "message",
    ["connection refused", "server closed the connection unexpectedly", "deadlock detected"],
)
def test_message_text_never_makes_an_error_infrastructure(message: str) -> None:
    exc = psycopg.errors.UniqueViolation(message)

    assert not is_infrastructure_error(exc)
    assert is_data_error(exc)


@pytest.mark.parametrize(
    "message", ["duplicate key value violates unique constraint", "value out of range"]
)
def test_message_text_never_makes_an_error_a_data_error(message: str) -> None:
    exc = psycopg.errors.AdminShutdown(message)

    assert not is_data_error(exc)
    assert is_infrastructure_error(exc)


@pytest.mark.parametrize(
    "exc",
    [
        psycopg.OperationalError("connection is lost"),
        psycopg.InterfaceError("the connection is closed"),
        psycopg.errors.ConnectionTimeout("connection timeout expired"),
        psycopg_pool.PoolTimeout("couldn't get a connection after 30.00 sec"),
    ],
    ids=["operational", "interface", "connection-timeout", "pool-timeout"],
)
def test_client_side_connection_errors_without_sqlstate_are_infrastructure(
    exc: psycopg.Error,
) -> None:
    assert exc.sqlstate is None

    assert is_infrastructure_error(exc)
    assert not is_data_error(exc)


@pytest.mark.parametrize(
    "exc",
    [psycopg.DataError("no sqlstate"), psycopg.ProgrammingError("no sqlstate")],
    ids=["data-error", "programming-error"],
)
def test_other_psycopg_errors_without_sqlstate_are_neither(exc: psycopg.Error) -> None:
    assert not is_infrastructure_error(exc)
    assert not is_data_error(exc)


@pytest.mark.parametrize(
    "exc",
    [
        KafkaException(KafkaError(KafkaError._TRANSPORT)),
        KafkaException(KafkaError(KafkaError._ALL_BROKERS_DOWN)),
        KafkaException(KafkaError(KafkaError._MSG_TIMED_OUT)),
        KafkaException(),
    ],
    ids=["transport", "all-brokers-down", "message-timed-out", "bare"],
)
def test_kafka_exceptions_are_infrastructure(exc: KafkaException) -> None:
    assert is_infrastructure_error(exc)
    assert not is_data_error(exc)


@pytest.mark.parametrize(
    "exc",
    [
        DeliveryFailedError("delivery report carried an error"),
        TimeoutError(),
        ConnectionError(),
        ConnectionRefusedError(),
        ConnectionResetError(),
    ],
    ids=type_name,
)
def test_delivery_failures_timeouts_and_connection_errors_are_infrastructure(
    exc: Exception,
) -> None:
    assert is_infrastructure_error(exc)
    assert getattr(exc, "sqlstate", None) is None


@pytest.mark.parametrize(
    "exc",
    [ValueError("bad"), KeyError("x"), RuntimeError("bug"), OSError("disk")],
    ids=type_name,
)
def test_ordinary_exceptions_are_neither_infrastructure_nor_data(exc: Exception) -> None:
    assert not is_infrastructure_error(exc)
    assert not is_data_error(exc)
    assert getattr(exc, "sqlstate", None) is None


# ---- Kafka: record errors (one record, never retried forever) vs service errors ----------------

RECORD_ERROR_CODES = [
    KafkaError.MSG_SIZE_TOO_LARGE,
    KafkaError.INVALID_RECORD,
    KafkaError.RECORD_LIST_TOO_LARGE,
    KafkaError.INVALID_MSG,
    KafkaError.INVALID_MSG_SIZE,
    KafkaError.INVALID_TIMESTAMP,
    KafkaError._INVALID_ARG,
    KafkaError._BAD_MSG,
    KafkaError._KEY_SERIALIZATION,
    KafkaError._VALUE_SERIALIZATION,
]

SERVICE_ERROR_CODES = [
    KafkaError._TRANSPORT,
    KafkaError._ALL_BROKERS_DOWN,
    KafkaError._MSG_TIMED_OUT,
    KafkaError._TIMED_OUT,
    KafkaError.NOT_LEADER_FOR_PARTITION,
    KafkaError.NOT_ENOUGH_REPLICAS,
    KafkaError.NOT_ENOUGH_REPLICAS_AFTER_APPEND,
    KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
    KafkaError.TOPIC_AUTHORIZATION_FAILED,
    KafkaError.CLUSTER_AUTHORIZATION_FAILED,
    KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED,
    KafkaError.UNKNOWN_TOPIC_OR_PART,
    KafkaError._UNKNOWN_TOPIC,
    KafkaError._FATAL,
    KafkaError._PURGE_QUEUE,
    KafkaError.UNKNOWN,
]


def code_name(code: int) -> str:
    return str(KafkaError(code).name())


@pytest.mark.parametrize("code", RECORD_ERROR_CODES, ids=code_name)
def test_errors_that_reject_one_record_are_record_errors_and_not_infrastructure(code: int) -> None:
    err = KafkaError(code)

    assert is_record_error(err)
    assert not is_infrastructure_error(KafkaException(err))
    assert not is_infrastructure_error(DeliveryFailedError(err))


@pytest.mark.parametrize("code", SERVICE_ERROR_CODES, ids=code_name)
def test_transport_timeout_leadership_acl_and_fatal_errors_are_service_errors(code: int) -> None:
    err = KafkaError(code)

    assert not is_record_error(err)
    assert is_infrastructure_error(KafkaException(err))
    assert is_infrastructure_error(DeliveryFailedError(err))


def test_an_authorization_failure_pauses_the_stream_instead_of_dead_lettering() -> None:
    err = KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED)

    assert not is_record_error(err)
    assert is_infrastructure_error(DeliveryFailedError(err))


def test_a_code_this_module_does_not_know_is_a_service_error() -> None:
    err = KafkaError(12345)  # a code librdkafka may add later

    assert not is_record_error(err)
    assert is_infrastructure_error(KafkaException(err))


def test_kafka_message_text_never_changes_the_class() -> None:
    assert not is_record_error(KafkaError(KafkaError._TRANSPORT, "Message size too large"))
    assert is_record_error(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE, "broker transport failure"))


def test_only_error_codes_that_exist_in_this_librdkafka_are_listed() -> None:
    assert not hasattr(KafkaError, "_MSG_SIZE_TOO_LARGE")  # left out, not an AttributeError
    assert KafkaError.MSG_SIZE_TOO_LARGE in RECORD_CODES
    assert KafkaError._FATAL not in RECORD_CODES


def test_a_delivery_failure_built_from_a_kafka_error_keeps_it_and_its_name() -> None:
    err = KafkaError(KafkaError.MSG_SIZE_TOO_LARGE)
    exc = DeliveryFailedError(err)

    assert exc.error is err
    assert str(exc) == "MSG_SIZE_TOO_LARGE"
    assert kafka_error_of(exc) is err
    assert kafka_error_of(KafkaException(err)) is err
    assert kafka_error_of(KafkaException()) is None


def test_a_delivery_failure_with_only_a_message_stays_infrastructure() -> None:
    assert is_infrastructure_error(DeliveryFailedError("MSG_SIZE_TOO_LARGE"))  # text is ignored
