"""The outbox lease (sinks.outbox.lease) on a real PostgreSQL: turns taken without waits.

A closing holder unlocks before its session ends, so a standby takes over at once; a holder
that gave its connection up while the server still ran the session (a client-side time-out)
ends that session and takes the lease again, instead of taking itself for another holder.
"""

from __future__ import annotations

import logging
from typing import Any

import psycopg
import pytest

from devenv.harness.jobs import wait_until
from sinks.outbox.lease import Lease
from tests.conftest import SettingsFactory

pytestmark = pytest.mark.integration


def test_a_closing_holder_hands_the_lease_to_a_standby_at_once(
    make_settings: SettingsFactory,
) -> None:
    settings = make_settings()
    holder, standby = Lease(settings, "outbox-holder"), Lease(settings, "outbox-standby")
    try:
        assert holder.take(force=True)
        assert not standby.take(force=True)

        holder.close()

        assert standby.take(force=True)  # no poll interval, no wait for the session to end
        assert standby.held
    finally:
        holder.close()
        standby.close()


def test_a_holder_that_gave_its_session_up_ends_it_and_takes_the_lease_again(
    make_settings: SettingsFactory, caplog: pytest.LogCaptureFixture,
) -> None:
    settings = make_settings()
    lease, other = Lease(settings, "outbox"), Lease(settings, "outbox-other")
    try:
        assert lease.take(force=True)
        orphan = lease.connection()
        lease._db._conn = None  # given up client-side; the server still runs the session
        lease.lost()
        assert not other.take(force=True)  # the orphaned session still holds the lock

        with caplog.at_level(logging.WARNING):
            assert lease.take(force=True)

        assert lease.held
        assert "outbox-former-session-ended" in [r.getMessage() for r in caplog.records]
        with pytest.raises(psycopg.OperationalError):
            orphan.execute("SELECT 1")
        assert not other.take(force=True)  # held again, by the new session
    finally:
        lease.close()
        other.close()


def test_another_processs_session_is_never_ended(
    make_settings: SettingsFactory, db: psycopg.Connection[Any],
) -> None:
    settings = make_settings()
    lease, other = Lease(settings, "outbox"), Lease(settings, "outbox-other")
    try:
        assert lease.take(force=True)
        former = lease.connection().info.backend_pid
        lease.lost()  # its session ends with the connection
        wait_until(lambda: db.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s",
                                      (former,)).fetchone() == (0,), 30, "the session to end")
        assert other.take(force=True)

        assert not lease.take(force=True)  # the lock is another's: left alone

        assert other.held
        other.confirm()  # its session still answers
    finally:
        lease.close()
        other.close()
