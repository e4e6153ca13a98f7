"""Sign-ins are decided by SignedInAt, not by arrival: real broker, real PostgreSQL."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dataflows.session_linking import build_flow
from dataflows.session_linking.linking import ActiveSession, LinkOutcome, decide
from devenv.harness.jobs import SESSION_LINKING_FLOW, JobSupervisor
from devenv.harness.messages import new_id, sign_in_envelope
from devenv.harness.sessions import insert_session
from tests.conftest import SettingsFactory
from tests.support import envelope_record, produce, run_flow

pytestmark = pytest.mark.e2e

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


@dataclass(frozen=True)
class SignIn:
    device: int
    user: int
    at: int
    """Seconds after T0 (distinct per device, so the true order is defined)."""


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[int, int, list[bool], list[SignIn], list[int], list[int]]:
    devices = draw(st.integers(1, 3))
    users = draw(st.integers(2, 4))
    guest = draw(st.lists(st.booleans(), min_size=devices, max_size=devices))
    sign_ins = []
    for device in range(devices):
        times = draw(st.lists(st.integers(0, 29), min_size=1, max_size=4, unique=True))
        sign_ins += [SignIn(device, draw(st.integers(0, users - 1)), t) for t in times]
    arrival = draw(st.permutations(list(range(len(sign_ins)))))
    redelivered = draw(st.lists(st.sampled_from(list(range(len(sign_ins)))), max_size=3))
    return devices, users, guest, sign_ins, arrival, redelivered


@dataclass
class Device:
    """The oracle's view of one device: its sessions, in order, and which one is Active."""

    sessions: list[dict[str, Any]] = field(default_factory=list)
    active: int | None = None
    linked_events: int = 0


def _oracle(guest: list[bool], sign_ins: list[SignIn], user_ids: list[uuid.UUID]) -> list[Device]:
    """Apply the sign-ins sorted by SignedInAt, once each, with the linking rule."""
    devices = []
    for has_guest in guest:
        device = Device()
        if has_guest:
            device.sessions.append({"user": None, "ended": False})
            device.active = 0
        devices.append(device)
    for sign_in in sorted(sign_ins, key=lambda s: (s.device, s.at)):
        device = devices[sign_in.device]
        user = user_ids[sign_in.user]
        active = None if device.active is None else device.sessions[device.active]
        outcome = decide(
            None if active is None else ActiveSession(uuid.UUID(int=device.active or 0),
                                                      active["user"]), user)
        if outcome is LinkOutcome.LINKED:
            assert active is not None
            active["user"] = user
            device.linked_events += 1
        elif outcome in (LinkOutcome.RELINKED, LinkOutcome.STARTED):
            if active is not None:
                active["ended"] = True
            device.sessions.append({"user": user, "ended": False})
            device.active = len(device.sessions) - 1
    return devices


def _database(db: psycopg.Connection[Any], settings_: Any, anonymous: uuid.UUID) -> Device:
    rows = db.execute(
        "SELECT id, user_id, status FROM user_activity.sessions WHERE anonymous_id = %s"
        " ORDER BY started_at, id", (anonymous,),
    ).fetchall()
    device = Device()
    for index, (session_id, user_id, status) in enumerate(rows):
        device.sessions.append({"user": user_id, "ended": status == "Ended"})
        if status == "Active":
            device.active = index
        linked = db.execute(
            "SELECT count(*) FROM user_activity.outbox WHERE topic = %s AND key = %s",
            (settings_.topic_session_linked, str(session_id).encode()),
        ).fetchone()
        assert linked is not None
        assert linked[0] <= 1, "a session announced as linked twice"
        device.linked_events += int(linked[0])
    return device


@settings(max_examples=8, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(scenario=scenarios())
def test_sign_ins_arriving_in_any_order_within_the_lateness_end_as_if_applied_in_order(
    make_settings: SettingsFactory, db: psycopg.Connection[Any],
    scenario: tuple[int, int, list[bool], list[SignIn], list[int], list[int]],
) -> None:
    devices, users, guest, sign_ins, arrival, redelivered = scenario
    config = make_settings(session_linking_lateness_seconds=60)
    anonymous = [new_id() for _ in range(devices)]
    user_ids = [new_id() for _ in range(users)]
    for index, has_guest in enumerate(guest):
        if has_guest:
            insert_session(db, anonymous_id=anonymous[index],
                           last_activity_at=T0 - timedelta(minutes=5))
    envelopes = [
        sign_in_envelope(user_id=user_ids[s.user], anonymous_id=anonymous[s.device],
                         signed_in_at=(T0 + timedelta(seconds=s.at)).isoformat())
        for s in sign_ins
    ]
    order = [*arrival, *redelivered]  # any arrival order, plus redeliveries
    produce(config, [envelope_record(config.topic_user_signed_in, envelopes[i]) for i in order])

    run_flow(build_flow, config)

    expected = _oracle(guest, sign_ins, user_ids)
    for index, device_id in enumerate(anonymous):
        found = _database(db, config, device_id)
        assert found.sessions == expected[index].sessions, (index, sign_ins, order)
        assert found.active == expected[index].active
        assert found.linked_events == expected[index].linked_events


def _signed_in(config: Any, user: uuid.UUID, device: uuid.UUID, seconds: int) -> Any:
    moment = (T0 + timedelta(seconds=seconds)).isoformat()
    return envelope_record(config.topic_user_signed_in, sign_in_envelope(
        user_id=user, anonymous_id=device, signed_in_at=moment))


def test_a_sign_in_later_than_the_lateness_never_relinks_and_is_recorded_as_a_conflict(
    make_settings: SettingsFactory, db: psycopg.Connection[Any],
) -> None:
    config = make_settings(session_linking_lateness_seconds=5)
    guest_device, bare_device = new_id(), new_id()
    guest_session = insert_session(db, anonymous_id=guest_device,
                                   last_activity_at=T0 - timedelta(minutes=5))
    a, b, c, d = new_id(), new_id(), new_id(), new_id()
    produce(config, [_signed_in(config, b, guest_device, 100),
                     _signed_in(config, c, bare_device, 100)])
    run_flow(build_flow, config)  # B links the guest session; C starts a session
    late_a = _signed_in(config, a, guest_device, 50)  # 50 s before B's: far beyond 5 s
    late_b = _signed_in(config, b, guest_device, 40)  # the same user again: no conflict
    late_d = _signed_in(config, d, bare_device, 20)
    produce(config, [late_a, late_b, late_d])

    run_flow(build_flow, config)

    sessions = db.execute(
        "SELECT anonymous_id, id, user_id, status FROM user_activity.sessions"
        " WHERE anonymous_id = ANY(%s) ORDER BY started_at", ([guest_device, bare_device],),
    ).fetchall()
    assert [(s[1], s[2], s[3]) for s in sessions if s[0] == guest_device] == [
        (guest_session, b, "Active")]  # never re-linked to A
    assert [(s[2], s[3]) for s in sessions if s[0] == bare_device] == [(c, "Active")]
    conflicts = db.execute(
        "SELECT anonymous_id, session_user_id, sign_in_user_id, reason"
        "  FROM user_activity.sign_in_conflicts WHERE anonymous_id = ANY(%s)",
        ([guest_device, bare_device],),
    ).fetchall()
    assert sorted(conflicts) == sorted([
        (guest_device, b, a, "would-relink"), (bare_device, c, d, "would-relink"),
    ])
    last = db.execute(
        "SELECT last_signed_in_at FROM user_activity.sessions WHERE id = %s", (guest_session,)
    ).fetchone()
    assert last == (T0 + timedelta(seconds=100),)  # the late same-user sign-in moved nothing back


def test_a_tailing_job_holds_a_sign_in_for_the_lateness_and_applies_an_earlier_one_first(
    make_settings: SettingsFactory, db: psycopg.Connection[Any], jobs: JobSupervisor,
) -> None:
    """Live: B's sign-in arrives first, A's (earlier) 1 s later; A links, then B relinks."""
    config = make_settings(session_linking_lateness_seconds=3)
    device, a, b = new_id(), new_id(), new_id()
    guest = insert_session(db, anonymous_id=device, last_activity_at=T0 - timedelta(minutes=5))
    job = jobs.job(config, flow=SESSION_LINKING_FLOW)
    job.start()
    now = datetime.now(UTC)
    produce(config, [envelope_record(config.topic_user_signed_in, sign_in_envelope(
        user_id=b, anonymous_id=device, signed_in_at=now.isoformat()))])
    time.sleep(1)
    produce(config, [envelope_record(config.topic_user_signed_in, sign_in_envelope(
        user_id=a, anonymous_id=device,
        signed_in_at=(now - timedelta(seconds=1)).isoformat()))])

    def sessions() -> list[tuple[Any, ...]]:
        return db.execute(
            "SELECT id, user_id, status FROM user_activity.sessions WHERE anonymous_id = %s"
            " ORDER BY started_at, id", (device,),
        ).fetchall()

    job.wait_until(lambda: len(sessions()) == 2, 30, "both sign-ins to be applied")
    first, second = sessions()
    assert first == (guest, a, "Ended")  # A signed in first: the guest session is A's
    assert second[1:] == (b, "Active")  # then B: A's session ended, a new one started for B


def test_a_sign_in_stamped_hours_ahead_does_not_make_the_next_user_of_the_device_late(
    make_settings: SettingsFactory, db: psycopg.Connection[Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A's SignedInAt is +03:00 written as Z (three hours ahead). Taken at its word, it would be
    # the device's newest sign-in until then: B signing in on the device a minute later would
    # look late and be refused as a would-relink conflict, and B's actions would stay A's.
    config = make_settings(session_linking_lateness_seconds=1)
    device, a, b = new_id(), new_id(), new_id()
    guest = insert_session(db, anonymous_id=device,
                           last_activity_at=datetime.now(UTC) - timedelta(minutes=5))
    ahead = datetime.now(UTC) + timedelta(hours=3)
    produce(config, [envelope_record(config.topic_user_signed_in, sign_in_envelope(
        user_id=a, anonymous_id=device, signed_in_at=ahead.isoformat()))])
    with caplog.at_level("WARNING"):
        run_flow(build_flow, config)  # A links the guest session
    time.sleep(1.1)
    produce(config, [envelope_record(config.topic_user_signed_in, sign_in_envelope(
        user_id=b, anonymous_id=device, signed_in_at=datetime.now(UTC).isoformat()))])

    run_flow(build_flow, config)

    sessions = db.execute(
        "SELECT id, user_id, status, last_signed_in_at FROM user_activity.sessions"
        " WHERE anonymous_id = %s ORDER BY started_at", (device,)).fetchall()
    assert [(s[1], s[2]) for s in sessions] == [(a, "Ended"), (b, "Active")]  # B relinked
    assert sessions[0][0] == guest and sessions[0][3] < ahead - timedelta(hours=2)
    assert db.execute("SELECT count(*) FROM user_activity.sign_in_conflicts"
                      " WHERE anonymous_id = %s", (device,)).fetchone() == (0,)
    assert "sign-in-from-the-future" in caplog.text


def test_a_late_sign_in_on_a_device_left_without_a_session_starts_none(
    make_settings: SettingsFactory, db: psycopg.Connection[Any],
) -> None:
    config = make_settings(session_linking_lateness_seconds=5)
    device = new_id()
    guest = insert_session(db, anonymous_id=device, last_activity_at=T0 - timedelta(minutes=5))
    a, b = new_id(), new_id()
    produce(config, [_signed_in(config, b, device, 100)])
    run_flow(build_flow, config)  # B links the guest session
    db.execute("UPDATE user_activity.sessions SET status = 'Ended', ended_at = now()"
               " WHERE id = %s", (guest,))  # the session service ends it
    produce(config, [_signed_in(config, a, device, 50),  # A, before B: another user's is later
                     _signed_in(config, b, device, 40)])  # B again, before its applied one

    run_flow(build_flow, config)

    sessions = db.execute(
        "SELECT id, user_id, status FROM user_activity.sessions WHERE anonymous_id = %s",
        (device,)).fetchall()
    assert sessions == [(guest, b, "Ended")]  # no session started for a superseded sign-in
    conflicts = db.execute(
        "SELECT session_id, sign_in_user_id, reason, device_last_signed_in_at"
        "  FROM user_activity.sign_in_conflicts WHERE anonymous_id = %s", (device,)).fetchall()
    assert conflicts == [(None, a, "would-start", T0 + timedelta(seconds=100))]
    outcomes = db.execute(
        "SELECT topic, count(*) FROM user_activity.outbox WHERE topic = ANY(%s) GROUP BY topic",
        ([config.topic_session_linked, config.topic_session_started],)).fetchall()
    assert outcomes == [(config.topic_session_linked, 1)]


def test_a_live_sign_in_stamped_before_its_users_last_one_still_starts_a_session(
    make_settings: SettingsFactory, db: psycopg.Connection[Any],
) -> None:
    # The first sign-in came from a producer whose clock is 30 s fast (within the skew bound, so
    # taken at its word); the user signs out, then in again from a correct clock: a live sign-in
    # that only looks older than the device's last one.
    config = make_settings(session_linking_lateness_seconds=1)
    device, user = new_id(), new_id()
    guest = insert_session(db, anonymous_id=device,
                           last_activity_at=datetime.now(UTC) - timedelta(minutes=5))
    fast = datetime.now(UTC) + timedelta(seconds=30)
    produce(config, [envelope_record(config.topic_user_signed_in, sign_in_envelope(
        user_id=user, anonymous_id=device, signed_in_at=fast.isoformat()))])
    run_flow(build_flow, config)  # links the guest session
    db.execute("UPDATE user_activity.sessions SET status = 'Ended', ended_at = now()"
               " WHERE id = %s", (guest,))  # signed out
    produce(config, [envelope_record(config.topic_user_signed_in, sign_in_envelope(
        user_id=user, anonymous_id=device, signed_in_at=datetime.now(UTC).isoformat()))])

    run_flow(build_flow, config)

    sessions = db.execute(
        "SELECT id, user_id, status FROM user_activity.sessions WHERE anonymous_id = %s"
        " ORDER BY started_at", (device,)).fetchall()
    assert [(s[0] == guest, s[1], s[2]) for s in sessions] == [
        (True, user, "Ended"), (False, user, "Active")]
