"""An input topic deleted while the job runs is said (real broker).

Its consumers read nothing and report no error after the delete, and the high watermark they
know stays frozen, so no lag gauge moves: the partition watch's periodic metadata request is
what sees it (``user_activity_input_topic_unavailable`` 1, one ERROR line) and sees it back.
"""

from __future__ import annotations

import logging
import time

import pytest
from confluent_kafka import KafkaException
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    NewTopic,
)
from prometheus_client import REGISTRY

from runtime.shutdown import SHUTDOWN
from sources.partition_watch import NO_AUTO_CREATE, PartitionWatch
from sources.topic_id import cleanup_policy, topic_id
from tests.conftest import SettingsFactory
from tests.support import recreate_topic

pytestmark = pytest.mark.integration


def _gauge(topic: str) -> float | None:
    return REGISTRY.get_sample_value("user_activity_input_topic_unavailable", {"topic": topic})


def _lines(caplog: pytest.LogCaptureFixture, event: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.getMessage().startswith(event)]


def _tick_until(watch: PartitionWatch, topic: str, value: float) -> None:
    deadline = time.monotonic() + 20
    while _gauge(topic) != value:
        assert time.monotonic() < deadline, f"gauge {_gauge(topic)}, expected {value}"
        assert watch.tick()
        time.sleep(0.2)


def test_a_deleted_input_topic_turns_the_gauge_on_logs_once_and_off_when_it_is_back(
    make_settings: SettingsFactory, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="sources.partition_watch")
    settings = make_settings()
    topic = settings.topic_favorite_added
    admin = AdminClient({**settings.kafka_client_config(), **NO_AUTO_CREATE})  # as the job's
    watch = PartitionWatch(admin, 60)
    watch.listed(topic, 6)
    assert watch.tick()
    assert _gauge(topic) == 0

    admin.delete_topics([topic])[topic].result()
    _tick_until(watch, topic, 1)
    assert watch.tick()  # still gone: no second line
    [line] = _lines(caplog, "input-topic-unavailable")
    assert line.levelno == logging.ERROR
    assert line.error == "UNKNOWN_TOPIC_OR_PART"  # type: ignore[attr-defined]

    deadline = time.monotonic() + 20
    while True:  # the delete finishes asynchronously: create again once it did
        try:
            admin.create_topics([NewTopic(topic, 6, 1)])[topic].result()
            break
        except KafkaException:
            assert time.monotonic() < deadline
            time.sleep(0.5)
    _tick_until(watch, topic, 0)
    assert len(_lines(caplog, "input-topic-available")) == 1
    assert len(_lines(caplog, "input-topic-unavailable")) == 1


def test_an_input_topic_deleted_and_created_again_is_said_and_the_job_restarts(
    make_settings: SettingsFactory, caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Created again between two checks, its partition count is the same: only its id tells.
    caplog.set_level(logging.INFO, logger="sources.partition_watch")
    restarts: list[str] = []
    monkeypatch.setattr(SHUTDOWN, "restart", restarts.append)
    settings = make_settings()
    topic = settings.topic_favorite_added
    admin = AdminClient({**settings.kafka_client_config(), **NO_AUTO_CREATE})
    watch = PartitionWatch(admin, 60)
    watch.listed(topic, 6, topic_id(admin, topic))
    assert watch.tick() and restarts == []

    recreate_topic(admin, topic, 6)

    deadline = time.monotonic() + 20
    while watch.tick():  # its partitions may have no leader for a moment
        assert time.monotonic() < deadline, "the topic created again was not seen"
        time.sleep(0.2)
    assert restarts == [f"{topic} was deleted and created again"]
    [line] = _lines(caplog, "input-topic-recreated")
    assert line.levelno == logging.ERROR


def _set_cleanup_policy(admin: AdminClient, topic: str, policy: str) -> None:
    resource = ConfigResource("topic", topic, incremental_configs=[ConfigEntry(
        "cleanup.policy", policy, incremental_operation=AlterConfigOpType.SET)])
    admin.incremental_alter_configs([resource])[resource].result(15)
    deadline = time.monotonic() + 15
    while cleanup_policy(admin, topic) != policy:  # the broker applies it a moment later
        assert time.monotonic() < deadline, f"{topic}'s cleanup.policy did not become {policy}"
        time.sleep(0.2)


def test_an_input_topic_made_compacted_while_the_job_runs_is_said_once_and_unsaid(
    make_settings: SettingsFactory, caplog: pytest.LogCaptureFixture,
) -> None:
    """A topic made compacted while the job runs is said by the next check, and unsaid.

    The compaction check ran at start only: a topic made compacted later lost unread events
    with no gauge and no line until the next restart.
    """
    caplog.set_level(logging.INFO, logger="sources.partition_watch")
    settings = make_settings()
    topic = settings.topic_favorite_added
    admin = AdminClient({**settings.kafka_client_config(), **NO_AUTO_CREATE})
    watch = PartitionWatch(admin, 60)
    watch.listed(topic, 6)
    gauge = "user_activity_input_topic_compacted"
    assert watch.tick()
    assert REGISTRY.get_sample_value(gauge, {"topic": topic}) == 0

    _set_cleanup_policy(admin, topic, "compact")
    assert watch.tick()
    assert watch.tick()  # still compacted: no second line
    assert REGISTRY.get_sample_value(gauge, {"topic": topic}) == 1
    [line] = _lines(caplog, "input-topic-compacted")
    assert (line.levelno, line.cleanup_policy) == (logging.ERROR, "compact")  # type: ignore[attr-defined]

    _set_cleanup_policy(admin, topic, "delete")
    assert watch.tick()
    assert REGISTRY.get_sample_value(gauge, {"topic": topic}) == 0
    assert len(_lines(caplog, "input-topic-not-compacted")) == 1
    assert len(_lines(caplog, "input-topic-compacted")) == 1
