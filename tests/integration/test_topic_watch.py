"""The periodic check of an input topic (:class:`sources.topic.TopicWatch`), on a real broker.

A deleted topic's consumers read nothing and report no error, and no lag gauge moves: the
check sees it (``user_activity_input_topic_unavailable`` 1, ``/readyz``, one ERROR line) and
sees it back; a topic made again asks for a restart; a topic made compacted is said.
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
    NewPartitions,
    NewTopic,
)
from prometheus_client import REGISTRY

from runtime.process import Process
from runtime.shutdown import Shutdown
from sources.topic import NO_AUTO_CREATE, TopicWatch, cleanup_policy, topic_id
from tests.conftest import SettingsFactory
from tests.support import recreate_topic

pytestmark = pytest.mark.integration


def _gauge(topic: str) -> float | None:
    return REGISTRY.get_sample_value("user_activity_input_topic_unavailable", {"topic": topic})


def _lines(caplog: pytest.LogCaptureFixture, event: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.getMessage().startswith(event)]


class _Restarts(Shutdown):
    """A stop request that only records restarts."""

    def __init__(self) -> None:
        super().__init__()
        self.reasons: list[str] = []

    def restart(self, reason: str) -> None:
        self.reasons.append(reason)


def _watch(admin: AdminClient, topic: str, known_id: str | None = None,
           stopping: Shutdown | None = None, process: Process | None = None) -> TopicWatch:
    return TopicWatch(admin, topic, partitions=6, known_id=known_id, interval=0.01,
                      process=process or Process(stopping=stopping or _Restarts()))


def _tick(watch: TopicWatch) -> None:
    """One whole check: asked, then answered (as polls would do)."""
    time.sleep(0.02)
    watch.check()  # asks
    deadline = time.monotonic() + 15
    while watch._asked is not None:
        assert time.monotonic() < deadline, "no answer"
        time.sleep(0.01)
        watch.check()


def _tick_until(watch: TopicWatch, topic: str, value: float) -> None:
    deadline = time.monotonic() + 20
    while _gauge(topic) != value:
        assert time.monotonic() < deadline, f"gauge {_gauge(topic)}, expected {value}"
        _tick(watch)
        time.sleep(0.2)


def test_a_deleted_input_topic_turns_the_gauge_on_logs_once_and_off_when_it_is_back(
    make_settings: SettingsFactory, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="sources.topic")
    settings = make_settings()
    topic = settings.topic_favorite_added
    admin = AdminClient({**settings.kafka_client_config(), **NO_AUTO_CREATE})  # as the job's
    process = Process(stopping=_Restarts())
    watch = _watch(admin, topic, process=process)
    _tick(watch)
    assert _gauge(topic) == 0

    admin.delete_topics([topic])[topic].result()
    _tick_until(watch, topic, 1)
    _tick(watch)  # still gone: no second line
    [line] = _lines(caplog, "input-topic-unavailable")
    assert line.levelno == logging.ERROR
    assert line.error == "UNKNOWN_TOPIC_OR_PART"  # type: ignore[attr-defined]
    assert dict(process.health.snapshot().stalled) == {
        f"input {topic}": "the broker answers UNKNOWN_TOPIC_OR_PART: none of its records are read"}

    deadline = time.monotonic() + 20
    while True:  # the delete finishes asynchronously: create again once it did
        try:
            admin.create_topics([NewTopic(topic, 6, 1)])[topic].result()
            break
        except KafkaException:
            assert time.monotonic() < deadline
            time.sleep(0.5)
    _tick_until(watch, topic, 0)
    assert process.health.snapshot().state == "running"
    assert len(_lines(caplog, "input-topic-available")) == 1
    assert len(_lines(caplog, "input-topic-unavailable")) == 1


def test_an_input_topic_deleted_and_created_again_is_said_and_the_job_restarts(
    make_settings: SettingsFactory, caplog: pytest.LogCaptureFixture,
) -> None:
    # Created again between two checks, its partition count is the same: only its id tells.
    caplog.set_level(logging.INFO, logger="sources.topic")
    settings = make_settings()
    topic = settings.topic_favorite_added
    admin = AdminClient({**settings.kafka_client_config(), **NO_AUTO_CREATE})
    stopping = _Restarts()
    watch = _watch(admin, topic, topic_id(admin, topic), stopping)
    _tick(watch)
    assert stopping.reasons == []

    recreate_topic(admin, topic, 6)

    deadline = time.monotonic() + 20
    while not stopping.reasons:  # its partitions may have no leader for a moment
        assert time.monotonic() < deadline, "the topic created again was not seen"
        _tick(watch)
        time.sleep(0.2)
    _tick(watch)  # no more checks once a restart is asked for
    assert stopping.reasons == [f"{topic} was deleted and created again"]
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
    caplog.set_level(logging.INFO, logger="sources.topic")
    settings = make_settings()
    topic = settings.topic_favorite_added
    admin = AdminClient({**settings.kafka_client_config(), **NO_AUTO_CREATE})
    watch = _watch(admin, topic)
    gauge = "user_activity_input_topic_compacted"
    _tick(watch)
    assert REGISTRY.get_sample_value(gauge, {"topic": topic}) == 0

    _set_cleanup_policy(admin, topic, "compact")
    _tick(watch)
    _tick(watch)  # still compacted: no second line
    assert REGISTRY.get_sample_value(gauge, {"topic": topic}) == 1
    [line] = _lines(caplog, "input-topic-compacted")
    assert (line.levelno, line.cleanup_policy) == (logging.ERROR, "compact")  # type: ignore[attr-defined]

    _set_cleanup_policy(admin, topic, "delete")
    _tick(watch)
    assert REGISTRY.get_sample_value(gauge, {"topic": topic}) == 0
    assert len(_lines(caplog, "input-topic-not-compacted")) == 1
    assert len(_lines(caplog, "input-topic-compacted")) == 1


def test_partitions_added_to_an_input_topic_ask_for_a_restart(
    make_settings: SettingsFactory, caplog: pytest.LogCaptureFixture,
) -> None:
    settings = make_settings()
    topic = settings.topic_favorite_added
    admin = AdminClient({**settings.kafka_client_config(), **NO_AUTO_CREATE})
    stopping = _Restarts()
    watch = _watch(admin, topic, topic_id(admin, topic), stopping)
    _tick(watch)
    admin.create_partitions([NewPartitions(topic, 8)])[topic].result(30)
    deadline = time.monotonic() + 20
    while not stopping.reasons:
        assert time.monotonic() < deadline, "the added partitions were not seen"
        _tick(watch)
    assert stopping.reasons == [f"{topic} has 8 partitions, 6 are read"]
    [line] = _lines(caplog, "kafka-partitions-added")
    assert (line.reading, line.partitions) == (6, 8)  # type: ignore[attr-defined]
