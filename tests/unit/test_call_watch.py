"""runtime.call_watch: a call with no answer is said (pause, log line), its answer ends that.

The checks are driven with explicit times (``check(now)``), so no test waits for the watch
thread; the e2e test with a frozen PostgreSQL (tests/e2e/test_stop_during_outage.py) runs the
thread against the real server.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from runtime import call_watch
from runtime.call_watch import REPEAT_SECONDS, Watched
from runtime.health import HEALTH, Health


@pytest.fixture
def watched() -> Iterator[Watched]:
    one = Watched("unit-call-watch", "postgres", slow_after=2.0)
    yield one
    HEALTH.resumed(waiter=one.waiter)


def _waiting() -> dict[str, str]:
    return dict(HEALTH.snapshot().waiting)


def _events(caplog: pytest.LogCaptureFixture, event: str) -> list[dict[str, object]]:
    return [r.__dict__ for r in caplog.records if r.getMessage() == event]


def test_a_call_within_its_time_is_not_said(
    watched: Watched, caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level("INFO", logger="runtime.call_watch"), watched:
        watched.check(time.monotonic() + 1.9)
    assert watched.waiter not in _waiting()
    assert not caplog.records


def test_a_call_past_its_time_pauses_its_waiter_until_it_returns(
    watched: Watched, caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level("INFO", logger="runtime.call_watch"):
        with watched:
            watched.check(time.monotonic() + 2.5)
            snap = HEALTH.snapshot()
            assert snap.state == "paused"
            assert _waiting()[watched.waiter] == "postgres"
            assert snap.last_error is not None and snap.last_error.startswith("no answer for")
        assert watched.waiter not in _waiting()
    said = _events(caplog, "dependency-not-answering")
    assert len(said) == 1
    assert said[0]["waiter"] == "unit-call-watch"
    assert said[0]["dependency"] == "postgres"
    assert said[0]["slow_after_s"] == 2.0
    answered = _events(caplog, "dependency-answered")
    assert len(answered) == 1
    assert answered[0]["waiter"] == "unit-call-watch"
    assert "error" not in answered[0]  # returned normally


def test_a_call_that_fails_after_being_said_names_the_error(
    watched: Watched, caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level("INFO", logger="runtime.call_watch"), \
            pytest.raises(ConnectionResetError), watched:
        watched.check(time.monotonic() + 3.0)
        raise ConnectionResetError
    assert watched.waiter not in _waiting()
    assert _events(caplog, "dependency-answered")[0]["error"] == "ConnectionResetError"


def test_a_long_call_is_said_again_every_repeat_interval_not_every_check(
    watched: Watched, caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level("INFO", logger="runtime.call_watch"), watched:
        now = time.monotonic()
        for second in range(3, 3 + int(REPEAT_SECONDS) + 2):  # one check a second
            watched.check(now + second)
        assert len(_events(caplog, "dependency-not-answering")) == 2
        assert watched.waiter in _waiting()


def test_a_call_that_ended_before_the_check_leaves_no_pause_behind(
    watched: Watched, caplog: pytest.LogCaptureFixture,
) -> None:
    """The watch thread may look just as the call returns: nothing is said after the return."""
    with caplog.at_level("INFO", logger="runtime.call_watch"):
        with watched:
            pass
        watched.check(time.monotonic() + 100)
    assert watched.waiter not in _waiting()
    assert not caplog.records


def test_the_watch_thread_says_a_call_without_being_asked(caplog: pytest.LogCaptureFixture) -> None:
    one = Watched("unit-call-watch-thread", "postgres", slow_after=0.2)
    try:
        with caplog.at_level("INFO", logger="runtime.call_watch"), one:
            deadline = time.monotonic() + 10
            while one.waiter not in _waiting() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert _waiting().get(one.waiter) == "postgres"
        assert one.waiter not in _waiting()
        assert [e["waiter"] for e in _events(caplog, "dependency-not-answering")] == [
            "unit-call-watch-thread"]
    finally:
        HEALTH.resumed(waiter=one.waiter)


def test_slow_after_must_be_positive() -> None:
    with pytest.raises(ValueError, match="slow_after"):
        Watched("unit-call-watch-bad", "postgres", slow_after=0)


def test_a_call_hanging_past_the_liveness_limit_leaves_liveness_to_judge(
    watched: Watched, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Paused (livez 200) until the limit, then withdrawn without a beat: livez says dead.

    A connection the OS cannot see dead (keepalives off) ends only by the pod's restart; before
    the watch, liveness restarted it after the limit, and a pause kept for ever would not.
    """
    health = Health(stall_seconds=300.0)
    monkeypatch.setattr(call_watch, "HEALTH", health)
    with watched:
        start = time.monotonic()
        watched.check(start + 10)
        assert health.snapshot().state == "paused"
        monkeypatch.setattr(health, "_last_progress", start - 301)  # no progress since
        watched.check(start + 301)
        snap = health.snapshot()
        assert watched.waiter not in dict(snap.waiting)
        assert snap.state == "dead"
