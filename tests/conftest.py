"""Session-wide real services: a PostgreSQL cluster and a Kafka broker, started once.

``USER_ACTIVITY_TEST_DATABASE_URL`` / ``USER_ACTIVITY_TEST_KAFKA_BOOTSTRAP_SERVERS`` point the
suite at existing services instead (the DSN's role must be allowed to create a database).
Each test owns its topics (unique names) and its rows (unique ids), so order does not matter.

Property tests draw the same examples on every run (Hypothesis ``derandomize``): the suite is a
gate, and a gate must not pass or fail by the draw. ``HYPOTHESIS_PROFILE=explore`` draws new
examples each run (and keeps failing ones in ``.hypothesis/``) to look for new failures.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from hypothesis import settings as hypothesis_settings
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from cli.migrate import apply_migrations
from cli.topics import ensure_topics
from devenv.harness.jobs import JobSupervisor, supervised_jobs
from runtime.settings import Settings
from tests.support import with_database

pytest_plugins = ("tests.workers",)  # on xdist workers: own ports, longest tests first

# deadline None: a property's examples are timed, and this 2-core machine shared with the
# services makes a slow example a matter of the moment, not of the code
hypothesis_settings.register_profile("suite", derandomize=True, print_blob=True, deadline=None)
hypothesis_settings.register_profile("explore", print_blob=True)
hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "suite"))


@pytest.fixture(scope="session")
def postgres_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The suite's own PostgreSQL server (None when an external one is configured)."""
    if os.environ.get("USER_ACTIVITY_TEST_DATABASE_URL"):
        yield None
        return
    from devenv.postgres_server import PostgresServer

    server = PostgresServer(tmp_path_factory.mktemp("postgres"))
    server.start()
    try:
        yield server
    finally:
        server.close()


def migrated_database(postgres_server: Any, suffix: str = "") -> str:
    """A migrated database on the suite's server, or the external one (``suffix``: one beside it).

    The database is created if missing; its URL.
    """
    external = os.environ.get("USER_ACTIVITY_TEST_DATABASE_URL")
    if not external:
        dsn = str(postgres_server.create_database(f"user_activity_test{suffix}"))
    elif suffix:
        name = f"{conninfo_to_dict(external)['dbname']}{suffix}"
        with psycopg.connect(with_database(external, "postgres"), autocommit=True) as conn:
            if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s",
                                (name,)).fetchone():
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        dsn = with_database(external, name)
    else:
        dsn = external
    apply_migrations(dsn)
    return dsn


@pytest.fixture(scope="session")
def database_template(postgres_server: Any) -> str:
    """A migrated database that nobody uses: each test's database is a copy of it."""
    dsn = migrated_database(postgres_server, "_template")
    with psycopg.connect(with_database(dsn, "postgres"), autocommit=True) as conn:
        conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                     " WHERE datname = %s AND pid <> pg_backend_pid()",
                     (conninfo_to_dict(dsn)["dbname"],))
    return dsn


@pytest.fixture
def database_url(database_template: str) -> Iterator[str]:
    """A migrated database of the test's own, dropped after it.

    Its outbox, watermark and rows are no other test's: a row one test leaves unpublished
    never reaches another's publisher.
    """
    template = str(conninfo_to_dict(database_template)["dbname"])
    name = f"t_{uuid.uuid4().hex[:16]}"
    admin = with_database(database_template, "postgres")
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {} TEMPLATE {} STRATEGY FILE_COPY").format(
            sql.Identifier(name), sql.Identifier(template)))
    try:
        yield with_database(database_template, name)
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                sql.Identifier(name)))


@pytest.fixture(scope="session")
def kafka_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The suite's own Kafka broker (None when an external one is configured)."""
    if os.environ.get("USER_ACTIVITY_TEST_KAFKA_BOOTSTRAP_SERVERS"):
        yield None
        return
    from devenv.kafka_broker import KafkaBroker

    broker = KafkaBroker(tmp_path_factory.mktemp("kafka"))
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture(scope="session")
def kafka_bootstrap(kafka_broker: Any) -> str:
    """The bootstrap address of a real Kafka broker (KRaft, single node)."""
    external = os.environ.get("USER_ACTIVITY_TEST_KAFKA_BOOTSTRAP_SERVERS")
    return external or str(kafka_broker.bootstrap)


@pytest.fixture
def db(database_url: str) -> Iterator[psycopg.Connection[Any]]:
    """An autocommit connection to the test database."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        yield conn


SettingsFactory = Callable[..., Settings]


@pytest.fixture
def make_settings(
    request: pytest.FixtureRequest, database_url: str, kafka_bootstrap: str, tmp_path: Path
) -> SettingsFactory:
    """Settings whose topics belong to this test alone (created with 6 partitions)."""
    slug = re.sub(r"[^a-zA-Z0-9]+", "-", request.node.name)[:60]
    prefix = f"t.{slug}.{uuid.uuid4().hex[:6]}"

    def factory(**overrides: Any) -> Settings:
        values: dict[str, Any] = {
            "kafka_bootstrap_servers": kafka_bootstrap,
            "database_url": database_url,
            "topic_favorite_added": f"{prefix}.favorite-added",
            "topic_favorite_removed": f"{prefix}.favorite-removed",
            "topic_action_tracked": f"{prefix}.action-tracked",
            "topic_favorites_dlq": f"{prefix}.favorites-dlq",
            "topic_user_signed_in": f"{prefix}.user-signed-in",
            "topic_session_linked": f"{prefix}.session-linked",
            "topic_session_started": f"{prefix}.session-started",
            "topic_session_ended": f"{prefix}.session-ended",
            "topic_session_linking_dlq": f"{prefix}.session-linking-dlq",
            "topic_outbox_progress": f"{prefix}.outbox-progress",
            "outbox_transactional_id": f"{prefix}.outbox",
            "tail": False,
            "http_port": 0,
            "retry_initial_seconds": 0.2,
            "retry_max_seconds": 2.0,
            "outbox_idle_poll_seconds": 0.2,
        }
        values.update(overrides)
        settings = Settings(**values)
        ensure_topics(settings.kafka_client_config(), settings.all_topics(), 6)
        return settings

    return factory


@pytest.fixture
def jobs(tmp_path: Path) -> Iterator[JobSupervisor]:
    """Jobs of this test; all of them are killed at the end, and none may be left running."""
    with supervised_jobs(tmp_path) as supervisor:
        yield supervisor
