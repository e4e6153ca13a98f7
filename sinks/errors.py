"""Classify failures as infrastructure (retry forever) or poison (isolate, then dead-letter).

By exception class and SQLSTATE only, never by message text (SPEC §5).
"""

from __future__ import annotations

import psycopg
from confluent_kafka import KafkaException

INFRASTRUCTURE_SQLSTATE_CLASSES = frozenset({"08", "53", "57", "58"})
"""Connection exception, insufficient resources, operator intervention (admin shutdown,
statement timeout, cannot connect now), system error (I/O)."""

INFRASTRUCTURE_SQLSTATES = frozenset({
    "40001", "40P01", "55P03",  # serialization failure, deadlock detected, lock not available
    # The environment, not the message: every message would fail alike, and a retry succeeds once
    # an operator fixes it, so these pause the stream instead of dead-lettering good messages.
    "25006",  # read_only_sql_transaction: connected to a standby after a failover
    "28000", "28P01",  # invalid authorization / password: credentials rotated
    "3D000",  # invalid_catalog_name: the database does not exist (yet)
    "42501",  # insufficient_privilege: grants missing
    "42P01",  # undefined_table: migrations not applied yet
})
"""SQLSTATEs outside those classes that are infrastructure too."""

DATA_SQLSTATE_CLASSES = frozenset({"22", "23"})
"""Data exception, integrity constraint violation: the message's data is at fault."""


class DeliveryFailedError(Exception):
    """The broker did not acknowledge a produced record (a delivery report carried an error)."""


def sqlstate_of(exc: BaseException) -> str | None:
    """The SQLSTATE of a psycopg error, or None."""
    if isinstance(exc, psycopg.Error):
        return exc.sqlstate
    return None


def is_infrastructure_error(exc: BaseException) -> bool:
    """True for failures that another attempt later can cure: retry forever, never DLQ."""
    if isinstance(exc, (KafkaException, DeliveryFailedError, TimeoutError, ConnectionError)):
        return True
    if isinstance(exc, psycopg.Error):
        state = exc.sqlstate
        if state is None:
            # No SQLSTATE: the client lost or never had a connection (OperationalError,
            # InterfaceError on a closed connection).
            return isinstance(exc, (psycopg.OperationalError, psycopg.InterfaceError))
        return state in INFRASTRUCTURE_SQLSTATES or state[:2] in INFRASTRUCTURE_SQLSTATE_CLASSES
    return False


def is_data_error(exc: BaseException) -> bool:
    """True when PostgreSQL rejected the data itself (SQLSTATE class 22 or 23)."""
    state = sqlstate_of(exc)
    return state is not None and state[:2] in DATA_SQLSTATE_CLASSES
