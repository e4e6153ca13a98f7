"""Whose like is it: both flows side by side on real Kafka and PostgreSQL, in time (issue 41).

The favorites job and the session-linking job run as Kubernetes runs them, each tailing its
topics; sign-ins and likes are produced by independent producers in real time, or as a backlog.
"""

from __future__ import annotations

import random
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

from devenv.harness.jobs import SESSION_LINKING_FLOW, JobProcess, JobSupervisor
from devenv.harness.messages import favorite_envelope, new_id, sign_in_envelope
from devenv.harness.sessions import insert_session
from devenv.prometheus_server import ApiJob, PrometheusServer, one_rule
from runtime.settings import Settings
from tests.conftest import SettingsFactory
from tests.support import Produced, consume_all, envelope_record, produce

pytestmark = pytest.mark.e2e

LATENESS = 4.0


def _both_flows(jobs: JobSupervisor, settings: Settings) -> tuple[JobProcess, JobProcess]:
    favorites = jobs.job(settings, "favorites")
    linking = jobs.job(settings, "session-linking", flow=SESSION_LINKING_FLOW)
    favorites.start()
    linking.start()
    return favorites, linking


def _iso(moment: datetime) -> str:
    return moment.isoformat()


def _sign_in(settings: Settings, user: uuid.UUID, device: uuid.UUID, at: datetime,
             partition: int | None = None) -> Produced:
    return envelope_record(settings.topic_user_signed_in, sign_in_envelope(
        user_id=user, anonymous_id=device, signed_in_at=_iso(at)), partition=partition)


def _like(settings: Settings, at: datetime, *, user: uuid.UUID | None = None,
          device: uuid.UUID | None = None) -> tuple[uuid.UUID, Produced]:
    message_id = new_id()
    return message_id, envelope_record(settings.topic_favorite_added, favorite_envelope(
        message_id=message_id, user_id=user, anonymous_id=device, occurred_at=_iso(at)))


def _rows(db: psycopg.Connection[Any], message_ids: list[uuid.UUID]) -> dict[uuid.UUID, Any]:
    rows = db.execute(
        "SELECT source_message_id, session_id, user_id FROM user_activity.action_events"
        " WHERE source_message_id = ANY(%s)", (message_ids,)).fetchall()
    return {row[0]: (row[1], row[2]) for row in rows}


def test_a_new_users_first_like_a_second_after_signing_in_is_recorded_in_the_session_it_made(
    make_settings: SettingsFactory, db: psycopg.Connection[Any], jobs: JobSupervisor,
) -> None:
    """20 users sign in for the first time (10 on new devices, 10 on guest ones); 1 s later, a like.

    The sign-in is held the lateness before its session exists, so the like finds none: it
    waits for it instead of being skipped (before: 20 of 20 skipped as no-session).
    """
    settings = make_settings(session_linking_lateness_seconds=LATENESS,
                             favorites_session_wait_seconds=30)
    users = [new_id() for _ in range(20)]
    devices = [new_id() for _ in range(20)]
    guest_sessions = {devices[i]: insert_session(db, anonymous_id=devices[i])
                      for i in range(10, 20)}
    favorites, _linking = _both_flows(jobs, settings)

    signed_in = datetime.now(UTC)
    produce(settings, [_sign_in(settings, u, d, signed_in) for u, d in zip(users, devices,
                                                                            strict=True)])
    time.sleep(1.0)
    likes = [_like(settings, signed_in + timedelta(seconds=1), user=u) for u in users]
    produce(settings, [record for _, record in likes])
    ids = [message_id for message_id, _ in likes]

    favorites.wait_until(lambda: len(_rows(db, ids)) == 20, 60, "20 rows")
    rows = _rows(db, ids)
    for (message_id, _), user, device in zip(likes, users, devices, strict=True):
        session_id, row_user = rows[message_id]
        expected = guest_sessions.get(device) or db.execute(
            "SELECT id FROM user_activity.sessions WHERE anonymous_id = %s", (device,)
        ).fetchone()[0]  # type: ignore[index]
        assert (session_id, row_user) == (expected, user)
    tracked = {r.json()["Payload"]["FavoriteId"]: r.json()["Payload"] for r in consume_all(
        settings, settings.topic_action_tracked, expect_at_least=20)}
    assert len(tracked) == 20
    by_user = {p["UserId"]: p["SessionId"] for p in tracked.values()}
    assert by_user == {str(rows[m][1]): str(rows[m][0]) for m in ids}
    waits = favorites.metrics()
    assert waits.get('user_activity_favorites_session_waits_total{outcome="recorded"}') == 20
    assert waits.get('user_activity_favorites_skipped_total{reason="no-session"}', 0) == 0


def test_a_guest_like_replayed_after_the_device_was_relinked_lands_where_it_happened(
    make_settings: SettingsFactory, db: psycopg.Connection[Any], jobs: JobSupervisor,
) -> None:
    settings = make_settings(session_linking_lateness_seconds=LATENESS)
    device, first, second = new_id(), new_id(), new_id()
    guest = insert_session(db, anonymous_id=device)
    now = datetime.now(UTC)
    favorites, linking = _both_flows(jobs, settings)
    produce(settings, [_sign_in(settings, first, device, now - timedelta(minutes=10)),
                       _sign_in(settings, second, device, now - timedelta(minutes=5))])
    linking.wait_until(lambda: db.execute(
        "SELECT count(*) FROM user_activity.sessions WHERE anonymous_id = %s AND user_id = %s",
        (device, second)).fetchone() == (1,), 60, "the device re-linked to the second user")

    late_id, late = _like(settings, now - timedelta(minutes=7), device=device)
    produce(settings, [late])

    favorites.wait_until(lambda: late_id in _rows(db, [late_id]), 60, "the late like's row")
    assert _rows(db, [late_id])[late_id] == (guest, first)
    history = db.execute(
        "SELECT history_user_id FROM user_activity.user_action_history"
        " WHERE source_message_id = %s", (late_id,)).fetchall()
    assert history == [(first,)]


def _oracle_users(sign_ins: list[tuple[float, uuid.UUID]]) -> list[uuid.UUID]:
    """The users of a device's sessions when its sign-ins apply in SignedInAt order."""
    users: list[uuid.UUID] = []
    for _, user in sorted(sign_ins, key=lambda s: s[0]):
        if not users or users[-1] != user:
            users.append(user)
    return users


def test_a_sign_in_backlog_over_three_partitions_follows_signed_in_at(
    make_settings: SettingsFactory, db: psycopg.Connection[Any], jobs: JobSupervisor,
) -> None:
    """300 sign-ins of one device by 3 users over 60 s, a backlog, each < 1 s out of order.

    Each user's sign-ins are on the user's partition (the topic is keyed by UserId); the first
    partition also holds 6,000 other devices' sign-ins of the same minute, so a poll of it
    covers seconds where a poll of the others covers the whole minute. The input's event-time
    alignment keeps the partitions within half the lateness of each other (before: the sparse
    partitions ran a minute ahead and the device's sign-ins from the dense one came late).
    Then one sign-in 30 s late (a fourth user's): a counted late-conflict, the only one.
    """
    settings = make_settings(session_linking_lateness_seconds=10.0)
    device, rng = new_id(), random.Random(41)
    users = [new_id() for _ in range(3)]
    start = datetime.now(UTC) - timedelta(minutes=5)
    sign_ins: list[tuple[float, uuid.UUID]] = []
    user = 0
    for index in range(300):
        if rng.random() < 0.26:
            user = rng.choice([u for u in range(3) if u != user])
        sign_ins.append((index * 0.2, users[user]))
    records = [(at, _sign_in(settings, u, device, start + timedelta(seconds=at),
                             partition=users.index(u))) for at, u in sign_ins]
    records += [(at, _sign_in(settings, new_id(), new_id(), start + timedelta(seconds=at),
                              partition=0)) for at in (i * 0.01 for i in range(6000))]
    records.sort(key=lambda r: r[0] + rng.uniform(0, 0.9))  # < 1 s out of order
    produce(settings, [record for _, record in records])
    linking = jobs.job(settings, "session-linking", flow=SESSION_LINKING_FLOW)
    linking.start()

    expected = _oracle_users(sign_ins)

    def sessions() -> list[uuid.UUID]:
        return [row[0] for row in db.execute(
            "SELECT user_id FROM user_activity.sessions WHERE anonymous_id = %s"
            " ORDER BY started_at, id", (device,)).fetchall()]

    linking.wait_until(lambda: _applied(linking) >= 6300, 120, "6,300 sign-ins applied")
    assert sessions() == expected
    assert _outcome(linking, "late-conflict") == 0
    assert len(expected) > 60  # the scenario changes user often

    last_at, _ = max(sign_ins)
    produce(settings, [_sign_in(settings, new_id(), device,
                                start + timedelta(seconds=last_at - 30))])
    linking.wait_until(lambda: _outcome(linking, "late-conflict") == 1, 60, "one late conflict")
    assert sessions() == expected


def _outcome(job: JobProcess, outcome: str) -> float:
    return job.metric(f'user_activity_session_linking_outcomes_total{{outcome="{outcome}"}}')


def _applied(job: JobProcess) -> float:
    return sum(_outcome(job, o) for o in ("linked", "already-linked", "relinked", "started",
                                          "late-conflict", "superseded"))


def _recorded(db: psycopg.Connection[Any]) -> int:
    row = db.execute("SELECT count(*) FROM user_activity.action_events").fetchone()
    return int(row[0]) if row else 0


def test_the_lag_gauge_and_alert_see_a_postgres_outage_under_a_trickle(
    make_settings: SettingsFactory, db: psycopg.Connection[Any], postgres_server: Any,
    tmp_path: Path,
) -> None:
    """A caught-up stream at 5 events/s; PostgreSQL stopped: the sink's batch ages, and says so.

    Before, the input stopped polling with nothing behind it, so the lag gauge read 0 for the
    whole outage and the lag alert could not fire.
    """
    if postgres_server is None:
        pytest.skip("needs the suite's own PostgreSQL server (external one configured)")
    settings = make_settings(retry_initial_seconds=0.5, retry_max_seconds=1.0)
    devices = [new_id() for _ in range(200)]
    for device in devices:
        insert_session(db, anonymous_id=device)
    job = ApiJob(settings, tmp_path / "job")
    rule = one_rule(tmp_path, "UserActivityFavoritesLagHigh", threshold=8, hold="1s")
    prometheus = PrometheusServer(tmp_path / "prometheus", job.scrape_targets("favorites-0"),
                                  [rule])
    try:
        job.start()
        prometheus.start()
        stop_at = time.monotonic() + 60
        sent = 0
        stopped = False
        try:
            while time.monotonic() < stop_at:
                produce(settings, [_like(settings, datetime.now(UTC),
                                         device=devices[sent % len(devices)])[1]])
                sent += 1
                if sent >= 15 and not stopped and _recorded(db):  # caught up, then the outage
                    postgres_server.stop()
                    stopped = True
                if stopped and prometheus.firing("UserActivityFavoritesLagHigh"):
                    break
                time.sleep(0.2)
            lag = job.metric("user_activity_favorites_lag_seconds")
            firing = prometheus.firing("UserActivityFavoritesLagHigh")
        finally:
            if stopped:
                postgres_server.start()
        assert stopped, "the job recorded no like in 60 s: no outage was started"
        assert lag > 8, lag
        assert firing, prometheus.log_tail()
        job.wait_until(lambda: job.metric("user_activity_favorites_lag_seconds") < 2, 60,
                       "the lag back to normal")
    finally:
        prometheus.close()
        job.kill()
