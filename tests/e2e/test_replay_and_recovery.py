"""Replay/backfill (bounded, idempotent, dry run) and recovery from snapshots, on real services."""

from __future__ import annotations

import io
import logging
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest
from bytewax.recovery import RecoveryConfig, init_db_dir
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient

from cli.replay import ReplayRefused, replay
from dataflows.favorite_actions import build_flow
from dataflows.session_linking import build_flow as build_session_linking_flow
from devenv.harness.env import settings_env
from devenv.harness.jobs import ROOT
from devenv.harness.messages import favorite_envelope, new_id, sign_in_envelope
from devenv.harness.sessions import insert_session, seed_owners
from sources.kafka_input import StartPosition
from tests.conftest import SettingsFactory
from tests.support import (
    Produced,
    action_rows,
    consume_all,
    envelope_record,
    produce,
    produce_in_transactions,
    recreate_topic,
    run_flow,
)

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


def _recovery_store(directory: Path) -> Path:
    """A new Bytewax recovery store of one partition in ``directory``."""
    directory.mkdir()
    init_db_dir(directory, 1)
    return directory


def _ids(envelopes: list[dict[str, Any]]) -> list[uuid.UUID]:
    return [uuid.UUID(e["MessageId"]) for e in envelopes]


def test_replaying_an_already_processed_range_writes_no_row_and_publishes_nothing(
    make_settings: SettingsFactory, db: psycopg.Connection[Any]
) -> None:
    settings = make_settings()
    envelopes = _backlog(settings, db, 30)
    run_flow(build_flow, settings)
    assert len(consume_all(settings, settings.topic_action_tracked, expect_at_least=30)) == 30
    out = io.StringIO()

    result = replay(settings, StartPosition(timestamp_ms=0), out=out)

    assert result == {"recorded": 0, "duplicate": 30, "invalid-owner": 1, "no-session": 1,
                      "dead-lettered": 0}
    assert len(action_rows(db, _ids(envelopes))) == 30
    # the replay's publisher drained before it returned: anything it sent is on the topic (an
    # expect_at_least of 31 waited the whole 30 s timeout for a record that must not come)
    assert len(consume_all(settings, settings.topic_action_tracked, expect_at_least=30,
                           settle=3.0)) == 30
    assert "duplicate" in out.getvalue()


def test_replay_restores_exactly_the_rows_that_were_lost(
    make_settings: SettingsFactory, db: psycopg.Connection[Any], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the temporary stores go
    settings = make_settings()
    envelopes = _backlog(settings, db, 20)
    run_flow(build_flow, settings)
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
    # both ran to their end on a temporary recovery store: neither is left behind (every
    # replay without --recovery-dir left one in the temporary directory)
    assert list(tmp_path.glob("user-activity-replay-*")) == []


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


def test_a_dry_run_keeps_no_recovery_store_so_the_real_run_given_that_directory_reads_all(
    make_settings: SettingsFactory, db: psycopg.Connection[Any], tmp_path: Path,
) -> None:
    # The k8s backfill Job passes --recovery-dir to its dry run too. The dry run saved its
    # offsets there, and the real run given the directory then read nothing: 0 recorded.
    settings = make_settings()
    envelopes = _backlog(settings, db, 8)
    store = tmp_path / "replay"
    out = io.StringIO()

    dry = replay(settings, StartPosition(), dry_run=True, recovery_dir=store, out=out)
    real = replay(settings, StartPosition(), recovery_dir=store, out=io.StringIO())

    assert dry["recorded"] == real["recorded"] == 8
    assert len(action_rows(db, _ids(envelopes))) == 8
    assert f"a dry run keeps no recovery store: {store} is not used" in out.getvalue()


def test_a_replay_refuses_a_recovery_store_it_did_not_make(
    make_settings: SettingsFactory, db: psycopg.Connection[Any], tmp_path: Path,
) -> None:
    # Given the main job's store, a replay resumed from the main job's offsets (read nothing,
    # whatever --from said) and moved them.
    settings = make_settings()
    envelopes = _backlog(settings, db, 4)
    main_store = _recovery_store(tmp_path / "main")
    run_flow(build_flow, settings, epoch_interval=None,
             recovery_config=RecoveryConfig(str(main_store)))
    snapshot = {p.name: p.read_bytes() for p in main_store.iterdir()}

    with pytest.raises(ReplayRefused, match="no replay made"):
        replay(settings, StartPosition(), recovery_dir=main_store, out=io.StringIO())

    assert {p.name: p.read_bytes() for p in main_store.iterdir()} == snapshot
    assert len(action_rows(db, _ids(envelopes))) == 4


def test_the_sink_partitions_can_be_lowered_and_raised_on_an_existing_recovery_store(
    make_settings: SettingsFactory, db: psycopg.Connection[Any], tmp_path: Path,
) -> None:
    # Lowered, every start panicked in Bytewax (a sink partition of the store no longer
    # listed): a crash loop, in both flows, until the old value was restored.
    settings = make_settings(sink_partitions=2)
    store = _recovery_store(tmp_path / "recovery")
    owners = [new_id() for _ in range(8)]
    for owner in owners:
        insert_session(db, anonymous_id=owner)
    recorded: list[dict[str, Any]] = []
    for partitions in (2, 1, 3):
        batch = [favorite_envelope(anonymous_id=owners[i % 8]) for i in range(20)]
        produce(settings, [envelope_record(settings.topic_favorite_added, e) for e in batch])
        recorded += batch
        changed = settings.model_copy(update={"sink_partitions": partitions})
        run_flow(build_flow, changed, epoch_interval=None,
                 recovery_config=RecoveryConfig(str(store)))
        assert len(action_rows(db, _ids(recorded))) == len(recorded)
    users = [new_id() for _ in owners[:2]]
    for owner, user in zip(owners[:2], users, strict=True):
        produce(settings, [envelope_record(settings.topic_user_signed_in,
                                           sign_in_envelope(user_id=user, anonymous_id=owner))])
        for partitions in (2, 1):
            changed = settings.model_copy(update={"sink_partitions": partitions})
            run_flow(build_session_linking_flow, changed, epoch_interval=None,
                     recovery_config=RecoveryConfig(str(store)))
    assert db.execute("SELECT array_agg(user_id ORDER BY user_id) FROM user_activity.sessions"
                      " WHERE anonymous_id = ANY(%s)", (owners[:2],)).fetchone() == (
        sorted(users),)


def test_after_its_topic_was_deleted_and_created_again_a_restart_reads_the_new_topic_from_0(
    make_settings: SettingsFactory, db: psycopg.Connection[Any], tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Resumed at the old topic's offset, the job skipped every new record below it, silently.
    settings = make_settings()
    owner = new_id()
    insert_session(db, anonymous_id=owner)
    topic = settings.topic_favorite_added
    store = _recovery_store(tmp_path / "recovery")
    old = [favorite_envelope(anonymous_id=owner) for _ in range(30)]
    produce(settings, [envelope_record(topic, e, partition=0) for e in old])
    run_flow(build_flow, settings, epoch_interval=None,
             recovery_config=RecoveryConfig(str(store)))
    recreate_topic(AdminClient(settings.kafka_client_config()), topic, settings.topic_partitions)
    new = [favorite_envelope(anonymous_id=owner) for _ in range(50)]
    produce(settings, [envelope_record(topic, e, partition=0) for e in new])

    run_flow(build_flow, settings, epoch_interval=None,
             recovery_config=RecoveryConfig(str(store)))

    assert len(action_rows(db, _ids(old))) == 30
    assert len(action_rows(db, _ids(new))) == 50
    said = {r.partition: (r.levelno, r.snapshot_offset)  # type: ignore[attr-defined]
            for r in caplog.records if r.getMessage() == "input-topic-recreated"}
    assert said == {p: (logging.ERROR, 30 if p == 0 else 0)
                    for p in range(settings.topic_partitions)}


def test_restart_from_snapshot_keeps_offsets_and_the_dedup_window(
    make_settings: SettingsFactory, db: psycopg.Connection[Any], tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    settings = make_settings()
    recovery = _recovery_store(tmp_path / "recovery")
    envelopes = _backlog(settings, db, 10)
    run_flow(build_flow, settings, epoch_interval=None,
             recovery_config=RecoveryConfig(str(recovery)))
    again = favorite_envelope(anonymous_id=uuid.UUID(envelopes[0]["Payload"]["AnonymousId"]))
    produce(settings, [envelope_record(settings.topic_favorite_added, envelopes[0]),
                       envelope_record(settings.topic_favorite_added, again)])
    caplog.set_level(logging.INFO)

    run_flow(build_flow, settings, epoch_interval=None,
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


def _sessions_of(db: psycopg.Connection[Any], devices: list[uuid.UUID]) -> list[tuple[Any, ...]]:
    return db.execute(
        "SELECT id, anonymous_id, user_id, linked_at, status, ended_at"
        "  FROM user_activity.sessions WHERE anonymous_id = ANY(%s) ORDER BY id",
        (devices,),
    ).fetchall()


def _session_outbox(db: psycopg.Connection[Any], settings: Any) -> int:
    row = db.execute(
        "SELECT count(*) FROM user_activity.outbox WHERE topic = ANY(%s)",
        ([settings.topic_session_linked, settings.topic_session_started,
          settings.topic_session_ended],),
    ).fetchone()
    return int(row[0]) if row else -1


def _sign_ins(settings: Any, db: psycopg.Connection[Any]) -> tuple[list[uuid.UUID], int]:
    """Two guest devices and one without a session, each signed in once: 2 links, 1 start."""
    guests = [new_id(), new_id()]
    for device in guests:
        insert_session(db, anonymous_id=device)
    bare = new_id()
    produce(settings, [
        envelope_record(settings.topic_user_signed_in,
                        sign_in_envelope(user_id=new_id(), anonymous_id=device))
        for device in [*guests, bare]
    ])
    return [*guests, bare], 3


def test_replaying_applied_sign_ins_changes_no_session_and_publishes_nothing(
    make_settings: SettingsFactory, db: psycopg.Connection[Any]
) -> None:
    settings = make_settings()
    devices, count = _sign_ins(settings, db)
    run_flow(build_session_linking_flow, settings)
    sessions, events = _sessions_of(db, devices), _session_outbox(db, settings)
    assert events == count  # 2 session-linked, 1 session-started

    result = replay(settings, StartPosition(), flow_name="session-linking", out=io.StringIO())

    assert result["duplicate"] == count
    assert sum(v for k, v in result.items() if k != "duplicate") == 0
    assert _sessions_of(db, devices) == sessions
    assert _session_outbox(db, settings) == events


def test_a_dry_run_of_sign_ins_reports_what_they_would_change_and_changes_nothing(
    make_settings: SettingsFactory, db: psycopg.Connection[Any]
) -> None:
    settings = make_settings()
    devices, _count = _sign_ins(settings, db)
    before = _sessions_of(db, devices)
    out = io.StringIO()

    result = replay(settings, StartPosition(), flow_name="session-linking", dry_run=True,
                    out=out)

    assert (result["linked"], result["started"], result["duplicate"]) == (2, 1, 0)
    assert _sessions_of(db, devices) == before
    assert _session_outbox(db, settings) == 0
    assert "DRY RUN of session-linking (nothing written)" in out.getvalue()


def test_until_closes_the_replay_window_at_that_time(
    make_settings: SettingsFactory, db: psycopg.Connection[Any]
) -> None:
    settings = make_settings()
    owner = new_id()
    insert_session(db, anonymous_id=owner)
    early = [favorite_envelope(anonymous_id=owner) for _ in range(5)]
    late = [favorite_envelope(anonymous_id=owner) for _ in range(4)]
    producer = Producer(settings.kafka_client_config())
    window_end = int(time.time() * 1000) - 3_600_000  # an hour ago: early before it, late after
    failed: list[object] = []
    for envelopes, stamp in ((early, window_end - 60_000), (late, window_end + 60_000)):
        for envelope in envelopes:
            producer.produce(settings.topic_favorite_added, orjson.dumps(envelope), b"k",
                             timestamp=stamp, on_delivery=lambda err, _m: failed.append(err)
                             if err else None)
    assert producer.flush(30) == 0
    assert failed == []

    result = replay(settings, StartPosition(until_ms=window_end), out=io.StringIO())

    assert result["recorded"] == 5
    assert len(action_rows(db, _ids(early))) == 5
    assert action_rows(db, _ids(late)) == []


@pytest.mark.timeout(120)
def test_a_replay_of_topics_written_in_transactions_ends_and_records_only_the_committed(
    make_settings: SettingsFactory, db: psycopg.Connection[Any]
) -> None:
    """A replay of input written in transactions ends, and records only what was committed.

    A .NET producer with a TransactionalId leaves a marker after each transaction, never
    delivered to a consumer; here every partition written ends on one (the last transaction
    aborted), and the replay still ends at the end offsets it saw at start.
    """
    settings = make_settings()
    owner = new_id()
    insert_session(db, anonymous_id=owner)
    committed = [favorite_envelope(anonymous_id=owner) for _ in range(12)]
    aborted = [favorite_envelope(anonymous_id=owner) for _ in range(6)]
    produce_in_transactions(settings, [
        ([envelope_record(topic, e) for e in envelopes
          for topic in (settings.topic_favorite_added, settings.topic_favorite_removed)], commit)
        for envelopes, commit in ((committed, True), (aborted, False))
    ])

    result = replay(settings, StartPosition(timestamp_ms=0), out=io.StringIO())

    # each committed message twice (once per topic): recorded once, the other a duplicate
    assert result == {"recorded": 12, "duplicate": 12, "invalid-owner": 0, "no-session": 0,
                      "dead-lettered": 0}
    assert len(action_rows(db, _ids(committed))) == 12
    assert action_rows(db, _ids(aborted)) == []


def test_a_replay_stopped_by_sigterm_says_so_and_its_directory_resumes_it(
    make_settings: SettingsFactory, db: psycopg.Connection[Any], database_url: str,
    tmp_path: Path,
) -> None:
    # SIGTERM killed a replay with no summary (exit -15), and Ctrl-C ended it in a traceback.
    settings = make_settings()
    guests, _ = seed_owners(database_url, 50)
    envelopes = [favorite_envelope(anonymous_id=guests[i % 50]) for i in range(60_000)]
    produce(settings, [envelope_record(settings.topic_favorite_added, e) for e in envelopes])
    store = tmp_path / "replay"
    command = [sys.executable, "-m", "cli", "replay", "--from-beginning",
               "--recovery-dir", str(store)]
    env = settings_env(settings)
    replaying = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.DEVNULL, text=True)
    assert replaying.stdout is not None
    for line in replaying.stdout:  # a progress line every 2 s: rows are being written
        if "processed" in line and " 0:" not in line:
            break
    replaying.send_signal(signal.SIGTERM)
    stopped = replaying.stdout.read()
    assert replaying.wait(60) == 75
    assert f", STOPPED (SIGTERM) before its end: --recovery-dir {store} resumes it" in stopped
    written = len(action_rows(db, _ids(envelopes)))
    assert 0 < written < len(envelopes)

    resumed = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=300, check=False)

    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert len(action_rows(db, _ids(envelopes))) == len(envelopes)
