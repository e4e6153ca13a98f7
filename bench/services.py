"""The Kafka broker and PostgreSQL server of a benchmark run, and its databases and topics.

Own services (default): a fresh ``KafkaBroker`` and ``PostgresServer`` in a temporary run dir,
stopped and removed at the end; PostgreSQL runs with ``fsync=on`` (the dev server's default is
off), checked at start. ``--external``: the servers named by
``USER_ACTIVITY_KAFKA_BOOTSTRAP_SERVERS`` / ``USER_ACTIVITY_DATABASE_URL``; the DSN's role must be
allowed to create databases (the benchmark creates ``bench_<run>_*`` databases on that server and
drops them at the end).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
from psycopg import sql

from bench.wal import lsn_text, wal_composition, wal_lsn
from cli.topics import ensure_topics
from runtime.settings import Settings

# fsync ON (the dev server's default is off): the naive consumer's one commit per message and
# the WAL figures are only meaningful when every commit is flushed to disk.
POSTGRES_SETTINGS = {"fsync": "on"}


def server_durability(conn: psycopg.Connection[Any], *extra: str) -> dict[str, str]:
    """The server's ``fsync``, ``synchronous_commit`` and ``extra`` settings."""
    found: dict[str, str] = {}
    for name in ("fsync", "synchronous_commit", *extra):
        row = conn.execute(sql.SQL("SHOW {}").format(sql.Identifier(name))).fetchone()
        found[name] = str(row[0]) if row else ""
    return found


def database_url(url: str, name: str) -> str:
    """``url`` with its database name replaced by ``name``."""
    parts = urlsplit(url)
    if parts.scheme not in ("postgresql", "postgres"):
        raise ValueError(f"a postgresql:// URL is needed, got scheme {parts.scheme!r}")
    return urlunsplit(parts._replace(path="/" + name))


def listening_pid(port: int) -> int | None:
    """The process of this machine listening on TCP ``port`` (None if none, or not visible)."""
    sockets = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    sockets.add(f"socket:[{fields[9]}]")
    for entry in sorted((p for p in Path("/proc").iterdir() if p.name.isdigit()),
                        key=lambda p: int(p.name)) if sockets else ():
        with contextlib.suppress(OSError):
            if any(os.readlink(fd) in sockets for fd in (entry / "fd").iterdir()):
                return int(entry.name)
    return None


class Services:
    """Kafka + PostgreSQL for one run; ``close()`` leaves nothing running."""

    def __init__(self, external: bool, run_id: str,
                 pg_settings: dict[str, str] | None = None) -> None:
        self.external = external
        self.pg_settings = dict(pg_settings or {})  # on top of POSTGRES_SETTINGS (own server)
        self.run_id = run_id
        self.run_dir = Path(tempfile.mkdtemp(prefix=f"bench-{run_id}-"))
        self._broker: Any = None
        self._postgres: Any = None
        self._databases: list[str] = []
        self.bootstrap = ""
        self.server_url = ""  # a URL to some database of the server (for CREATE DATABASE)
        self.kafka_pid: int | None = None
        self.postmaster_pid: int | None = None

    def start(self) -> dict[str, float]:
        """Start (or connect to) the services; return how long each took."""
        timings: dict[str, float] = {}
        if self.external:
            self.bootstrap = os.environ["USER_ACTIVITY_KAFKA_BOOTSTRAP_SERVERS"]
            self.server_url = os.environ["USER_ACTIVITY_DATABASE_URL"]
            # on this machine: the processes listening there, for their CPU seconds
            self.kafka_pid = listening_pid(int(self.bootstrap.split(",")[0].rsplit(":", 1)[1]))
            self.postmaster_pid = listening_pid(urlsplit(self.server_url).port or 5432)
            return timings
        from devenv.kafka_broker import KafkaBroker
        from devenv.postgres_server import PostgresServer

        t0 = time.monotonic()
        self._postgres = PostgresServer(self.run_dir / "postgres",
                                        settings={**POSTGRES_SETTINGS, **self.pg_settings})
        self._postgres.start()
        self.server_url = self._postgres.dsn("postgres")
        self.postmaster_pid = self._postgres.pid
        timings["postgres_start_s"] = time.monotonic() - t0
        if self.durability()["fsync"] != "on":
            raise RuntimeError("the benchmark's PostgreSQL must run with fsync=on")
        t0 = time.monotonic()
        self._broker = KafkaBroker(self.run_dir / "kafka")
        self.bootstrap = self._broker.start()
        self.kafka_pid = self._broker.pid
        timings["kafka_start_s"] = time.monotonic() - t0
        return timings

    def durability(self) -> dict[str, str]:
        """``fsync``, ``synchronous_commit`` and each ``--pg-setting``, as the server says.

        Recorded with every run (``meta.postgres``).
        """
        with self._admin() as conn:
            return server_durability(conn, *self.pg_settings)

    def db_name(self, suffix: str) -> str:
        """The name of this run's database ``suffix``."""
        return f"bench_{self.run_id}_{suffix}"

    def _admin(self) -> psycopg.Connection[Any]:
        return psycopg.connect(self.server_url, autocommit=True)

    def create_database(self, suffix: str, template: str | None = None) -> str:
        """Create this run's database ``suffix`` (a copy of ``template`` if given); its URL."""
        name = self.db_name(suffix)
        create = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
        with self._admin() as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                sql.Identifier(name)))
            if template is None:
                conn.execute(create)
            else:
                copy = create + sql.SQL(" TEMPLATE {}").format(
                    sql.Identifier(self.db_name(template)))
                try:
                    conn.execute(copy + sql.SQL(" STRATEGY FILE_COPY"))
                except psycopg.errors.SyntaxError:  # before PostgreSQL 15: no STRATEGY
                    conn.execute(copy)
        self._databases.append(name)
        return database_url(self.server_url, name)

    def drop_database(self, suffix: str) -> None:
        """Drop this run's database ``suffix`` (disconnecting its sessions)."""
        name = self.db_name(suffix)
        with contextlib.suppress(psycopg.Error), self._admin() as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                sql.Identifier(name)))
        if name in self._databases:
            self._databases.remove(name)

    def settings(self, prefix: str, db_url: str, **overrides: Any) -> Settings:
        """Settings whose topics are ``bench.<run>.<prefix>.*`` (the favorites ones created)."""
        base = f"bench.{self.run_id}.{prefix}"
        names = {f"topic_{n.replace('-', '_')}": f"{base}.{n}" for n in (
            "favorite-added", "favorite-removed", "action-tracked", "favorites-dlq",
            "user-signed-in", "session-linked", "session-started", "session-ended",
            "session-linking-dlq")}
        settings = Settings(**{"kafka_bootstrap_servers": self.bootstrap, "database_url": db_url,
                               "http_port": 0, **names, **overrides})
        ensure_topics(settings.kafka_client_config(), [
            settings.topic_favorite_added, settings.topic_favorite_removed,
            settings.topic_action_tracked, settings.topic_favorites_dlq], 6)
        return settings

    def counts(self, db_url: str) -> dict[str, int]:
        """Rows of action_events and outbox, and unpublished outbox rows, in ``db_url``."""
        with psycopg.connect(db_url, autocommit=True) as conn:
            row = conn.execute(
                "SELECT (SELECT count(*) FROM user_activity.action_events),"
                " (SELECT count(*) FROM user_activity.outbox),"
                " (SELECT count(*) FROM user_activity.outbox_unpublished)"
            ).fetchone()
        assert row is not None
        return dict(zip(("action_events", "outbox", "outbox_unpublished"), map(int, row),
                        strict=True))

    def wal_position(self, db_url: str) -> tuple[int, str]:
        """The server's WAL insert position, in bytes and as an LSN."""
        with psycopg.connect(db_url, autocommit=True) as conn:
            return wal_lsn(conn), lsn_text(conn)

    def wal_composition(self, db_url: str, start: str, end: str, events: int
                        ) -> dict[str, Any] | None:
        """:func:`bench.wal.wal_composition` of the range, read in ``db_url`` (its relations)."""
        with psycopg.connect(db_url, autocommit=True) as conn:
            return wal_composition(conn, start, end, events)

    def close(self) -> None:
        """Drop this run's databases, stop own services, remove the run dir."""
        for name in list(self._databases):
            self.drop_database(name.removeprefix(f"bench_{self.run_id}_"))
        if self._broker is not None:
            with contextlib.suppress(Exception):
                self._broker.stop()
            self._broker = None
        if self._postgres is not None:
            with contextlib.suppress(Exception):
                self._postgres.close()
            self._postgres = None
        shutil.rmtree(self.run_dir, ignore_errors=True)
