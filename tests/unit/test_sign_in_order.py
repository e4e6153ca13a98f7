"""Sign-ins of one device in SignedInAt order (reorder buffer) and the late-conflict rule."""

from __future__ import annotations

import pickle
import uuid
from datetime import UTC, datetime, timedelta

import orjson
import pytest

from dataflows.session_linking.decode import SignInMessage, decode_sign_in
from dataflows.session_linking.linking import ConflictReason, LastSignIn, LinkOutcome, late_verdict
from dataflows.session_linking.reorder import ReorderBuffer
from devenv.harness.messages import sign_in_envelope
from schemas.kafka_record import SourceRecord

T0 = datetime(2026, 11, 30, 12, 0, 0, tzinfo=UTC)
DEVICE = uuid.uuid4()


def _sign_in(seconds: float, user: uuid.UUID | None = None) -> SignInMessage:
    envelope = sign_in_envelope(user_id=user or uuid.uuid4(), anonymous_id=DEVICE,
                                signed_in_at=(T0 + timedelta(seconds=seconds)).isoformat())
    decoded = decode_sign_in(SourceRecord("t", 0, 0, b"k", orjson.dumps(envelope)))
    assert isinstance(decoded, SignInMessage)
    return decoded


def _at(seconds: float) -> float:
    """Wall time ``seconds`` after T0 (the test's clock runs with event time here)."""
    return (T0 + timedelta(seconds=seconds)).timestamp()


def test_sign_ins_arriving_out_of_order_within_the_lateness_are_released_in_order() -> None:
    buffer = ReorderBuffer(lateness=10)
    later, earlier = _sign_in(5), _sign_in(2)

    assert buffer.add([later], now=_at(5)) == []  # the newest waits the lateness
    assert buffer.add([earlier], now=_at(7)) == []  # 3 s late: still in time
    assert buffer.release(now=_at(11.9)) == []
    assert buffer.release(now=_at(12)) == [earlier]  # watermark 5 + 7 s of clock - 10 = 2
    assert buffer.release(now=_at(14.9)) == []
    assert buffer.release(now=_at(15)) == [later]
    assert len(buffer) == 0


def test_an_older_sign_in_is_released_at_once_before_the_newer_one() -> None:
    buffer = ReorderBuffer(lateness=10)
    newer, older = _sign_in(60), _sign_in(1)

    assert buffer.add([newer], now=_at(60)) == []
    assert buffer.add([older], now=_at(60.5)) == [older]
    assert buffer.next_release_at() == pytest.approx(_at(70))


def test_a_batch_is_sorted_and_an_idle_device_is_released_by_the_clock() -> None:
    buffer = ReorderBuffer(lateness=2)
    third, first, second = _sign_in(3), _sign_in(1), _sign_in(2)

    assert buffer.add([third, first, second], now=_at(3)) == [first]
    assert buffer.release(now=_at(4)) == [second]
    assert buffer.release(now=_at(5)) == [third]


def test_zero_lateness_applies_every_sign_in_at_once_in_order() -> None:
    buffer = ReorderBuffer(lateness=0)
    b, a = _sign_in(2), _sign_in(1)

    assert buffer.add([b, a], now=_at(2)) == [a, b]


def test_the_watermark_never_goes_back() -> None:
    buffer = ReorderBuffer(lateness=10)
    buffer.add([_sign_in(100)], now=_at(100))
    before = buffer.watermark(_at(150))

    buffer.add([_sign_in(120)], now=_at(150))  # behind the clock-advanced watermark

    assert buffer.watermark(_at(150)) == before


def test_the_pending_sign_ins_survive_a_snapshot() -> None:
    buffer = ReorderBuffer(lateness=10)
    pending = _sign_in(5)
    buffer.add([pending], now=_at(5))

    restored = ReorderBuffer(10, pickle.loads(pickle.dumps(buffer.snapshot())))

    assert restored.release(now=_at(14)) == []
    assert [m.message_id for m in restored.release(now=_at(15))] == [pending.message_id]
    assert restored.flush() == []


def test_after_a_restart_a_pending_sign_in_still_waits_its_lateness() -> None:
    buffer = ReorderBuffer(lateness=10)
    buffer.add([_sign_in(5)], now=_at(5))
    state = buffer.snapshot()

    restored = ReorderBuffer(10, state, now=_at(500))  # the job was down for eight minutes

    assert restored.release(now=_at(500)) == []  # the downtime does not count as waiting
    assert restored.release(now=_at(509.9)) == []
    assert len(restored.release(now=_at(510))) == 1


LAST = T0 + timedelta(minutes=5)
EARLIER = T0
STARTED_AFTER = T0 + timedelta(minutes=1)
STARTED_BEFORE = T0 - timedelta(minutes=1)
ME, OTHER = uuid.UUID(int=1), uuid.UUID(int=2)
BY_OTHER = LastSignIn(LAST, OTHER)
BY_ME = LastSignIn(LAST, ME, covers=True)  # my own sign-in, at or after the one decided
TIED = LastSignIn(LAST, OTHER, covers=True)  # another user's at the same instant as mine


Case = tuple[LinkOutcome, datetime, LastSignIn | None, datetime | None, bool,
             ConflictReason | LinkOutcome | None]
"""outcome, SignedInAt, the device's last applied sign-in, the Active session's start, stale,
and the verdict expected."""


@pytest.mark.parametrize("case", [
    (LinkOutcome.RELINKED, EARLIER, BY_OTHER, STARTED_BEFORE, True, ConflictReason.WOULD_RELINK),
    (LinkOutcome.LINKED, EARLIER, BY_OTHER, STARTED_AFTER, True,
     ConflictReason.PREDATES_SESSION),
    (LinkOutcome.LINKED, EARLIER, BY_OTHER, STARTED_BEFORE, True, None),  # it existed then
    (LinkOutcome.STARTED, EARLIER, BY_OTHER, None, True, ConflictReason.WOULD_START),
    (LinkOutcome.ALREADY_LINKED, EARLIER, BY_OTHER, STARTED_BEFORE, True, None),  # same user
    (LinkOutcome.STARTED, LAST, BY_ME, None, True, LinkOutcome.SUPERSEDED),  # mark expired
    (LinkOutcome.STARTED, EARLIER, BY_ME, None, True, LinkOutcome.SUPERSEDED),  # my later one
    (LinkOutcome.STARTED, EARLIER, BY_ME, None, False, None),  # live: a clock a little off
    (LinkOutcome.LINKED, LAST, BY_ME, STARTED_AFTER, True, LinkOutcome.SUPERSEDED),
    (LinkOutcome.RELINKED, LAST, BY_ME, STARTED_AFTER, True, LinkOutcome.SUPERSEDED),
    (LinkOutcome.ALREADY_LINKED, LAST, BY_ME, STARTED_BEFORE, True, None),  # confirms: nothing
    (LinkOutcome.STARTED, LAST, TIED, None, True, LinkOutcome.SUPERSEDED),
    (LinkOutcome.RELINKED, LAST, BY_OTHER, STARTED_BEFORE, False, None),  # no order: as after
    (LinkOutcome.RELINKED, LAST + timedelta(seconds=1), BY_OTHER, STARTED_BEFORE, False, None),
    (LinkOutcome.STARTED, LAST + timedelta(seconds=1), LastSignIn(LAST, ME), None, False, None),
    (LinkOutcome.RELINKED, EARLIER, None, STARTED_BEFORE, True, None),  # the device's first
], ids=["relink", "guest-session-after", "guest-session-before", "start-after-another-user",
        "same-user", "my-replay-no-session", "start-after-my-later-sign-in",
        "live-start-after-my-later-sign-in", "my-replay-new-guest-session",
        "my-replay-another-users-session", "my-replay-confirms", "tie-replayed",
        "same-instant-as-another-user", "not-late", "not-late-start", "first"])
def test_a_sign_in_at_or_before_the_last_applied_one_never_starts_or_changes_whose_a_session_is(
    case: Case,
) -> None:
    outcome, signed_in_at, last, started, stale, expected = case

    assert late_verdict(outcome, ME, signed_in_at, last, started, stale=stale) is expected
