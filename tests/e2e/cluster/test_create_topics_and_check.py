"""``create-topics`` and ``check`` on the 3-node cluster with SASL users and ACLs."""

from __future__ import annotations

import subprocess
import sys
import uuid
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AclOperation,
    AdminClient,
    ConfigResource,
    ResourceType,
)

from cli import check
from cli.topics import create_topics, input_topics, own_topics
from devenv.harness.env import base_env
from devenv.harness.jobs import ROOT, wait_until
from devenv.kafka_cluster import KafkaCluster
from runtime.settings import ENV_PREFIX, Settings

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("kafka-cluster")]


def _settings(cluster: KafkaCluster, database_url: str, user: str, **overrides: Any) -> Settings:
    """Settings as ``user`` whose topics and groups belong to this test."""
    prefix = f"t.cluster.{uuid.uuid4().hex[:8]}"
    topics: dict[str, Any] = {
        name: f"{prefix}.{name.removeprefix('topic_')}" for name in Settings.model_fields
        if name.startswith("topic_") and isinstance(Settings.model_fields[name].default, str)}
    assert cluster.users is not None
    return Settings(kafka_bootstrap_servers=cluster.bootstrap, database_url=database_url,
                    kafka_security_protocol="SASL_PLAINTEXT", kafka_sasl_mechanism="PLAIN",
                    kafka_sasl_username=user, kafka_sasl_password=cluster.users[user],
                    consumer_group_favorites=f"{prefix}.favorites",
                    consumer_group_session_linking=f"{prefix}.session-linking",
                    outbox_transactional_id=f"{prefix}.outbox", **topics, **overrides)


def _env(settings: Settings) -> dict[str, str]:
    """The ``USER_ACTIVITY_*`` variables of ``settings`` (its connection, topics, groups)."""
    names = ["kafka_bootstrap_servers", "kafka_security_protocol", "kafka_sasl_mechanism",
             "kafka_sasl_username", "consumer_group_favorites", "consumer_group_session_linking",
             "outbox_transactional_id",
             *(n for n in Settings.model_fields if n.startswith("topic_"))]
    assert settings.kafka_sasl_password is not None
    return {**base_env(), **{ENV_PREFIX + n.upper(): str(getattr(settings, n)) for n in names},
            f"{ENV_PREFIX}KAFKA_SASL_PASSWORD": settings.kafka_sasl_password.get_secret_value(),
            f"{ENV_PREFIX}DATABASE_URL": settings.database_dsn()}


def test_create_topics_makes_three_replicas_and_two_in_sync_and_a_dry_run_changes_nothing(
    kafka_cluster: KafkaCluster, database_url: str, capsys: pytest.CaptureFixture[str],
) -> None:
    settings = _settings(kafka_cluster, database_url, "admin")
    ours = own_topics(settings)
    admin = AdminClient(kafka_cluster.client_config())

    assert create_topics(settings, dry_run=True) == 0
    assert not set(ours) & set(admin.list_topics(timeout=10).topics)
    single = settings.model_copy(update={"topic_replication_factor": 1})
    assert create_topics(single) == 2  # refused on 3 brokers
    assert not set(ours) & set(admin.list_topics(timeout=10).topics)
    assert create_topics(settings) == 0

    out, err = capsys.readouterr()
    assert "cluster: 3 broker(s); our topics: 6 partitions, replication factor 3," \
           " min.insync.replicas 2" in out
    assert err == ("user-activity create-topics: replication factor 1 on a cluster of 3 brokers"
                   " loses data with one broker; pass --allow-single-replica to do it anyway\n")
    # created: known to every broker soon after (the one asked may not have applied it yet)
    wait_until(lambda: set(ours) <= set(admin.list_topics(timeout=10).topics), 30,
               "the new topics in the metadata")
    kafka_cluster.wait_leaders_available(ours)
    metadata = admin.list_topics(timeout=10).topics
    assert [sorted(len(p.replicas) for p in metadata[t].partitions.values()) for t in ours] == [
        [3] * 6] * 6 + [[3]]  # the progress topic: one partition
    # the broker asked may not have applied the new topics yet (UNKNOWN_TOPIC_OR_PART): asked again
    found: list[set[str] | None] = [None]

    def described() -> bool:
        found[0] = _min_insync(admin, ours)
        return found[0] is not None

    wait_until(described, 30, "the topics' configs")
    assert found[0] == {"2"}
    assert not set(input_topics(settings)) & set(metadata)

    kafka_cluster.stop(3)  # the metadata lists 2 brokers: still not a cluster for RF 1
    wait_until(lambda: len(admin.list_topics(timeout=10).brokers) == 2, 30, "node 3 gone")
    assert create_topics(settings, dry_run=True) == 0
    assert "cluster: 3 broker(s)" in capsys.readouterr().out


def _min_insync(admin: AdminClient, topics: list[str]) -> set[str] | None:
    """Each topic's ``min.insync.replicas``; None while a broker does not know one yet."""
    asked = admin.describe_configs([ConfigResource(ConfigResource.Type.TOPIC, t) for t in topics])
    try:
        return {f.result(10)["min.insync.replicas"].value for f in asked.values()}
    except KafkaException as exc:
        if exc.args[0].code() != KafkaError.UNKNOWN_TOPIC_OR_PART:
            raise
        return None


def _grants(settings: Settings) -> list[tuple[ResourceType, str, AclOperation]]:
    """Every ACL the job needs: READ on inputs, groups and the progress, WRITE on ours."""
    return [*((ResourceType.TOPIC, t, AclOperation.READ) for t in input_topics(settings)),
            *((ResourceType.GROUP, g, AclOperation.READ) for g in (
                settings.consumer_group_favorites, settings.consumer_group_session_linking)),
            *((ResourceType.TOPIC, t, AclOperation.WRITE) for t in own_topics(settings)),
            (ResourceType.TOPIC, settings.topic_outbox_progress, AclOperation.READ),
            (ResourceType.TRANSACTIONAL_ID, settings.outbox_transactional_id,
             AclOperation.WRITE)]


def test_check_as_a_principal_missing_exactly_one_acl_names_that_one_and_exits_non_zero(
    kafka_cluster: KafkaCluster, database_url: str,
) -> None:
    settings = _settings(kafka_cluster, database_url, "job")
    kafka_cluster.create_topics(settings.all_topics())
    for resource, name, operation in _grants(settings):
        kafka_cluster.grant("User:job", resource, name, operation)
    command = [sys.executable, "-m", "cli", "check", "--transactions"]

    complete = subprocess.run(command, cwd=ROOT, env=_env(settings), capture_output=True,
                              text=True, timeout=60, check=False)
    kafka_cluster.revoke("User:job", ResourceType.TOPIC, settings.topic_session_started,
                         AclOperation.WRITE)
    wait_until(lambda: not all(row[2] for row in check.kafka_rows(settings, check.FLOWS)), 10,
               "every broker applied the revoke")
    lacking = subprocess.run(command, cwd=ROOT, env=_env(settings), capture_output=True,
                             text=True, timeout=60, check=False)

    assert complete.returncode == 0, complete.stdout + complete.stderr[-2000:]
    assert complete.stdout.splitlines()[-1].startswith("complete")
    assert lacking.returncode == 2, lacking.stdout + lacking.stderr[-2000:]
    assert [line for line in lacking.stderr.splitlines() if line.startswith("user-activity")] == [
        f"user-activity check: topic {settings.topic_session_started}: no WRITE for this"
        " principal (not even DESCRIBE), or missing"]  # WRITE implied DESCRIBE
