"""sinks.errors: infrastructure (retry forever) vs data (poison) by class and SQLSTATE only."""

from __future__ import annotations

import psycopg
import psycopg.errors
import psycopg_pool
import pytest
from confluent_kafka import KafkaError, KafkaException

from sinks.errors import (
    DeliveryFailedError,
    is_data_error,
    is_infrastructure_error,
    sqlstate_of,
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
    psycopg.errors.InvalidPassword,  # 28P01, rotated credentials
    psycopg.errors.InvalidCatalogName,  # 3D000
    psycopg.errors.InsufficientPrivilege,  # 42501
    psycopg.errors.UndefinedTable,  # 42P01, migrations not applied
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
    psycopg.errors.UndefinedColumn,  # 42703
    psycopg.errors.SyntaxError,  # 42601
    psycopg.errors.InFailedSqlTransaction,  # 25P02
]


def by_name(error: type[BaseException]) -> str:
    return error.__name__


def type_name(exc: BaseException) -> str:
    return type(exc).__name__


def test_psycopg_errors_built_directly_carry_their_class_sqlstate() -> None:
    error = psycopg.errors.AdminShutdown()

    assert error.sqlstate == "57P01"
    assert sqlstate_of(error) == "57P01"
    assert sqlstate_of(psycopg.errors.UniqueViolation()) == "23505"


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
    assert sqlstate_of(exc) is None


@pytest.mark.parametrize(
    "exc",
    [ValueError("bad"), KeyError("x"), RuntimeError("bug"), OSError("disk")],
    ids=type_name,
)
def test_ordinary_exceptions_are_neither_infrastructure_nor_data(exc: Exception) -> None:
    assert not is_infrastructure_error(exc)
    assert not is_data_error(exc)
    assert sqlstate_of(exc) is None
