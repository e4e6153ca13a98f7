"""Integration tests of devenv.postgres_server against real PostgreSQL binaries."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

PROJECT_ROOT = Path(__file__).resolve().parents[2]
if str(PROJECT_ROOT) not in sys.path:  # the project is not necessarily pip-installed
    sys.path.insert(0, str(PROJECT_ROOT))

from devenv.postgres_server import (  # noqa: E402
    PostgresNotFoundError,
    PostgresServer,
    PostgresServerError,
    find_bin_dir,
)

pytestmark = pytest.mark.integration


@pytest.fixture
def server(tmp_path: Path) -> Iterator[PostgresServer]:
    with PostgresServer(tmp_path / "pg", startup_timeout=60) as srv:
        yield srv
    assert not srv.is_running()


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs and is not a zombie (PID 1 may reap a detached postmaster late)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def test_start_query_stop_restart_keeps_data(tmp_path: Path) -> None:
    started = time.monotonic()
    srv = PostgresServer(tmp_path / "pg")
    try:
        srv.start()
        print(f"initdb + start + ready: {time.monotonic() - started:.2f}s")
        port = srv.port
        dsn = srv.create_database("user_activity")
        assert dsn == f"postgresql://postgres@127.0.0.1:{port}/user_activity"
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text NOT NULL)")
            conn.execute("INSERT INTO t VALUES (1, 'one'), (2, 'two')")
            row = conn.execute("SELECT current_user, current_database(), 1 + 1").fetchone()
            assert row == ("postgres", "user_activity", 2)

        srv.stop()
        assert not srv.is_running()
        assert srv.pid is None
        with pytest.raises(psycopg.OperationalError):
            psycopg.connect(dsn, connect_timeout=2)

        restarted = time.monotonic()
        srv.start()
        print(f"restart: {time.monotonic() - restarted:.2f}s")
        assert srv.port == port
        with psycopg.connect(dsn) as conn:
            rows = conn.execute("SELECT id, v FROM t ORDER BY id").fetchall()
        assert rows == [(1, "one"), (2, "two")]
    finally:
        srv.close()
    assert not srv.is_running()


def test_stop_drops_live_connections_and_immediate_stop_recovers(
    server: PostgresServer,
) -> None:
    dsn = server.create_database("chaos")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE t (id int)")
        conn.execute("INSERT INTO t VALUES (1)")
    live = psycopg.connect(dsn, autocommit=True)
    try:
        server.stop()  # fast: terminates the open session
        with pytest.raises(psycopg.OperationalError):
            live.execute("SELECT 1")
    finally:
        live.close()
    server.start()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO t VALUES (2)")
    server.stop(mode="immediate")  # crash-like: next start runs WAL recovery
    server.start()
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT count(*) FROM t").fetchone() == (2,)


def test_stop_without_pid_file_still_stops_own_postmaster(server: PostgresServer) -> None:
    pid = server.pid
    assert pid is not None
    (server.data_dir / "postmaster.pid").unlink()  # e.g. data dir removed under a live server
    assert server.pid == pid
    server.stop()
    assert not _alive(pid)
    assert server.pid is None


def test_server_settings(tmp_path: Path) -> None:
    settings: dict[str, str | int | float | bool] = {
        "work_mem": "8MB", "log_min_duration_statement": 250, "jit": False,
    }
    with PostgresServer(tmp_path / "pg", settings=settings) as srv, srv.connect() as conn:

        def show(name: str) -> str:
            row = conn.execute(f"SHOW {name}").fetchone()
            assert row is not None
            return str(row[0])

        assert show("max_connections") == "200"
        assert show("listen_addresses") == "127.0.0.1"
        assert show("work_mem") == "8MB"
        assert show("log_min_duration_statement") == "250ms"
        assert show("jit") == "off"
        # Durability stays at PostgreSQL's defaults.
        assert show("fsync") == "on"
        assert show("synchronous_commit") == "on"
        assert show("full_page_writes") == "on"
        socket_dir = srv.socket_dir
        if socket_dir is not None:
            assert (socket_dir / f".s.PGSQL.{srv.port}").is_socket()
        assert srv.log_path.parent == srv.run_dir
        assert "database system is ready to accept connections" in srv.log_path.read_text()


def test_managed_and_invalid_settings_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="managed"):
        PostgresServer(tmp_path / "a", settings={"port": 1234})
    with pytest.raises(ValueError, match="invalid"):
        PostgresServer(tmp_path / "b", settings={"work_mem; drop": "1"})


def test_create_and_drop_database(server: PostgresServer) -> None:
    server.create_database("Mixed-Case db")
    server.create_database("Mixed-Case db")  # exist_ok by default
    with pytest.raises(PostgresServerError, match="already exists"):
        server.create_database("Mixed-Case db", exist_ok=False)
    with psycopg.connect(server.dsn("Mixed-Case db")) as conn:
        assert conn.execute("SELECT current_database()").fetchone() == ("Mixed-Case db",)
    server.drop_database("Mixed-Case db")
    server.drop_database("Mixed-Case db")  # missing_ok by default
    with server.connect() as conn:
        row = conn.execute("SELECT count(*) FROM pg_database WHERE datname = 'Mixed-Case db'")
        assert row.fetchone() == (0,)


def test_second_object_on_same_run_dir_reuses_port_and_data(tmp_path: Path) -> None:
    run_dir = tmp_path / "pg"
    first = PostgresServer(run_dir)
    try:
        first.start()
        dsn = first.create_database("kept")
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE kept (x int)")
        first.stop()

        second = PostgresServer(run_dir)
        second.start()
        try:
            assert second.port == first.port
            assert second.data_dir == first.data_dir
            with psycopg.connect(second.dsn("kept")) as conn:
                conn.execute("SELECT x FROM kept")
        finally:
            second.stop()
    finally:
        first.close()


def test_temporary_run_dir_is_removed_on_close() -> None:
    with PostgresServer() as srv:
        run_dir, data_dir = srv.run_dir, srv.data_dir
        assert (data_dir / "PG_VERSION").exists()
        assert data_dir.parent == run_dir  # no relocation needed for its own temp dir
    assert not run_dir.exists()
    assert not data_dir.exists()


def test_configured_port_in_use_fails_clearly(tmp_path: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        busy_port = blocker.getsockname()[1]
        srv = PostgresServer(tmp_path / "pg", port=busy_port)
        try:
            with pytest.raises(PostgresServerError, match="Address already in use"):
                srv.start()
        finally:
            srv.close()


def test_missing_binaries_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(PostgresNotFoundError, match="does not contain"):
        find_bin_dir(tmp_path)
    monkeypatch.setenv("POSTGRES_BIN_DIR", str(tmp_path))
    with pytest.raises(PostgresNotFoundError):
        PostgresServer(tmp_path / "pg")


def test_cli_start_status_stop(tmp_path: Path) -> None:
    run_dir = tmp_path / "cli"

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(PROJECT_ROOT), env.get("PYTHONPATH")])
        )
        return subprocess.run(
            [sys.executable, "-m", "devenv.postgres_server", *args, "--run-dir", str(run_dir)],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
            check=False,
        )

    started = cli("start", "--database", "demo")
    try:
        assert started.returncode == 0, started.stderr
        dsn = started.stdout.strip().splitlines()[-1]
        assert dsn.startswith("postgresql://postgres@127.0.0.1:")
        assert dsn.endswith("/demo")
        with psycopg.connect(dsn) as conn:
            assert conn.execute("SELECT current_database()").fetchone() == ("demo",)

        again = cli("start", "--database", "demo")  # idempotent
        assert again.returncode == 0, again.stderr
        assert again.stdout.strip().splitlines()[-1] == dsn

        status = cli("status", "--database", "demo")
        assert status.returncode == 0
        assert status.stdout.strip().splitlines()[-1] == dsn
        pid = int(status.stdout.split("pid ", 1)[1].split(",", 1)[0])
        assert _alive(pid)
    finally:
        stopped = cli("stop")
    assert stopped.returncode == 0, stopped.stderr
    status = cli("status")
    assert status.returncode == 3
    assert status.stdout.strip() == "stopped"
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(dsn, connect_timeout=2)
    assert not _alive(pid)

    # The detached server comes back on the same port with its data.
    restarted = cli("start", "--database", "demo")
    try:
        assert restarted.returncode == 0, restarted.stderr
        assert restarted.stdout.strip().splitlines()[-1] == dsn
    finally:
        assert cli("stop").returncode == 0
        # CLI stop keeps the data; remove it (it may live outside tmp_path when run as root).
        PostgresServer(run_dir).remove_data()
    assert not (run_dir / "state.json").exists()
