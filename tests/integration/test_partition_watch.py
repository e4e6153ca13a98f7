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
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]
from prometheus_client import REGISTRY

from runtime.shutdown import SHUTDOWN
from sources.partition_watch import NO_AUTO_CREATE, PartitionWatch
from sources.topic_id import topic_id
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
