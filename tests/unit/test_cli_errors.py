"""The operator commands' exit code for a service error.

75 (run it again) only when the service is down or not answering; a refusal (Kafka
authorization, a replication factor above the brokers) is exit 2, and a PostgreSQL error that
is no outage (a program limit) is raised whole. Before, every ``OperationalError`` and
``KafkaException`` said "run it again", 75.
"""

from __future__ import annotations

import psycopg
import pytest
from confluent_kafka import KafkaError, KafkaException

from cli.__main__ import _kafka_unavailable, _postgres_unavailable


def _pg(sqlstate: str) -> BaseException:
    error_class = psycopg.errors.lookup(sqlstate)
    return error_class(f"SQLSTATE {sqlstate}")


@pytest.mark.parametrize("sqlstate", ["08006", "57P01", "57P03", "57014", "53300", "55P03",
                                      "40P01", "40001"])
def test_postgres_outages_and_transient_failures_are_run_it_again(sqlstate: str) -> None:
    assert _postgres_unavailable(_pg(sqlstate))


def test_a_failed_connect_without_a_sqlstate_is_run_it_again() -> None:
    assert _postgres_unavailable(psycopg.OperationalError("connection failed: refused"))


@pytest.mark.parametrize("sqlstate", ["54000", "54001", "55006"])
def test_postgres_errors_that_are_no_outage_are_not(sqlstate: str) -> None:
    assert not _postgres_unavailable(_pg(sqlstate))


@pytest.mark.parametrize("code", [KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN,
                                  KafkaError._TIMED_OUT, KafkaError.LEADER_NOT_AVAILABLE])
def test_kafka_down_or_not_answering_is_run_it_again(code: int) -> None:
    assert _kafka_unavailable(KafkaException(KafkaError(code)))


@pytest.mark.parametrize("code", [KafkaError.TOPIC_AUTHORIZATION_FAILED,
                                  KafkaError.CLUSTER_AUTHORIZATION_FAILED,
                                  KafkaError.SASL_AUTHENTICATION_FAILED,
                                  KafkaError.INVALID_REPLICATION_FACTOR,
                                  KafkaError.POLICY_VIOLATION])
def test_kafka_refusals_are_not(code: int) -> None:
    assert not _kafka_unavailable(KafkaException(KafkaError(code)))
