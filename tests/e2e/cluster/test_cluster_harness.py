"""The 3-node cluster harness on real brokers: replication, failover after SIGKILL, ACLs."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AclOperation,
    AdminClient,
    ConfigResource,
    ResourceType,
)

from devenv.kafka_cluster import KafkaCluster

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("kafka-cluster")]


def _topic() -> str:
    return f"cluster-{uuid.uuid4().hex[:10]}"


def _produce(producer: Producer, topic: str, count: int, tag: str) -> list[KafkaError | None]:
    """Send ``count`` records to partition 0 of ``topic``; each one's delivery error (or None)."""
    results: list[KafkaError | None] = []
    for i in range(count):
        producer.produce(topic, f"{tag}-{i}".encode(), partition=0,
                         on_delivery=lambda err, _msg: results.append(err))
    assert producer.flush(30) == 0, "records still in flight after 30 s"
    return results


def _producer(config: dict[str, Any], *, idempotent: bool = True) -> Producer:
    """acks=all; idempotent ones need a WRITE on some topic to start (InitProducerId)."""
    return Producer({**config, "acks": "all", "enable.idempotence": idempotent, "linger.ms": 5})


def _values(config: dict[str, Any], topic: str, expected: int) -> list[bytes]:
    """The values in partition 0 of ``topic``, read from the start until ``expected`` came."""
    consumer = Consumer({**config, "group.id": f"g-{uuid.uuid4().hex[:8]}",
                         "enable.auto.commit": False})
    consumer.assign([TopicPartition(topic, 0, 0)])
    values: list[bytes] = []
    deadline = time.monotonic() + 30
    try:
        while len(values) < expected and time.monotonic() < deadline:
            for msg in consumer.consume(expected - len(values), timeout=0.5):
                assert msg.error() is None, msg.error()
                value = msg.value()
                assert isinstance(value, bytes)
                values.append(value)
    finally:
        consumer.close()
    return values


def test_topics_get_three_replicas_and_two_in_sync_minimum_and_take_acks_all_writes(
        kafka_cluster: KafkaCluster) -> None:
    topic = _topic()
    kafka_cluster.create_topics([topic], partitions=3)
    admin = AdminClient(kafka_cluster.client_config())

    partitions = admin.list_topics(topic, timeout=10).topics[topic].partitions.values()
    config = admin.describe_configs([ConfigResource(ConfigResource.Type.TOPIC, topic)])
    entries = next(iter(config.values())).result(10)

    assert [sorted(p.replicas) for p in partitions] == [[1, 2, 3]] * 3
    assert [sorted(p.isrs) for p in partitions] == [[1, 2, 3]] * 3
    assert entries["min.insync.replicas"].value == "2"
    assert entries["unclean.leader.election.enable"].value == "false"
    assert _produce(_producer(kafka_cluster.client_config()), topic, 100, "a") == [None] * 100
    assert len(_values(kafka_cluster.client_config(), topic, 100)) == 100


def test_a_sigkilled_leader_hands_over_and_rejoins_the_isr_after_restart(
        kafka_cluster: KafkaCluster) -> None:
    topic = _topic()
    kafka_cluster.create_topics([topic], partitions=3)
    producer = _producer(kafka_cluster.client_config())
    assert _produce(producer, topic, 50, "before") == [None] * 50
    leader = kafka_cluster.leader_of(topic, 0)

    kafka_cluster.kill(leader)
    failover = kafka_cluster.wait_leaders_available([topic], timeout=30)
    new_leader = kafka_cluster.leader_of(topic, 0)
    during = _produce(producer, topic, 50, "during")
    began = time.monotonic()
    kafka_cluster.start(leader)
    restart = time.monotonic() - began
    isr_full = kafka_cluster.wait_isr_full([topic], timeout=60)
    print(f"leader {leader} SIGKILLed: partitions led elsewhere after {failover:.2f}s; "
          f"restart {restart:.2f}s, ISR full {isr_full:.2f}s later")

    assert new_leader in set(kafka_cluster.nodes) - {leader}
    assert during == [None] * 50  # acks=all with 2 of 3 replicas in sync: still accepted
    values = _values(kafka_cluster.client_config(), topic, 100)
    assert values == [f"before-{i}".encode() for i in range(50)] + [
        f"during-{i}".encode() for i in range(50)]


def test_a_user_without_write_is_refused_until_granted_and_again_once_revoked(
        kafka_cluster: KafkaCluster) -> None:
    topic = _topic()
    kafka_cluster.create_topics([topic], partitions=1)
    job = kafka_cluster.client_config("job")

    refused = _produce(_producer(job, idempotent=False), topic, 1, "refused")
    kafka_cluster.grant("User:job", ResourceType.TOPIC, topic, AclOperation.WRITE)
    granted = _produce(_producer(job, idempotent=False), topic, 1, "granted")
    kafka_cluster.revoke("User:job", ResourceType.TOPIC, topic, AclOperation.WRITE)
    revoked = _produce(_producer(job, idempotent=False), topic, 1, "revoked")

    assert [e and e.code() for e in refused] == [KafkaError.TOPIC_AUTHORIZATION_FAILED]
    assert granted == [None]
    assert [e and e.code() for e in revoked] == [KafkaError.TOPIC_AUTHORIZATION_FAILED]


def test_a_frozen_leader_is_fenced_and_rejoins_the_isr_once_thawed(
        kafka_cluster: KafkaCluster) -> None:
    topic = _topic()
    kafka_cluster.create_topics([topic], partitions=3)
    leader = kafka_cluster.leader_of(topic, 0)

    kafka_cluster.freeze(leader)
    fenced = kafka_cluster.wait_leaders_available([topic], timeout=30)
    new_leader = kafka_cluster.leader_of(topic, 0)
    kafka_cluster.thaw(leader)
    isr_full = kafka_cluster.wait_isr_full([topic], timeout=60)
    print(f"leader {leader} SIGSTOPped: partitions led elsewhere after {fenced:.2f}s; "
          f"thawed, ISR full {isr_full:.2f}s later")

    assert new_leader in set(kafka_cluster.nodes) - {leader}
