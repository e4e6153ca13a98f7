"""An input topic missing when the job starts (:class:`sources.kafka_input.KafkaInput`).

Bytewax 0.21.1 panics on an input with no partition at all and on a stored partition the source
does not list: a missing topic lists partition 0 and the stored ones, each read by a placeholder
that reads nothing and keeps its snapshot. Partition 0's polls ask for the topic at back-off
steps; its appearance asks for a restart. A bounded run ends it at once.
"""

from __future__ import annotations

import time
import uuid

import pytest
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]
from prometheus_client import REGISTRY

from runtime.backoff import Backoff
from runtime.process import Process
from runtime.shutdown import Shutdown
from sources.kafka_input import KafkaInput
from tests.conftest import SettingsFactory

pytestmark = pytest.mark.integration


class _Restarts(Shutdown):
    """A stop request that only records restarts."""

    def __init__(self) -> None:
        super().__init__()
        self.reasons: list[str] = []

    def restart(self, reason: str) -> None:
        self.reasons.append(reason)


def _unavailable(topic: str) -> float | None:
    return REGISTRY.get_sample_value("user_activity_input_topic_unavailable", {"topic": topic})


def test_a_missing_topic_lists_partition_0_and_its_stored_partitions_each_keeping_its_snapshot(
    make_settings: SettingsFactory,
) -> None:
    settings = make_settings()
    topic = f"{settings.topic_favorite_added}.{uuid.uuid4().hex[:6]}"
    stored = [f"{topic}#3", f"{topic}#0", f"{settings.topic_favorite_added}#5"]
    source = KafkaInput(settings.kafka_client_config(), topic, process=Process(), tail=True,
                        stored_keys=lambda: stored)

    assert source.list_parts() == [f"{topic}#0", f"{topic}#3"]
    part = source.build_part("input", f"{topic}#3", (42, "an-old-topic-id"))
    assert part.next_batch() == []
    assert part.snapshot() == (42, "an-old-topic-id")
    assert source.build_part("input", f"{topic}#0", None).snapshot() is None
    assert _unavailable(topic) == 1


def test_a_missing_topic_is_named_and_its_appearance_asks_for_a_restart(
    make_settings: SettingsFactory,
) -> None:
    settings = make_settings()
    topic = f"{settings.topic_favorite_added}.{uuid.uuid4().hex[:6]}"
    stopping = _Restarts()
    process = Process(stopping=stopping)
    source = KafkaInput(settings.kafka_client_config(), topic, process=process, tail=True,
                        backoff=Backoff(0.1, 0.2))
    [key] = source.list_parts()
    part = source.build_part("input", key, None)
    assert part.next_batch() == []
    snap = process.health.snapshot()
    assert (snap.state, dict(snap.stalled)) == ("stalled", {
        f"input {topic}": "the broker answers UNKNOWN_TOPIC_OR_PART: none of its records are"
                          " read (exit 75 once it exists)"})

    admin = AdminClient(settings.kafka_client_config())
    admin.create_topics([NewTopic(topic, 2, 1)])[topic].result(30)
    deadline = time.monotonic() + 30
    while not stopping.reasons:
        assert time.monotonic() < deadline, "the topic made was not seen"
        assert part.next_batch() == []
        time.sleep(0.05)
    assert stopping.reasons == [f"{topic} exists now: a restart reads it"]
    assert _unavailable(topic) == 0
    assert process.health.snapshot().state == "running"


def test_a_bounded_run_ends_a_missing_topic_at_once(make_settings: SettingsFactory) -> None:
    settings = make_settings()
    topic = f"{settings.topic_favorite_added}.{uuid.uuid4().hex[:6]}"
    source = KafkaInput(settings.kafka_client_config(), topic, process=Process(), tail=False)
    [key] = source.list_parts()

    with pytest.raises(StopIteration):
        source.build_part("input", key, None).next_batch()
