"""The outbox stream's progress (sinks.outbox.progress): pure values, checked against a model.

A snapshot's visibility is PostgreSQL's rule; a progress covers exactly the transactions the
stream has published, and never forgets one as windows end.
"""

from __future__ import annotations

from uuid import UUID

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sinks.outbox.progress import Progress, Snapshot, snapshot


@st.composite
def snapshots(draw: st.DrawFn, low: int = 10, high: int = 60) -> str:
    xmin = draw(st.integers(low, high))
    xmax = draw(st.integers(xmin, high + 10))
    running = draw(st.sets(st.integers(xmin, max(xmin, xmax - 1)), max_size=5))
    running = {t for t in running if xmin <= t < xmax}
    return f"{xmin}:{xmax}:{','.join(str(t) for t in sorted(running))}"


def test_visibility_is_postgresqls_rule() -> None:
    seen = snapshot("10:20:12,15")
    assert [t for t in range(5, 25) if seen.visible(t)] == [5, 6, 7, 8, 9, 10, 11, 13, 14, 16,
                                                             17, 18, 19]


@given(first=snapshots(), second=snapshots())
def test_sees_all_of_is_the_visibility_of_every_transaction(first: str, second: str) -> None:
    a, b = snapshot(first), snapshot(second)
    model = all(a.visible(t) for t in range(0, 90) if b.visible(t))  # xmax < 90: exact
    assert a.sees_all_of(b) is model


@given(older=snapshots(), extra=st.integers(0, 10), finished=st.sets(st.integers(0, 80)))
def test_a_later_snapshot_sees_all_an_earlier_one_sees(older: str, extra: int,
                                                       finished: set[int]) -> None:
    before = snapshot(older)
    later = Snapshot(before.xmin, before.xmax + extra,
                     frozenset(t for t in before.running if t not in finished))
    assert later.sees_all_of(before)


@given(delivered=snapshots(), target=snapshots(), sent=st.sets(st.integers(0, 80), max_size=8))
def test_a_finished_window_covers_what_it_read_and_forgets_no_sent_transaction(
    delivered: str, target: str, sent: set[int]) -> None:
    progress = Progress(delivered, frozenset(sent))
    before = {t for t in range(0, 90) if progress.covers(t)}

    done = progress.window_done(target)

    after = {t for t in range(0, 90) if done.covers(t)}
    seen = snapshot(target)
    assert after == {t for t in range(0, 90) if seen.visible(t)} | {
        t for t in sent if not seen.visible(t)}
    assert {t for t in sent} <= after
    if seen.sees_all_of(snapshot(delivered)):
        assert before <= after  # a window never takes back what was published


def test_a_window_under_way_covers_its_target_and_keeps_its_cursor() -> None:
    progress = Progress("10:10:").with_sent([30]).window_until("10:20:15", (12, UUID(int=3)))

    assert progress.covers(12) and progress.covers(30) and progress.covers(19)
    assert not progress.covers(15) and not progress.covers(25)
    assert progress.window_done("10:20:15").target is None


def test_the_record_round_trips_and_refuses_another_format() -> None:
    progress = Progress("10:20:12,15", frozenset({21, 25}), "10:22:12", (11, UUID(int=9)),
                        {"t.started": 7})

    assert Progress.decode(progress.encode()) == progress
    with pytest.raises(ValueError, match="format"):
        Progress.decode(b'{"format": 2}')
    with pytest.raises(ValueError, match="not a progress"):
        Progress.decode(b"not json")
    with pytest.raises(ValueError, match="target and a cursor"):
        Progress("10:20:", target="10:22:")
