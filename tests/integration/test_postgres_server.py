"""The contract of devenv.postgres_server, against Debian's PostgreSQL binaries."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psycopg
import pytest

from devenv.harness.jobs import alive
from devenv.postgres_server import PostgresServer

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration


def _port_open(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_start_create_database_idempotent_restart_keeps_dsn(tmp_path: Path) -> None:
    """The server's contract; its start-up time is measured, not asserted.

    ``python -m bench`` records it (``service_start.postgres_start_s`` in bench/results.json);
    a wall-clock bound here failed CI at 2.15 s on a loaded 2-core machine.
    """
    server = PostgresServer(tmp_path / "pg")
    try:
        began = time.monotonic()
        server.start()
        started = time.monotonic() - began
        dsn = server.create_database("Mixed-Case db")
        assert server.create_database("Mixed-Case db") == dsn  # idempotent
        assert dsn == f"postgresql://postgres@127.0.0.1:{server.port}/Mixed-Case%20db"
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE t (id int)")
            conn.execute("INSERT INTO t VALUES (1)")
            assert conn.execute("SHOW listen_addresses").fetchone() == ("127.0.0.1",)
            assert conn.execute("SHOW fsync").fetchone() == ("off",)

        server.stop()
        assert not server.is_running()
        with pytest.raises(psycopg.OperationalError):
            psycopg.connect(dsn, connect_timeout=2)
        began = time.monotonic()
        server.start()
        restarted = time.monotonic() - began
        with psycopg.connect(dsn) as conn:  # the same DSN: same port, same data
            assert conn.execute("SELECT count(*) FROM t").fetchone() == (1,)
        print(f"initdb + start: {started:.2f}s, restart: {restarted:.2f}s")
    finally:
        server.close()


def test_a_new_object_on_the_run_dir_reuses_port_and_data(tmp_path: Path) -> None:
    with PostgresServer(tmp_path / "pg") as first:
        dsn = first.create_database("kept")
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE kept (x int)")
        first.stop()
        second = PostgresServer(tmp_path / "pg")
        second.start()
        assert second.dsn("kept") == dsn
        with psycopg.connect(dsn) as conn:
            conn.execute("SELECT x FROM kept")
        second.stop()


def test_nothing_left_running_after_close(tmp_path: Path) -> None:
    with PostgresServer(tmp_path / "pg") as server:
        pid, port = server.pid, server.port
        assert pid is not None and alive(pid)
    assert not alive(pid)
    assert not _port_open(port)
    assert not server.is_running()


def test_cli_start_status_stop(tmp_path: Path) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "devenv.postgres_server", *args, "--run-dir", str(tmp_path)],
            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
            capture_output=True, text=True, timeout=120, check=False,
        )

    started = cli("start", "--database", "demo")
    try:
        assert started.returncode == 0, started.stderr
        dsn = started.stdout.strip().splitlines()[-1]
        with psycopg.connect(dsn) as conn:  # outlives the CLI process
            assert conn.execute("SELECT current_database()").fetchone() == ("demo",)
        status = cli("status", "--database", "demo")
        assert (status.returncode, status.stdout.strip()) == (0, dsn)
    finally:
        assert cli("stop").returncode == 0
    assert cli("status").returncode == 3
    PostgresServer(tmp_path).close()  # removes the private data dir (root: outside tmp_path)
