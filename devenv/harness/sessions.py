"""Rows of ``user_activity.sessions``: one at a time, or many in bulk (COPY)."""

from __future__ import annotations

import io
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg

LINKED_LONG_AGO = datetime(2000, 1, 1, tzinfo=UTC)
"""The default ``linked_at`` of a seeded linked session: before any action a test makes, so its
actions carry the session's user (a row's UserId is the session's user as of the action)."""


@dataclass(frozen=True, slots=True)
class Session:
    """A seeded Active session: the owner ids a message may carry."""

    id: uuid.UUID
    anonymous_id: uuid.UUID
    user_id: uuid.UUID | None = None


def insert_session(conn: psycopg.Connection[Any], *, anonymous_id: uuid.UUID,
                   user_id: uuid.UUID | None = None, status: str = "Active",
                   last_activity_at: datetime | None = None, session_id: uuid.UUID | None = None,
                   linked_at: datetime | None = None) -> uuid.UUID:
    """One session row (started an hour before its last activity); its id."""
    session_id = session_id or uuid.uuid4()
    now = datetime.now(UTC)
    last = last_activity_at or now
    link_time = (linked_at or LINKED_LONG_AGO) if user_id else None
    conn.execute(
        """INSERT INTO user_activity.sessions
             (id, anonymous_id, user_id, linked_at, status, started_at, last_activity_at, ended_at)
           VALUES (%s, %s, %s, %s, %s, %s, %s, %s)""",
        (session_id, anonymous_id, user_id, link_time, status,
         last - timedelta(hours=1), last, now if status == "Ended" else None),
    )
    return session_id


def seed_sessions(conn: psycopg.Connection[Any], sessions: Sequence[Session], *,
                  started_ago: timedelta = timedelta(0)) -> None:
    """COPY ``sessions`` into ``user_activity.sessions``."""
    now = datetime.now(UTC)
    stamp = now.isoformat()
    started = (now - started_ago).isoformat()
    buf = io.StringIO()
    for s in sessions:
        user = "\\N" if s.user_id is None else str(s.user_id)
        linked = "\\N" if s.user_id is None else LINKED_LONG_AGO.isoformat()
        buf.write(f"{s.id}\t{s.anonymous_id}\t{user}\t{linked}\tActive\t{started}\t{stamp}\t\\N\n")
    with conn.cursor() as cur, cur.copy(
        "COPY user_activity.sessions (id, anonymous_id, user_id, linked_at, status, started_at,"
        " last_activity_at, ended_at) FROM STDIN"
    ) as copy:
        copy.write(buf.getvalue())


def seed_owners(
    database_url: str, devices: int, users: int = 0, *,
    started_ago: timedelta = timedelta(hours=1),
) -> tuple[list[uuid.UUID], list[uuid.UUID]]:
    """Active sessions in bulk: ``devices`` guest devices and ``users`` linked (device, user)."""
    guests = [Session(uuid.uuid4(), uuid.uuid4()) for _ in range(devices)]
    linked = [Session(uuid.uuid4(), uuid.uuid4(), uuid.uuid4()) for _ in range(users)]
    with psycopg.connect(database_url, autocommit=True) as conn:
        seed_sessions(conn, [*guests, *linked], started_ago=started_ago)
    return [s.anonymous_id for s in guests], [s.user_id for s in linked if s.user_id]
