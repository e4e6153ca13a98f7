"""All migrations on an empty database, then every constraint proven by trying to break it."""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import psycopg.errors
import pytest
from psycopg.conninfo import conninfo_to_dict

from cli.migrate import MIGRATIONS_DIR, apply_migrations
from devenv.harness.env import base_env
from devenv.harness.jobs import ROOT
from tests.support import scratch_database

pytestmark = pytest.mark.integration


def _apply_first(dsn: str, tmp_path: Path, count: int) -> list[str]:
    """Apply only the first ``count`` migrations to ``dsn``; the names of the later ones."""
    first = tmp_path / "first"
    first.mkdir()
    paths = sorted(MIGRATIONS_DIR.glob("*.sql"))
    for path in paths[:count]:
        shutil.copy(path, first)
    assert len(apply_migrations(dsn, first)) == count
    return [path.stem for path in paths[count:]]


@pytest.fixture(scope="module")
def empty_database(database_template: str) -> Iterator[str]:
    """A brand-new database on the suite's server, dropped afterwards."""
    with scratch_database(database_template, "migrations") as dsn:
        yield dsn


@pytest.fixture(scope="module")
def migrated(empty_database: str) -> str:
    applied = apply_migrations(empty_database)
    assert applied == sorted(p.stem for p in MIGRATIONS_DIR.glob("*.sql"))
    return empty_database


@pytest.fixture
def conn(migrated: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(migrated, autocommit=True) as connection:
        yield connection


def _session(conn: psycopg.Connection[Any], **overrides: Any) -> uuid.UUID:
    now = datetime.now(UTC)
    row: dict[str, Any] = {
        "id": uuid.uuid4(), "anonymous_id": uuid.uuid4(), "user_id": None, "linked_at": None,
        "status": "Active", "started_at": now, "last_activity_at": now, "ended_at": None,
    }
    row.update(overrides)
    conn.execute(
        """INSERT INTO user_activity.sessions
             (id, anonymous_id, user_id, linked_at, status, started_at, last_activity_at, ended_at)
           VALUES (%(id)s, %(anonymous_id)s, %(user_id)s, %(linked_at)s, %(status)s,
                   %(started_at)s, %(last_activity_at)s, %(ended_at)s)""",
        row,
    )
    return uuid.UUID(str(row["id"]))


def _action(conn: psycopg.Connection[Any], session: uuid.UUID, source: uuid.UUID) -> uuid.UUID:
    action_id = uuid.uuid4()
    conn.execute(
        """INSERT INTO user_activity.action_events
             (id, action_type, session_id, anonymous_id, user_id, occurred_at,
              property_object_id, favorite_id, source_message_id)
           VALUES (%s, 'AddToFavorites', %s, %s, NULL, now(), %s, %s, %s)""",
        (action_id, session, uuid.uuid4(), uuid.uuid4(), uuid.uuid4(), source),
    )
    return action_id


def test_applying_the_migrations_again_changes_nothing(migrated: str) -> None:
    assert apply_migrations(migrated) == []


def test_the_schema_has_every_table_the_spec_names(conn: psycopg.Connection[Any]) -> None:
    rows = conn.execute(
        "SELECT table_name FROM information_schema.tables WHERE table_schema = 'user_activity'"
    ).fetchall()

    assert {r[0] for r in rows} >= {
        "sessions", "action_events", "consumer_idempotency_marks", "outbox",
        "user_action_history", "outbox_parked", "outbox_watermark", "outbox_unpublished",
    }


def test_a_user_without_linked_at_is_rejected(conn: psycopg.Connection[Any]) -> None:
    with pytest.raises(psycopg.errors.CheckViolation, match="chk_sessions_link_pair"):
        _session(conn, user_id=uuid.uuid4(), linked_at=None)


def test_linked_at_without_a_user_is_rejected(conn: psycopg.Connection[Any]) -> None:
    with pytest.raises(psycopg.errors.CheckViolation, match="chk_sessions_link_pair"):
        _session(conn, user_id=None, linked_at=datetime.now(UTC))


def test_a_second_active_session_for_one_device_is_rejected(
    conn: psycopg.Connection[Any],
) -> None:
    device = uuid.uuid4()
    _session(conn, anonymous_id=device)
    _session(conn, anonymous_id=device, status="Ended", ended_at=datetime.now(UTC))

    with pytest.raises(psycopg.errors.UniqueViolation, match="ux_sessions_active_anonymous"):
        _session(conn, anonymous_id=device)


def test_update_and_delete_of_action_events_are_refused_by_the_database(
    conn: psycopg.Connection[Any],
) -> None:
    action = _action(conn, _session(conn), uuid.uuid4())

    with pytest.raises(psycopg.errors.RestrictViolation, match="immutable"):
        conn.execute(
            "UPDATE user_activity.action_events SET user_id = %s WHERE id = %s",
            (uuid.uuid4(), action),
        )
    with pytest.raises(psycopg.errors.RestrictViolation, match="immutable"):
        conn.execute("DELETE FROM user_activity.action_events WHERE id = %s", (action,))
    with pytest.raises(psycopg.errors.RestrictViolation, match="immutable"):
        conn.execute("TRUNCATE user_activity.action_events CASCADE")
    assert conn.execute(
        "SELECT count(*) FROM user_activity.action_events WHERE id = %s", (action,)
    ).fetchone() == (1,)


def test_a_duplicate_source_message_id_is_rejected(conn: psycopg.Connection[Any]) -> None:
    session, source = _session(conn), uuid.uuid4()
    _action(conn, session, source)

    with pytest.raises(psycopg.errors.UniqueViolation, match="ux_action_events_source_message"):
        _action(conn, session, source)


def test_a_duplicate_idempotency_key_is_rejected(conn: psycopg.Connection[Any]) -> None:
    key = f"user-activity-favorites:AddToFavorites:{uuid.uuid4()}"
    conn.execute("INSERT INTO user_activity.consumer_idempotency_marks (key) VALUES (%s)", (key,))

    with pytest.raises(psycopg.errors.UniqueViolation):
        conn.execute(
            "INSERT INTO user_activity.consumer_idempotency_marks (key) VALUES (%s)", (key,)
        )


def _parked_row(conn: psycopg.Connection[Any], **columns: Any) -> None:
    values = {"id": uuid.uuid4(), "topic": "t", "value": b"{}", "created_at": datetime.now(UTC),
              "attempts": 1, "last_error": "MSG_SIZE_TOO_LARGE", **columns}
    names = ", ".join(values)
    placeholders = ", ".join(f"%({name})s" for name in values)
    conn.execute(f"INSERT INTO user_activity.outbox_parked ({names}) VALUES ({placeholders})",
                 values)


def test_a_parked_outbox_row_keeps_its_error_and_attempts(conn: psycopg.Connection[Any]) -> None:
    _parked_row(conn, attempts=2)
    found = conn.execute(
        "SELECT attempts, last_error FROM user_activity.outbox_parked WHERE attempts = 2"
    ).fetchone()
    assert found == (2, "MSG_SIZE_TOO_LARGE")


@pytest.mark.parametrize("columns", [
    {"attempts": 0},  # parked without an attempt
    {"requeued_at": datetime.now(UTC), "published_at": datetime.now(UTC)},  # both at once
], ids=["no-attempt", "requeued-and-published"])
def test_an_inconsistent_parked_outbox_row_is_rejected(
    conn: psycopg.Connection[Any], columns: dict[str, Any]
) -> None:
    with pytest.raises(psycopg.errors.CheckViolation):
        _parked_row(conn, **columns)


def test_a_parked_outbox_row_without_its_error_is_rejected(
    conn: psycopg.Connection[Any],
) -> None:
    with pytest.raises(psycopg.errors.NotNullViolation):
        _parked_row(conn, last_error=None)


def test_a_second_watermark_row_is_rejected(conn: psycopg.Connection[Any]) -> None:
    with pytest.raises(psycopg.errors.CheckViolation):
        conn.execute("INSERT INTO user_activity.outbox_watermark (id, delivered)"
                     " VALUES (2, '3:3:')")


def test_a_row_whose_day_has_no_partition_is_still_written(
    conn: psycopg.Connection[Any],
) -> None:
    conn.execute("INSERT INTO user_activity.consumer_idempotency_marks (key, processed_on)"
                 " VALUES ('far-future', '2999-01-01')")
    conn.execute("INSERT INTO user_activity.outbox (id, topic, value, created_at)"
                 " VALUES (gen_random_uuid(), 'far-future', '\\x00', '2999-01-01')")

    marks = conn.execute("SELECT tableoid::regclass::text FROM user_activity."
                         "consumer_idempotency_marks WHERE key = 'far-future'").fetchone()
    outbox = conn.execute("SELECT tableoid::regclass::text FROM user_activity.outbox"
                          " WHERE topic = 'far-future'").fetchone()
    assert marks == ("user_activity.consumer_idempotency_marks_default",)
    assert outbox == ("user_activity.outbox_default",)


def test_an_action_must_reference_an_existing_session(conn: psycopg.Connection[Any]) -> None:
    with pytest.raises(psycopg.errors.ForeignKeyViolation):
        _action(conn, uuid.uuid4(), uuid.uuid4())


def test_one_action_naming_a_missing_session_fails_its_whole_statement(
    conn: psycopg.Connection[Any],
) -> None:
    session, missing = _session(conn), uuid.uuid4()

    with pytest.raises(psycopg.errors.ForeignKeyViolation, match="does not exist"):
        conn.execute(
            """INSERT INTO user_activity.action_events
                 (id, action_type, session_id, anonymous_id, occurred_at, property_object_id,
                  favorite_id, source_message_id)
               SELECT gen_random_uuid(), 'AddToFavorites', s, gen_random_uuid(), now(),
                      gen_random_uuid(), gen_random_uuid(), gen_random_uuid()
                 FROM unnest(%s::uuid[]) AS s""",
            ([session, missing, session],),
        )
    assert conn.execute("SELECT count(*) FROM user_activity.action_events WHERE session_id = %s",
                        (session,)).fetchone() == (0,)


def test_a_session_with_actions_cannot_be_deleted_renumbered_or_truncated(
    conn: psycopg.Connection[Any],
) -> None:
    session = _session(conn)
    _action(conn, session, uuid.uuid4())

    with pytest.raises(psycopg.errors.ForeignKeyViolation, match="DELETE refused"):
        conn.execute("DELETE FROM user_activity.sessions WHERE id = %s", (session,))
    with pytest.raises(psycopg.errors.ForeignKeyViolation, match="UPDATE refused"):
        conn.execute("UPDATE user_activity.sessions SET id = %s WHERE id = %s",
                     (uuid.uuid4(), session))
    with pytest.raises(psycopg.errors.ForeignKeyViolation, match="TRUNCATE refused"):
        conn.execute("TRUNCATE user_activity.sessions")
    assert conn.execute("SELECT count(*) FROM user_activity.sessions WHERE id = %s",
                        (session,)).fetchone() == (1,)


def test_a_session_without_actions_can_be_renumbered_and_deleted_and_others_updated(
    conn: psycopg.Connection[Any],
) -> None:
    lone, busy, renumbered = _session(conn), _session(conn), uuid.uuid4()
    _action(conn, busy, uuid.uuid4())

    conn.execute("UPDATE user_activity.sessions SET last_activity_at = now() WHERE id = %s",
                 (busy,))
    conn.execute("UPDATE user_activity.sessions SET id = %s WHERE id = %s", (renumbered, lone))
    found = conn.execute("SELECT count(*) FROM user_activity.sessions WHERE id = %s",
                         (renumbered,)).fetchone()
    conn.execute("DELETE FROM user_activity.sessions WHERE id = %s", (renumbered,))

    assert found == (1,)
    assert conn.execute("SELECT count(*) FROM user_activity.sessions WHERE id = ANY(%s)",
                        ([lone, renumbered],)).fetchone() == (0,)


def test_deleting_a_session_waits_for_an_open_insert_of_its_action_and_then_is_refused(
    migrated: str,
) -> None:
    with psycopg.connect(migrated, autocommit=True) as setup:
        session = _session(setup)
    outcome: list[BaseException | None] = []

    def delete() -> None:
        with psycopg.connect(migrated, autocommit=True) as deleter:
            try:
                deleter.execute("DELETE FROM user_activity.sessions WHERE id = %s", (session,))
                outcome.append(None)
            except psycopg.Error as exc:
                outcome.append(exc)

    with psycopg.connect(migrated) as writer:
        _action(writer, session, uuid.uuid4())  # inserted, not yet committed
        deleting = threading.Thread(target=delete)
        deleting.start()
        deleting.join(0.5)
        waited = deleting.is_alive()
        writer.commit()
    deleting.join(10)

    assert waited  # the DELETE waited for the inserting transaction
    assert len(outcome) == 1
    assert isinstance(outcome[0], psycopg.errors.ForeignKeyViolation)


def test_user_history_shows_actions_of_sessions_linked_later(
    conn: psycopg.Connection[Any],
) -> None:
    user = uuid.uuid4()
    session = _session(conn)
    action = _action(conn, session, uuid.uuid4())
    before = conn.execute(
        "SELECT id FROM user_activity.user_action_history WHERE history_user_id = %s", (user,)
    ).fetchall()

    conn.execute(
        "UPDATE user_activity.sessions SET user_id = %s, linked_at = now() WHERE id = %s",
        (user, session),
    )

    assert before == []
    assert conn.execute(
        "SELECT id FROM user_activity.user_action_history WHERE history_user_id = %s", (user,)
    ).fetchall() == [(action,)]


def test_the_dsn_helper_keeps_the_server_and_changes_only_the_database(
    empty_database: str, database_url: str
) -> None:
    assert conninfo_to_dict(empty_database)["port"] == conninfo_to_dict(database_url)["port"]


def test_a_sign_in_time_on_a_guest_session_is_rejected(conn: psycopg.Connection[Any]) -> None:
    session = _session(conn)
    with pytest.raises(psycopg.errors.CheckViolation, match="chk_sessions_sign_in_needs_user"):
        conn.execute(
            "UPDATE user_activity.sessions SET last_signed_in_at = now() WHERE id = %s",
            (session,),
        )


def _conflict(conn: psycopg.Connection[Any], **columns: Any) -> None:
    now = datetime.now(UTC)
    values = {
        "message_id": uuid.uuid4(), "anonymous_id": uuid.uuid4(), "session_id": uuid.uuid4(),
        "session_user_id": uuid.uuid4(), "sign_in_user_id": uuid.uuid4(),
        "signed_in_at": now, "device_last_signed_in_at": now + timedelta(seconds=1),
        "reason": "would-relink", **columns,
    }
    names = ", ".join(values)
    placeholders = ", ".join(f"%({name})s" for name in values)
    conn.execute(
        f"INSERT INTO user_activity.sign_in_conflicts ({names}) VALUES ({placeholders})", values
    )


def test_a_late_conflict_is_recorded_once_per_sign_in(conn: psycopg.Connection[Any]) -> None:
    message_id = uuid.uuid4()
    _conflict(conn, message_id=message_id)
    with pytest.raises(psycopg.errors.UniqueViolation):
        _conflict(conn, message_id=message_id)


def test_a_would_start_conflict_names_no_session(conn: psycopg.Connection[Any]) -> None:
    message_id = uuid.uuid4()

    _conflict(conn, message_id=message_id, reason="would-start", session_id=None,
              session_user_id=None)

    row = conn.execute("SELECT reason FROM user_activity.sign_in_conflicts WHERE message_id = %s",
                       (message_id,)).fetchone()
    assert row == ("would-start",)


@pytest.mark.parametrize("columns", [
    {"signed_in_at": datetime(2026, 1, 2, tzinfo=UTC),
     "device_last_signed_in_at": datetime(2026, 1, 1, tzinfo=UTC)},  # not late
    {"reason": "because"},
], ids=["not-late", "unknown-reason"])
def test_an_inconsistent_late_conflict_is_rejected(
    conn: psycopg.Connection[Any], columns: dict[str, Any]
) -> None:
    with pytest.raises(psycopg.errors.CheckViolation):
        _conflict(conn, **columns)


def test_the_later_migrations_apply_on_a_database_holding_data_from_0001(
    database_url: str, tmp_path: Path
) -> None:
    with scratch_database(database_url, "migrations") as dsn:
        remaining = _apply_first(dsn, tmp_path, 1)
        with psycopg.connect(dsn, autocommit=True) as conn:
            session = _session(conn, user_id=uuid.uuid4(), linked_at=datetime.now(UTC))
            action = _action(conn, session, uuid.uuid4())
            conn.execute(
                "INSERT INTO user_activity.outbox (id, topic, value) VALUES (%s, 't', %s)",
                (uuid.uuid4(), b"{}"),
            )

        later = apply_migrations(dsn)

        assert later == remaining
        assert apply_migrations(dsn) == []  # idempotent
        with psycopg.connect(dsn, autocommit=True) as conn:
            assert conn.execute("SELECT last_signed_in_at FROM user_activity.sessions"
                                " WHERE id = %s", (session,)).fetchone() == (None,)
            assert conn.execute("SELECT count(*) FROM user_activity.action_events"
                                " WHERE id = %s", (action,)).fetchone() == (1,)
            assert conn.execute("SELECT topic FROM user_activity.outbox_unpublished"
                                ).fetchall() == [("t",)]


def test_0006_converts_a_database_holding_data_from_0001_to_0005(
    database_url: str, tmp_path: Path
) -> None:
    with scratch_database(database_url, "migrations") as dsn:
        later = _apply_first(dsn, tmp_path, 5)
        waiting, published, parked = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("INSERT INTO user_activity.consumer_idempotency_marks (key, processed_at)"
                         " VALUES ('old-mark', now() - interval '3 days'), ('new-mark', now())")
            conn.execute(
                """INSERT INTO user_activity.outbox
                     (id, topic, value, published_at, parked_at, attempts, last_error)
                   VALUES (%s, 'waiting', 'w', NULL, NULL, 0, NULL),
                          (%s, 'published', 'p', now(), NULL, 0, NULL),
                          (%s, 'parked', 'x', NULL, now(), 2, 'MSG_SIZE_TOO_LARGE')""",
                (waiting, published, parked),
            )

        assert later[0] == "0006_outbox_watermark_and_daily_partitions"  # and what follows
        assert apply_migrations(dsn) == later
        assert apply_migrations(dsn) == []

        with psycopg.connect(dsn, autocommit=True) as conn:
            marks = conn.execute("SELECT key FROM user_activity.consumer_idempotency_marks"
                                 " ORDER BY key").fetchall()
            assert marks == [("new-mark",), ("old-mark",)]  # kept, in the attached partition
            again = conn.execute(
                "INSERT INTO user_activity.consumer_idempotency_marks (key)"
                " VALUES ('old-mark') ON CONFLICT (key, processed_on) DO NOTHING RETURNING key"
            ).fetchall()
            assert again == []  # a redelivery on the migration day is still a no-op
            assert conn.execute("SELECT id FROM user_activity.outbox").fetchall() == [(waiting,)]
            assert conn.execute("SELECT id FROM user_activity.outbox_unpublished"
                                ).fetchall() == [(waiting,)]
            assert conn.execute(
                "SELECT id, attempts, last_error, requeued_at FROM user_activity.outbox_parked"
            ).fetchall() == [(parked, 2, "MSG_SIZE_TOO_LARGE", None)]
            assert conn.execute("SELECT to_regclass('user_activity.outbox_upto_migration')"
                                ).fetchone() == (None,)


def test_0007_converts_a_database_holding_data_from_0001_to_0006(
    database_url: str, tmp_path: Path
) -> None:
    with scratch_database(database_url, "migrations") as dsn:
        later = _apply_first(dsn, tmp_path, 6)
        with psycopg.connect(dsn, autocommit=True) as conn:
            session, lone = _session(conn), _session(conn)
            action = _action(conn, session, uuid.uuid4())
            conn.execute("INSERT INTO user_activity.consumer_idempotency_marks (key)"
                         " VALUES ('a-mark')")

        assert later[0] == "0007_action_event_session_check_per_statement"  # and what follows
        assert apply_migrations(dsn) == later
        assert apply_migrations(dsn) == []

        with psycopg.connect(dsn, autocommit=True) as conn:
            assert conn.execute("SELECT id, session_id FROM user_activity.action_events"
                                ).fetchall() == [(action, session)]
            assert conn.execute(
                "SELECT count(*) FROM pg_constraint WHERE contype = 'f'"
                " AND conrelid = 'user_activity.action_events'::regclass").fetchone() == (0,)
            with pytest.raises(psycopg.errors.ForeignKeyViolation):
                _action(conn, uuid.uuid4(), uuid.uuid4())
            with pytest.raises(psycopg.errors.ForeignKeyViolation):
                conn.execute("DELETE FROM user_activity.sessions WHERE id = %s", (session,))
            conn.execute("DELETE FROM user_activity.sessions WHERE id = %s", (lone,))
            _action(conn, session, uuid.uuid4())
            assert conn.execute("SELECT count(*) FROM user_activity.action_events"
                                ).fetchone() == (2,)
            assert conn.execute("SELECT key FROM user_activity.consumer_idempotency_marks"
                                ).fetchall() == [("a-mark",)]


def test_0008_keeps_stored_outbox_rows_and_takes_thin_ones(
    database_url: str, tmp_path: Path
) -> None:
    with scratch_database(database_url, "migrations") as dsn:
        later = _apply_first(dsn, tmp_path, 7)
        stored = uuid.uuid4()
        with psycopg.connect(dsn, autocommit=True) as conn:
            session = _session(conn)
            action = _action(conn, session, uuid.uuid4())
            conn.execute("INSERT INTO user_activity.outbox (id, topic, key, value)"
                         " VALUES (%s, 't', 'k', 'v')", (stored,))

        assert later[0] == "0008_thin_action_tracked_outbox_rows"  # and what follows
        assert apply_migrations(dsn) == later
        assert apply_migrations(dsn) == []

        with psycopg.connect(dsn, autocommit=True) as conn:
            assert conn.execute(
                "SELECT id, key, value, action_event_id FROM user_activity.outbox").fetchall() == [
                (stored, b"k", b"v", None)]
            thin = uuid.uuid4()
            conn.execute("INSERT INTO user_activity.outbox"
                         " (id, topic, action_event_id, correlation_id, occurred_offset)"
                         " VALUES (%s, 't', %s, 'c', 10800)", (thin, action))
            assert conn.execute("SELECT count(*) FROM user_activity.outbox_unpublished"
                                ).fetchone() == (2,)
            for columns, values in [
                ("value, action_event_id, occurred_offset", "'v', %s, 0"),  # both
                ("key, action_event_id, occurred_offset", "'k', %s, 0"),  # a key, no value
                ("action_event_id", "%s"),  # no offset
                ("action_event_id, occurred_offset", "%s, 86400"),  # not an offset
            ]:
                with pytest.raises(psycopg.errors.CheckViolation):
                    conn.execute(f"INSERT INTO user_activity.outbox (id, topic, {columns})"
                                 f" VALUES (gen_random_uuid(), 't', {values})", (action,))
            with pytest.raises(psycopg.errors.CheckViolation):
                conn.execute("INSERT INTO user_activity.outbox (id, topic)"
                             " VALUES (gen_random_uuid(), 't')")  # neither


def test_0010_makes_every_stored_sign_in_time_readable_and_refuses_unreadable_ones(
    database_url: str, tmp_path: Path
) -> None:
    with scratch_database(database_url, "migrations") as dsn:
        later = _apply_first(dsn, tmp_path, 9)
        now = datetime.now(UTC)
        with psycopg.connect(dsn, autocommit=True) as conn:
            bc, recent = (_session(conn, user_id=uuid.uuid4(), linked_at=now) for _ in range(2))
            for session, moment in ((bc, "0001-01-01 00:00:00+03"), (recent, now)):
                conn.execute("UPDATE user_activity.sessions SET last_signed_in_at = %s"
                             " WHERE id = %s", (moment, session))

        assert later[0] == "0010_sign_in_times_python_can_read"
        assert apply_migrations(dsn) == later

        with psycopg.connect(dsn, autocommit=True) as conn:
            assert conn.execute(
                "SELECT id, last_signed_in_at FROM user_activity.sessions ORDER BY 2").fetchall(
            ) == [(bc, datetime(1, 1, 1, tzinfo=UTC)), (recent, now)]
            with pytest.raises(psycopg.errors.CheckViolation,
                               match="chk_sessions_last_signed_in_at_readable"):
                conn.execute("UPDATE user_activity.sessions SET last_signed_in_at ="
                             " '0001-01-01 00:00:00+03' WHERE id = %s", (recent,))


_SESSION_INDEXES = """
SELECT indexname, indexdef FROM pg_indexes
 WHERE schemaname = 'user_activity' AND tablename = 'sessions' ORDER BY indexname
"""


def test_0011_replaces_the_session_lookup_indexes_also_after_a_half_done_run(
    database_url: str, tmp_path: Path
) -> None:
    """A run of 0011 that stopped half way is completed by the next one.

    0011 runs outside a transaction (CREATE INDEX CONCURRENTLY): a run that stopped half way
    leaves some indexes built (or one invalid) and the migration unrecorded.
    """
    with scratch_database(database_url, "migrations") as dsn:
        later = _apply_first(dsn, tmp_path, 10)
        with psycopg.connect(dsn, autocommit=True) as conn:
            session = _session(conn, user_id=uuid.uuid4(), linked_at=datetime.now(UTC))
            # what a run stopped half way leaves: one index built, one not finished (an invalid
            # index is dropped and built again the same way)
            conn.execute("CREATE INDEX ix_sessions_user_active_latest ON user_activity.sessions"
                         " (user_id, last_activity_at DESC, id DESC) WHERE status = 'Active'")
            conn.execute("CREATE INDEX ix_sessions_anonymous_latest ON user_activity.sessions"
                         " (anonymous_id)")

        assert later[0] == "0011_session_lookups_read_one_entry"
        assert apply_migrations(dsn) == later

        with psycopg.connect(dsn, autocommit=True) as conn:
            indexes: dict[str, str] = dict(conn.execute(_SESSION_INDEXES).fetchall())
            assert conn.execute("SELECT count(*) FROM user_activity.sessions WHERE id = %s",
                                (session,)).fetchone() == (1,)
        assert sorted(indexes) == [
            "ix_sessions_anonymous_latest", "ix_sessions_anonymous_started",
            "ix_sessions_device_last_sign_in", "ix_sessions_user_active_latest",
            "ix_sessions_user_latest", "ix_sessions_user_started", "sessions_pkey",
            "ux_sessions_active_anonymous",
        ]
        assert indexes["ix_sessions_anonymous_latest"].endswith(
            "(anonymous_id, last_activity_at DESC, id DESC)")
        assert indexes["ix_sessions_device_last_sign_in"].endswith(
            "(anonymous_id, last_signed_in_at DESC, id) WHERE (last_signed_in_at IS NOT NULL)")


def _role_url(database_url: str, role: str) -> str:
    parts = urlsplit(database_url)
    return urlunsplit(parts._replace(netloc=f"{role}@{parts.hostname}:{parts.port}"))


def test_migrate_by_a_role_without_the_rights_is_one_line_naming_the_right(
    database_url: str,
) -> None:
    """``migrate`` by a role that lacks a right: one line naming it, exit code 2.

    Each missing right is named (PostgreSQL's own words) and nothing is applied; granted both,
    the same role migrates.
    """
    role = f"migrator_{uuid.uuid4().hex[:8]}"
    with scratch_database(database_url, "rights") as dsn:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f"CREATE ROLE {role} LOGIN")
            conn.execute("REVOKE CREATE ON SCHEMA public FROM PUBLIC")
            database = conn.execute("SELECT current_database()").fetchone()[0]  # type: ignore[index]
            conn.execute(f'REVOKE CREATE ON DATABASE "{database}" FROM PUBLIC')
        env = {**base_env(), "USER_ACTIVITY_DATABASE_URL": _role_url(dsn, role)}

        def migrate() -> subprocess.CompletedProcess[str]:
            return subprocess.run([sys.executable, "-m", "cli", "migrate"], cwd=ROOT, env=env,
                                  capture_output=True, text=True, timeout=120, check=False)

        try:
            expected = ["permission denied for schema public",
                        f"permission denied for database {database}"]
            grants = [f"GRANT CREATE ON SCHEMA public TO {role}",
                      f'GRANT CREATE ON DATABASE "{database}" TO {role}']
            for missing, grant in zip(expected, grants, strict=True):
                done = migrate()
                assert done.returncode == 2, done.stderr
                assert done.stderr.startswith(f"user-activity migrate: {missing}"), done.stderr
                assert len(done.stderr.strip().splitlines()) == 1
                with psycopg.connect(dsn, autocommit=True) as conn:
                    conn.execute(grant)
            done = migrate()
            assert done.returncode == 0, done.stderr
            every = len(sorted(MIGRATIONS_DIR.glob("*.sql")))
            assert f"applied {every} migration(s)" in done.stdout
        finally:
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute(f"REASSIGN OWNED BY {role} TO CURRENT_USER")
                conn.execute(f"DROP OWNED BY {role}")
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f"DROP ROLE {role}")


def test_0013_holds_requeued_parked_rows_for_their_topic(
    database_url: str, tmp_path: Path
) -> None:
    with scratch_database(database_url, "migrations") as dsn:
        later = _apply_first(dsn, tmp_path, 12)
        requeued, parked = uuid.uuid4(), uuid.uuid4()
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO user_activity.outbox_parked (id, topic, value, created_at, attempts,"
                " last_error, requeued_at) VALUES (%s, 't', 'r', now(), 1, 'MSG_SIZE_TOO_LARGE',"
                " now()), (%s, 't', 'p', now(), 2, 'INVALID_RECORD', NULL)", (requeued, parked))

        assert later[0] == "0013_outbox_held_topics"  # and what follows
        assert apply_migrations(dsn) == later
        assert apply_migrations(dsn) == []

        with psycopg.connect(dsn, autocommit=True) as conn:
            assert conn.execute("SELECT id, topic, value, last_error FROM user_activity.outbox_held"
                                ).fetchall() == [(requeued, "t", b"r", "MSG_SIZE_TOO_LARGE")]
            assert conn.execute("SELECT id FROM user_activity.outbox_unpublished").fetchall() == [
                (requeued,)]
            with pytest.raises(psycopg.errors.UniqueViolation):  # held once
                conn.execute("INSERT INTO user_activity.outbox_held (id, topic, value,"
                             " created_at, last_error) VALUES (%s, 't', 'x', now(), 'e')",
                             (requeued,))
