"""Which fatal errors of the outbox's producer a new producer ends, and which stop the job."""

from __future__ import annotations

import pytest
from confluent_kafka import KafkaError

from sinks.outbox.stream import renewable


def _fatal(code: int) -> KafkaError:
    return KafkaError(code, "fatal", fatal=True)


@pytest.mark.parametrize("code", [KafkaError.OUT_OF_ORDER_SEQUENCE_NUMBER,
                                  KafkaError.UNKNOWN_PRODUCER_ID, KafkaError._FATAL,
                                  KafkaError._INCONSISTENT])
def test_the_producers_own_fatal_state_is_renewed_once_per_commit(code: int) -> None:
    assert renewable(_fatal(code), fatal_since_commit=False)
    assert not renewable(_fatal(code), fatal_since_commit=True)  # twice in a row: a restart


@pytest.mark.parametrize("code", [KafkaError._FENCED, KafkaError.PRODUCER_FENCED,
                                  KafkaError.INVALID_PRODUCER_EPOCH,
                                  KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED,
                                  KafkaError.CLUSTER_AUTHORIZATION_FAILED])
def test_a_fence_or_a_refusal_stops_at_once(code: int) -> None:
    assert not renewable(_fatal(code), fatal_since_commit=False)


def test_an_error_that_is_not_fatal_is_not_this_rules() -> None:
    assert not renewable(KafkaError(KafkaError._TIMED_OUT), fatal_since_commit=False)
