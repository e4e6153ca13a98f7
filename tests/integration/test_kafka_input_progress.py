"""The Kafka source, on a real broker: informational group commits, progress, a clean stop."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
from confluent_kafka import ConsumerGroupTopicPartitions, TopicPartition
from confluent_kafka.admin import AdminClient

from runtime.process import Process
from schemas.kafka_record import SourceRecord
from sources.kafka_input import KafkaInput
from sources.progress import INPUT_PROGRESS
from tests.conftest import SettingsFactory
from tests.support import Produced, produce

pytestmark = pytest.mark.integration


def _committed(settings_config: dict[str, Any], group: str, topic: str) -> int:
    admin = AdminClient(settings_config)
    request = ConsumerGroupTopicPartitions(group, [TopicPartition(topic, 0)])
    result = admin.list_consumer_group_offsets([request])[group].result(30)
    return int(result.topic_partitions[0].offset)


def test_snapshotted_offsets_are_committed_to_the_consumer_group_for_lag_tools(
    make_settings: SettingsFactory,
) -> None:
    settings = make_settings(tail=True)
    topic = settings.topic_favorite_added
    group = f"test-group-{uuid.uuid4().hex[:8]}"
    produce(settings, [Produced(topic, b"k", b"{}", partition=0) for _ in range(40)])
    source = KafkaInput(settings.kafka_client_config(), topic, process=Process(),
                        tail=True, batch_size=25,
                        consumer_group=group, flow="favorites")
    part = source.build_part("input", f"{topic}#0", None)
    try:
        seen = 0
        deadline = time.monotonic() + 30
        while seen < 25 and time.monotonic() < deadline:
            seen += sum(isinstance(i, SourceRecord) for i in part.next_batch())
        progress = {(p.topic, p.partition): p for p in INPUT_PROGRESS.partitions()}
        assert progress[(topic, 0)].next_offset == seen
        assert progress[(topic, 0)].behind() == 40 - seen
        assert progress[(topic, 0)].last_record_time is not None
        snapshot = part.snapshot()
        assert snapshot == seen
        deadline = time.monotonic() + 20
        while _committed(settings.kafka_client_config(), group, topic) != snapshot:
            assert time.monotonic() < deadline, "the snapshot was not committed to the group"
            part.next_batch()  # serves the commit callback (and reads on)
            time.sleep(0.2)
    finally:
        part.close()
    assert (topic, 0) not in {(p.topic, p.partition) for p in INPUT_PROGRESS.partitions()}


def test_a_requested_shutdown_ends_the_partition_at_its_next_poll(
    make_settings: SettingsFactory,
) -> None:
    settings = make_settings(tail=True)
    topic = settings.topic_favorite_added
    process = Process()
    part = KafkaInput(settings.kafka_client_config(), topic, process=process,
                      tail=True).build_part("input", f"{topic}#0", None)
    try:
        part.next_batch()
        process.stopping.request("test")
        with pytest.raises(StopIteration):
            part.next_batch()
    finally:
        part.close()
