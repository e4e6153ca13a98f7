"""One topic cannot stop the others, on the 3-node cluster with ACLs enforced (issue 43).

The job's principal may not WRITE session-started: the sessions that sign-ins start are held
back, while favorites are recorded and announced on action-tracked, and the per-topic alert fires
in a real Prometheus evaluating k8s/prometheus-rules.yaml. Once the ACL is granted the held rows
go out once each and in order, and the alert resolves. Both flows run as jobs; the database is
the test's own (the cluster's topics exist nowhere else).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AclOperation,
    ResourcePatternType,
    ResourceType,
)

from devenv.harness.jobs import ROOT, SESSION_LINKING_FLOW, JobSupervisor
from devenv.harness.messages import favorite_envelope, new_id, sign_in_envelope
from devenv.harness.sessions import insert_session
from devenv.kafka_cluster import ADMIN, KafkaCluster
from devenv.prometheus_server import PrometheusServer, ScrapeTarget
from runtime.settings import Settings
from tests.support import (
    Produced,
    action_rows,
    consume_all,
    envelope_record,
    produce,
)

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("kafka-cluster")]

HELD = "UserActivityOutboxTopicHeld"
SIGN_INS, FAVORITES = 20, 30
OUTPUTS = ("action_tracked", "session_linked", "session_ended", "favorites_dlq",
           "session_linking_dlq", "outbox_progress")
"""The topics the job may write: every output but session-started."""


def _grant_all_but_session_started(cluster: KafkaCluster, settings: Settings,
                                   prefix: str) -> None:
    for operation in (AclOperation.READ, AclOperation.DESCRIBE, AclOperation.DESCRIBE_CONFIGS):
        cluster.grant("User:job", ResourceType.TOPIC, prefix, operation,
                      ResourcePatternType.PREFIXED)
    cluster.grant("User:job", ResourceType.GROUP, prefix, AclOperation.READ,
                  ResourcePatternType.PREFIXED)
    for name in OUTPUTS:
        cluster.grant("User:job", ResourceType.TOPIC, getattr(settings, f"topic_{name}"),
                      AclOperation.WRITE)
    cluster.grant("User:job", ResourceType.TRANSACTIONAL_ID, settings.outbox_transactional_id,
                  AclOperation.WRITE)


def _held(db: psycopg.Connection[Any], topic: str) -> list[uuid.UUID]:
    return [row_id for (row_id,) in db.execute(
        "SELECT id FROM user_activity.outbox_held WHERE topic = %s ORDER BY seq",
        (topic,)).fetchall()]


def _active(prom: PrometheusServer, topic: str) -> list[dict[str, Any]]:
    return [a for a in prom.alerts()
            if a["labels"].get("alertname") == HELD and a["labels"].get("topic") == topic]


def test_a_topic_the_job_may_not_write_holds_back_its_rows_alone_until_granted(
    kafka_cluster: KafkaCluster, own_database: str, cluster_settings: Callable[..., Settings],
    jobs: JobSupervisor, tmp_path: Path,
) -> None:
    prefix = f"held-{uuid.uuid4().hex[:8]}"
    tuned = {"outbox_stall_seconds": 3, "session_linking_lateness_seconds": 1}
    settings = cluster_settings(prefix, "job", **tuned)
    admin = cluster_settings(prefix, ADMIN, **tuned)  # the platform's tools
    kafka_cluster.create_topics(admin.all_topics(), partitions=3)
    _grant_all_but_session_started(kafka_cluster, settings, prefix)
    started_topic = settings.topic_session_started
    favorites = jobs.job(settings, "favorites")
    linking = jobs.job(settings, "session-linking", flow=SESSION_LINKING_FLOW)
    targets = [ScrapeTarget(f"127.0.0.1:{job.port}", {
        "namespace": "user-activity", "pod": pod, "container": "stream", "endpoint": "http"})
        for job, pod in ((favorites, "favorites-0"), (linking, "session-linking-0"))]
    with psycopg.connect(own_database, autocommit=True) as db, PrometheusServer(
            tmp_path / "prometheus", targets, [ROOT / "k8s" / "prometheus-rules.yaml"]) as prom:
        favorites.start()
        linking.start()
        prom.wait_until(prom.targets_up, 60, "both jobs to be scraped")

        # Sign-ins on new devices start sessions: their session-started rows are held back.
        produce(admin, [envelope_record(settings.topic_user_signed_in, sign_in_envelope(
            user_id=new_id(), anonymous_id=new_id(), signed_in_at=datetime.now(UTC).isoformat()))
            for _ in range(SIGN_INS)])
        linking.wait_until(lambda: len(_held(db, started_topic)) == SIGN_INS, 90,
                           "the session-started rows to be held back")
        # Favorites meanwhile: recorded and announced.
        records, message_ids, favorite_ids = _favorites(admin, db)
        produce(admin, records)
        favorites.wait_until(lambda: len(action_rows(db, message_ids)) == FAVORITES, 90,
                             "the favorites to be recorded")
        tracked = consume_all(admin, settings.topic_action_tracked, expect_at_least=FAVORITES)
        prom.wait_until(lambda: bool(_active(prom, started_topic))
                        and _active(prom, started_topic)[0]["state"] == "firing", 60,
                        f"{HELD} to fire for {started_topic}")
        assert _active(prom, settings.topic_action_tracked) == []
        order = _held(db, started_topic)

        kafka_cluster.grant("User:job", ResourceType.TOPIC, started_topic, AclOperation.WRITE)
        linking.wait_until(lambda: not _held(db, started_topic), 60, "the held rows to go out")
        started = consume_all(admin, started_topic, expect_at_least=SIGN_INS, settle=2.0)
        prom.wait_until(lambda: not _active(prom, started_topic), 60, f"{HELD} to resolve")
        codes = [favorites.terminate(), linking.terminate()]

    assert codes == [0, 0], favorites.log_tail() + linking.log_tail()
    assert sorted(r.json()["Payload"]["FavoriteId"] for r in tracked) == sorted(
        str(favorite_id) for favorite_id in favorite_ids)
    assert len({r.json()["MessageId"] for r in tracked}) == len(tracked) == FAVORITES
    sent = [uuid.UUID(r.json()["MessageId"]) for r in started]
    assert sorted(sent) == sorted(order)  # each held row once, none twice
    for partition in {r.partition for r in started}:  # in the held order on each partition
        on_partition = [uuid.UUID(r.json()["MessageId"]) for r in started
                        if r.partition == partition]
        assert on_partition == [row_id for row_id in order if row_id in set(on_partition)]


def _favorites(admin: Settings, db: psycopg.Connection[Any]
               ) -> tuple[list[Produced], list[uuid.UUID], list[uuid.UUID]]:
    """Favorites of guests with a session: the records, their MessageIds, their FavoriteIds."""
    records, message_ids, favorite_ids = [], [], []
    for _ in range(FAVORITES):
        anonymous, message_id, favorite_id = new_id(), new_id(), new_id()
        insert_session(db, anonymous_id=anonymous)
        records.append(envelope_record(admin.topic_favorite_added, favorite_envelope(
            message_id=message_id, favorite_id=favorite_id, anonymous_id=anonymous)))
        message_ids.append(message_id)
        favorite_ids.append(favorite_id)
    return records, message_ids, favorite_ids
