"""An input that stops while it has a backlog is seen: source-side lag and no-progress rise."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest
import yaml
from confluent_kafka import Producer

from devenv.harness.jobs import JobProcess, JobSupervisor
from devenv.harness.messages import favorite_envelope, new_id
from devenv.harness.sessions import insert_session
from devenv.prometheus_server import PrometheusServer, ScrapeTarget
from tests.conftest import SettingsFactory

pytestmark = pytest.mark.e2e

_TEN_MINUTES_MS = 600_000
RULES_FILE = Path(__file__).resolve().parents[2] / "k8s" / "prometheus-rules.yaml"
LAG_ALERT = "UserActivityFavoritesLagHigh"


def _rule(name: str) -> dict[str, Any]:
    groups = yaml.safe_load(RULES_FILE.read_text())["groups"]
    [rule] = [r for g in groups for r in g["rules"] if r.get("alert") == name]
    return dict(rule)


def _gauges(job: JobProcess, topic: str) -> dict[str, float]:
    samples = job.metrics()
    prefix = ("user_activity_input_records_behind", "user_activity_input_seconds_since_progress",
              "user_activity_input_lag_seconds")
    found: dict[str, float] = {"favorites_lag": samples.get("user_activity_favorites_lag_seconds",
                                                             -1.0)}
    for name in prefix:
        values = [v for k, v in samples.items() if k.startswith(name) and f'topic="{topic}"' in k]
        found[name.removeprefix("user_activity_input_")] = max(values, default=-1.0)
    return found


def test_a_blocked_stream_with_a_backlog_shows_rising_lag_and_time_without_progress(
    make_settings: SettingsFactory, database_url: str, db: psycopg.Connection[object],
    jobs: JobSupervisor, tmp_path: Path,
) -> None:
    settings = make_settings(source_batch_size=20, db_statement_timeout_ms=120_000)
    topic = settings.topic_favorite_added
    device = new_id()
    insert_session(db, anonymous_id=device)
    job = jobs.job(settings)
    with psycopg.connect(database_url) as blocker:
        # Every insert of action history waits on this lock: the worker stops in its sink.
        blocker.execute("LOCK TABLE user_activity.action_events IN SHARE ROW EXCLUSIVE MODE")
        job.start()
        producer = Producer({**settings.kafka_client_config(), "linger.ms": 5})
        created = int(time.time() * 1000) - _TEN_MINUTES_MS  # produced ten minutes ago
        for _ in range(600):
            producer.produce(topic, orjson.dumps(favorite_envelope(anonymous_id=device)),
                             b"k", timestamp=created)
        assert producer.flush(30) == 0

        job.wait_until(lambda: _gauges(job, topic)["records_behind"] > 0, 60, "a backlog")
        first = _gauges(job, topic)
        time.sleep(3)
        later = _gauges(job, topic)
        assert later["records_behind"] > 0
        assert later["seconds_since_progress"] >= first["seconds_since_progress"] + 2
        assert later["lag_seconds"] >= 600  # now - CreateTime of the last record read
        assert later["favorites_lag"] >= later["lag_seconds"]
        # The lag alert's own expression, evaluated by a real Prometheus scraping the job with
        # the rule file loaded: true on these gauges, and the alert pending (its `for` runs).
        target = ScrapeTarget(f"127.0.0.1:{job.port}",
                              {"namespace": "user-activity", "pod": "favorites-0",
                               "endpoint": "http"})
        with PrometheusServer(tmp_path / "prometheus", [target], [RULES_FILE]) as prom:
            prom.wait_until(prom.targets_up, 60, "the job to be scraped")
            expr = str(_rule(LAG_ALERT)["expr"])
            prom.wait_until(lambda: bool(prom.query(expr)), 30, f"{LAG_ALERT}'s expression")
            prom.wait_until(
                lambda: any(a["labels"]["alertname"] == LAG_ALERT for a in prom.alerts()),
                30, f"{LAG_ALERT} to be pending",
            )
        blocker.rollback()
    # Unblocked: everything is recorded and the gauges fall back to 0.
    job.wait_until(lambda: _gauges(job, topic)["records_behind"] == 0, 120, "the backlog to drain")
    job.wait_until(lambda: _gauges(job, topic)["lag_seconds"] == 0, 30, "the lag to clear")
