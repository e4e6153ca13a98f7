"""Replay/backfill (bounded, idempotent, dry run) and recovery from snapshots, on real services."""

from __future__ import annotations

import io
import logging
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from bytewax.recovery import RecoveryConfig, init_db_dir
from bytewax.testing import run_main

from cli.replay import replay
from dataflows.favorite_actions import build_flow
from devenv.harness.messages import favorite_envelope, new_id
from devenv.harness.sessions import insert_session
from sources.kafka_input import StartPosition
from tests.conftest import SettingsFactory
from tests.support import Produced, action_rows, consume_all, envelope_record, produce

pytestmark = pytest.mark.e2e


def _backlog(settings: Any, db: psycopg.Connection[Any], good: int) -> list[dict[str, Any]]:
    owners = [new_id() for _ in range(10)]
    for owner in owners:
        insert_session(db, anonymous_id=owner)
    envelopes = [favorite_envelope(anonymous_id=owners[i % 10]) for i in range(good)]
    invalid = favorite_envelope()  # neither owner
    no_session = favorite_envelope(user_id=new_id())
    records = [envelope_record(settings.topic_favorite_added, e) for e in envelopes]
    records += [envelope_record(settings.topic_favorite_removed, e)
                for e in (invalid, no_session)]
    produce(settings, records)
    return envelopes


def _ids(envelopes: list[dict[str, Any]]) -> list[uuid.UUID]:
    return [uuid.UUID(e["MessageId"]) for e in envelopes]


def test_replaying_an_already_processed_range_writes_no_row_and_publishes_nothing(
    make_settings: SettingsFactory, db: psycopg.Connection[Any]
) -> None:
    settings = make_settings()
    envelopes = _backlog(settings, db, 30)
    run_main(build_flow(settings))
    assert len(consume_all(settings, settings.topic_action_tracked, expect_at_least=30)) == 30
    out = io.StringIO()

    result = replay(settings, StartPosition(timestamp_ms=0), out=out)

    assert result == {"recorded": 0, "duplicate": 30, "invalid-owner": 1, "no-session": 1,
                      "dead-lettered": 0}
    assert len(action_rows(db, _ids(envelopes))) == 30
    assert len(consume_all(settings, settings.topic_action_tracked, expect_at_least=31)) == 30
    assert "duplicate" in out.getvalue()


def test_replay_restores_exactly_the_rows_that_were_lost(
    make_settings: SettingsFactory, db: psycopg.Connection[Any]
) -> None:
    settings = make_settings()
    envelopes = _backlog(settings, db, 20)
    run_main(build_flow(settings))
    lost = _ids(envelopes[:5])
    with db.transaction():  # test fixture: bypass the immutability trigger
        db.execute("SET LOCAL session_replication_role = replica")
        db.execute("DELETE FROM user_activity.action_events WHERE source_message_id = ANY(%s)",
                   (lost,))
        db.execute("DELETE FROM user_activity.consumer_idempotency_marks WHERE key = ANY(%s)",
                   ([f"user-activity-favorites:AddToFavorites:{m}" for m in lost],))
    kept_ids = {r["id"] for r in action_rows(db, _ids(envelopes[5:]))}

    dry = replay(settings, StartPosition(), dry_run=True, out=io.StringIO())
    assert len(action_rows(db, _ids(envelopes))) == 15  # the dry run wrote nothing
    result = replay(settings, StartPosition(), out=io.StringIO())

    assert dry["recorded"] == 5 and dry["duplicate"] == 15
    assert result["recorded"] == 5 and result["duplicate"] == 15
    rows = action_rows(db, _ids(envelopes))
    assert len(rows) == 20
    assert {r["id"] for r in rows if r["source_message_id"] not in lost} == kept_ids
    tracked = consume_all(settings, settings.topic_action_tracked, expect_at_least=25)
    assert len({t.json()["MessageId"] for t in tracked}) == 25


def test_dry_run_reports_would_be_outcomes_and_writes_nothing(
    make_settings: SettingsFactory, db: psycopg.Connection[Any]
) -> None:
    settings = make_settings()
    envelopes = _backlog(settings, db, 12)
    produce(settings, [envelope_record(settings.topic_favorite_added, envelopes[0])])  # dup
    produce(settings, [Produced(settings.topic_favorite_added, b"k", b"{oops")])
    out = io.StringIO()

    result = replay(settings, StartPosition(), dry_run=True, out=out)

    assert result == {"recorded": 12, "duplicate": 1, "invalid-owner": 1, "no-session": 1,
                      "dead-lettered": 1}
    assert action_rows(db, _ids(envelopes)) == []
    assert consume_all(settings, settings.topic_favorites_dlq, settle=0.5) == []
    assert "DRY RUN" in out.getvalue()


def test_restart_from_snapshot_keeps_offsets_and_the_dedup_window(
    make_settings: SettingsFactory, db: psycopg.Connection[Any], tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    settings = make_settings()
    recovery = tmp_path / "recovery"
    recovery.mkdir()
    init_db_dir(recovery, 1)
    envelopes = _backlog(settings, db, 10)
    run_main(build_flow(settings), epoch_interval=None,
             recovery_config=RecoveryConfig(str(recovery)))
    again = favorite_envelope(anonymous_id=uuid.UUID(envelopes[0]["Payload"]["AnonymousId"]))
    produce(settings, [envelope_record(settings.topic_favorite_added, envelopes[0]),
                       envelope_record(settings.topic_favorite_added, again)])
    caplog.set_level(logging.INFO)

    run_main(build_flow(settings), epoch_interval=None,
             recovery_config=RecoveryConfig(str(recovery)))

    sink_lines = [r for r in caplog.records if r.name == "dataflows.favorite_actions.sink"]
    dedup_lines = [
        r for r in caplog.records
        if r.name == "dataflows.favorite_actions.flow" and r.msg == "skipped-duplicate"
    ]
    # Offsets kept: only the two new records were read; the window (restored from the
    # snapshot) dropped the redelivery before it reached the database.
    assert [r.msg for r in sink_lines] == ["recorded"]
    assert [str(getattr(r, "MessageId", None)) for r in dedup_lines] == [envelopes[0]["MessageId"]]
    assert len(action_rows(db, _ids([*envelopes, again]))) == 11
