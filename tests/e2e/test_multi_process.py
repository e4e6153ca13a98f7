"""The favorites job as a 2-process Bytewax cluster (``-i``/``-a``) on real Kafka + PostgreSQL."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest

from devenv.harness.env import base_env, settings_env
from devenv.harness.jobs import ROOT
from devenv.harness.messages import favorite_envelope, new_id
from devenv.harness.ports import free_port
from devenv.harness.sessions import insert_session
from tests.conftest import SettingsFactory
from tests.support import action_rows, consume_all, envelope_record, produce

pytestmark = pytest.mark.e2e


def test_two_processes_record_every_message_exactly_once(
    make_settings: SettingsFactory, db: psycopg.Connection[Any], tmp_path: Path
) -> None:
    settings = make_settings(tail=False)
    owners = [new_id() for _ in range(50)]
    for owner in owners:
        insert_session(db, anonymous_id=owner)
    envelopes = [favorite_envelope(anonymous_id=owners[i % 50]) for i in range(600)]
    produce(settings, [
        *(envelope_record(settings.topic_favorite_added, e) for e in envelopes[:400]),
        *(envelope_record(settings.topic_favorite_removed, e) for e in envelopes[400:]),
        *(envelope_record(settings.topic_favorite_added, e) for e in envelopes[:100]),  # again
    ])
    addresses = f"127.0.0.1:{free_port()};127.0.0.1:{free_port()}"
    env = {**base_env(), **settings_env(settings)}
    processes = []
    for index in range(2):
        log = (tmp_path / f"process-{index}.log").open("wb")
        processes.append(subprocess.Popen(
            [sys.executable, "-m", "bytewax.run", "dataflows.favorite_actions:flow",
             "-i", str(index), "-a", addresses],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
        ))
    try:
        codes = [p.wait(180) for p in processes]
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
                p.wait(10)

    assert codes == [0, 0], [(tmp_path / f"process-{i}.log").read_text()[-3000:] for i in (0, 1)]
    rows = action_rows(db, [uuid.UUID(e["MessageId"]) for e in envelopes])
    assert len(rows) == 600
    assert sum(r["action_type"] == "RemoveFromFavorites" for r in rows) == 200
    tracked = consume_all(settings, settings.topic_action_tracked, expect_at_least=600)
    assert len({t.json()["MessageId"] for t in tracked}) == 600
    assert {t.json()["AggregateId"] for t in tracked} == {str(r["id"]) for r in rows}
