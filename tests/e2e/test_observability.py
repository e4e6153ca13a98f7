"""Metrics scraped over HTTP match what was produced; logs carry ids, never notes or secrets."""

from __future__ import annotations

import urllib.request
from typing import Any

import orjson
import psycopg
import pytest

from dataflows.favorite_actions import build_flow
from devenv.harness.messages import favorite_envelope, new_id
from devenv.harness.metrics import scrape, value
from devenv.harness.ports import free_port
from devenv.harness.sessions import insert_session
from runtime.health import Health, serve_http
from runtime.logs import JsonFormatter
from tests.conftest import SettingsFactory
from tests.support import Produced, envelope_record, produce, run_flow

pytestmark = pytest.mark.e2e

SPEC_METRICS = (
    "user_activity_favorites_consume_duration_ms",
    "user_activity_favorites_recorded",
    "user_activity_favorites_skipped",
    "user_activity_favorites_retries",
    "user_activity_favorites_dlq",
    "user_activity_favorites_lag_seconds",
)


def test_metrics_endpoint_counts_exactly_what_the_flow_processed(
    make_settings: SettingsFactory, db: psycopg.Connection[Any]
) -> None:
    settings = make_settings()
    port = serve_http("127.0.0.1", free_port(), Health())
    assert port is not None
    anonymous = new_id()
    insert_session(db, anonymous_id=anonymous)
    added = [favorite_envelope(anonymous_id=anonymous) for _ in range(7)]
    removed = [favorite_envelope(anonymous_id=anonymous) for _ in range(3)]
    produce(settings, [
        *(envelope_record(settings.topic_favorite_added, e) for e in added),
        *(envelope_record(settings.topic_favorite_removed, e) for e in removed),
        envelope_record(settings.topic_favorite_added, added[0]),  # duplicate
        envelope_record(settings.topic_favorite_added, favorite_envelope()),  # invalid owner
        envelope_record(settings.topic_favorite_added, favorite_envelope(user_id=new_id())),
        Produced(settings.topic_favorite_added, b"k", b"not json"),  # poison
    ])
    before = scrape(port)

    run_flow(build_flow, settings)
    after = scrape(port)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert {f"{m}" for m in SPEC_METRICS} <= {name.removesuffix("_total").removesuffix(
        "_count").removesuffix("_sum").removesuffix("_bucket") for name, _ in after}
    assert delta("user_activity_favorites_recorded_total", action_type="AddToFavorites") == 7
    assert delta("user_activity_favorites_recorded_total", action_type="RemoveFromFavorites") == 3
    assert delta("user_activity_favorites_skipped_total", reason="duplicate") == 1
    assert delta("user_activity_favorites_skipped_total", reason="invalid-owner") == 1
    assert delta("user_activity_favorites_skipped_total", reason="no-session") == 1
    assert delta("user_activity_favorites_dlq_total") == 1
    assert delta("user_activity_favorites_retries_total") == 0
    assert delta("user_activity_favorites_consume_duration_ms_count") == 11  # rows + db skips
    batches = delta("user_activity_favorites_write_duration_ms_count")  # one per committed batch
    assert 1 <= batches <= 11 and delta("user_activity_favorites_write_duration_ms_sum") > 0
    assert 0 <= value(after, "user_activity_favorites_lag_seconds") < 300
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as response:
        assert response.status == 200


def test_log_lines_are_json_with_ids_and_never_notes_ips_user_agents_or_secrets(
    make_settings: SettingsFactory, db: psycopg.Connection[Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    base = make_settings()
    with_password = base.database_dsn().replace("postgres@", "postgres:S3cret-Pw-0815@", 1)
    settings = make_settings(database_url=with_password, kafka_sasl_password="Kafka-Pw-0815")
    assert "S3cret-Pw-0815" in settings.database_dsn()
    anonymous = new_id()
    session = insert_session(db, anonymous_id=anonymous)
    secret_note = "NOTE-my-private-thoughts-4711"
    envelope = favorite_envelope(anonymous_id=anonymous, extra_payload={
        "Note": secret_note, "IpAddress": "203.0.113.77", "UserAgent": "Mozilla/5.0 SecretUA",
    })
    produce(settings, [envelope_record(settings.topic_favorite_added, envelope)])
    caplog.set_level("DEBUG")

    run_flow(build_flow, settings)

    formatter = JsonFormatter()
    lines = [formatter.format(record) for record in caplog.records]
    text = "\n".join(lines)
    for forbidden in (secret_note, "203.0.113.77", "SecretUA", "S3cret-Pw-0815", "Kafka-Pw-0815"):
        assert forbidden not in text
    assert secret_note not in repr(settings) and "S3cret-Pw-0815" not in repr(settings)
    recorded = [orjson.loads(line) for line in lines if '"event":"recorded"' in line]
    assert len(recorded) == 1
    line = recorded[0]
    assert line["outcome"] == "recorded"
    assert line["MessageId"] == envelope["MessageId"]
    assert line["SessionId"] == str(session)
    assert line["ActionType"] == "AddToFavorites"
    assert line["FavoriteId"] == envelope["Payload"]["FavoriteId"].lower()
    assert line["PropertyObjectId"] == envelope["Payload"]["PropertyObjectId"]
