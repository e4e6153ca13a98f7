"""A PostgreSQL connection whose server goes silent fails in time, on a real server.

The silence is made with iptables: every packet of that one TCP connection is dropped, as when
the server's host or its address is gone in a failover (no reset, no answer; the statement
timeout is the server's and cannot fire either). Without keepalives and a TCP user timeout the
client would wait about two hours; with ``db_dead_connection_seconds`` it fails in about that
long with an infrastructure error (retried by the caller) and the next connection works. The
same silence seen from the server (the job's node lost): its session ends as fast. Needs
root and iptables (``scripts/bootstrap.sh`` installs it as root); skipped otherwise. A session
the server itself ends on a timeout an operator set is an infrastructure error too.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator

import psycopg
import pytest

from sinks.db import Database
from sinks.errors import is_infrastructure_error
from sinks.outbox import LEASE_KEY
from tests.conftest import SettingsFactory

pytestmark = pytest.mark.integration

DEAD_SECONDS = 6.0
LIVENESS_SECONDS = 10 * DEAD_SECONDS
"""A liveness bound: far above the dead-connection time, far below the OS's two hours."""


def _iptables_usable() -> bool:
    if os.geteuid() != 0 or shutil.which("iptables") is None:
        return False
    listed = subprocess.run(["iptables", "-w", "-L", "OUTPUT", "-n"], capture_output=True,
                            check=False)
    return listed.returncode == 0


@contextlib.contextmanager
def _silenced(local_port: int) -> Iterator[None]:
    """Drop every packet to and from ``local_port`` (one client connection) on this host."""
    rules = [["OUTPUT", "-p", "tcp", "--sport", str(local_port), "-j", "DROP"],
             ["OUTPUT", "-p", "tcp", "--dport", str(local_port), "-j", "DROP"]]
    for rule in rules:
        subprocess.run(["iptables", "-w", "-I", *rule], check=True)
    try:
        yield
    finally:
        for rule in rules:
            subprocess.run(["iptables", "-w", "-D", *rule], check=False)


def _local_port(conn: psycopg.Connection[object]) -> int:
    with socket.fromfd(conn.pgconn.socket, socket.AF_INET, socket.SOCK_STREAM) as sock:
        return int(sock.getsockname()[1])


@pytest.mark.skipif(not _iptables_usable(), reason="needs root and iptables")
@pytest.mark.parametrize("when", ["waiting for an answer", "sending a statement"])
def test_a_connection_to_a_silent_server_fails_in_the_dead_connection_time_then_reconnects(
    make_settings: SettingsFactory, when: str,
) -> None:
    settings = make_settings(db_dead_connection_seconds=DEAD_SECONDS)
    db = Database(settings, "test-dead-connection")
    conn = db.connection()
    outcome: dict[str, object] = {}

    def run(statement: str) -> None:
        started = time.monotonic()
        try:
            conn.execute(statement)
        except psycopg.Error as exc:
            outcome["error"], outcome["after"] = exc, time.monotonic() - started

    with _silenced(_local_port(conn)):
        if when == "waiting for an answer":  # the statement was sent; its answer never comes
            worker = threading.Thread(target=run, args=("SELECT pg_sleep(3)",), daemon=True)
            worker.start()
            time.sleep(0.5)
        else:  # the statement is sent into the silence
            worker = threading.Thread(target=run, args=("SELECT 1",), daemon=True)
            worker.start()
        worker.join(LIVENESS_SECONDS)
        assert not worker.is_alive(), "still waiting on a dead connection"
    error = outcome["error"]
    assert isinstance(error, psycopg.OperationalError) and is_infrastructure_error(error)
    assert float(outcome["after"]) < LIVENESS_SECONDS  # type: ignore[arg-type]
    db.reset()
    assert db.connection().execute("SELECT 1").fetchone() == (1,)
    db.close()


@pytest.mark.skipif(not _iptables_usable(), reason="needs root and iptables")
def test_the_server_ends_the_session_of_a_job_that_vanished_and_frees_the_outbox_lease(
    make_settings: SettingsFactory,
) -> None:
    # A job whose node is lost sends no FIN: its backend would hold the outbox lease (a session
    # advisory lock) and its transaction's locks for the server's OS default of ~2 hours.
    settings = make_settings(db_dead_connection_seconds=DEAD_SECONDS)
    vanishing = Database(settings, "test-vanishing-job")
    conn = vanishing.connection()
    shown = conn.execute(
        "SELECT setting FROM pg_settings WHERE name IN ('tcp_keepalives_idle',"
        " 'tcp_user_timeout', 'statement_timeout', 'jit') ORDER BY name").fetchall()
    assert shown == [("off",), (str(settings.db_statement_timeout_ms),), ("2",), ("6000",)]
    assert conn.execute("SELECT pg_try_advisory_lock(%s)", (LEASE_KEY,)).fetchone() == (True,)
    conn.execute("BEGIN")
    conn.execute("CREATE TEMP TABLE held (x int)")  # an open transaction, locks held
    backend = conn.info.backend_pid
    with psycopg.connect(settings.database_dsn(), autocommit=True) as other, \
            _silenced(_local_port(conn)):
        started = time.monotonic()
        while time.monotonic() - started < LIVENESS_SECONDS:
            gone = other.execute("SELECT count(*) = 0 FROM pg_stat_activity WHERE pid = %s",
                                 (backend,)).fetchone() == (True,)
            if gone:
                break
            time.sleep(0.2)
        after = time.monotonic() - started
        assert gone, f"the vanished job's backend still lives after {after:.0f} s"
        assert other.execute("SELECT pg_try_advisory_lock(%s)", (LEASE_KEY,)).fetchone() == (
            True,)
    vanishing.reset()


def test_a_session_the_server_ends_on_a_transaction_timeout_is_retried_on_a_new_connection(
    make_settings: SettingsFactory,
) -> None:
    """The server ending a session on a timeout is retried, not blamed on the batch.

    ``idle_in_transaction_session_timeout`` (25P03), in the sinks' ``conn.transaction()``
    pattern: what psycopg raises is an infrastructure error (retried, never dead-lettered; it
    was classified as neither, so a batch was isolated and its good messages dead-lettered),
    and the step's next connection works. PostgreSQL 17's ``transaction_timeout`` (25P04) ends
    the session the same way (``tests/unit/test_error_classification.py``).
    """
    db = Database(make_settings(), "test-session-timeout")
    conn = db.connection()
    first_pid = conn.info.backend_pid
    conn.execute("SET idle_in_transaction_session_timeout = '200ms'")
    with pytest.raises(psycopg.Error) as raised, conn.transaction():
        conn.execute("SELECT 1")
        time.sleep(1.0)  # idle in the transaction: the server ends the session
        conn.execute("SELECT 1")
    assert is_infrastructure_error(raised.value), type(raised.value)
    again = db.connection()
    assert again.info.backend_pid != first_pid
    assert again.execute("SELECT 1").fetchone() == (1,)
    db.close()
