"""Offsets no consumer is given (transaction markers, aborted records), on a real broker.

Producers with transactions (exactly-once producers, e.g. .NET's with a ``TransactionalId``)
leave a commit or abort marker after each transaction, and an aborted transaction's records are
never delivered (``read_committed``). A partition that ends on them is caught up: a bounded run
(``user-activity replay``) ends at the end offset it saw, and a tailed one shows no backlog.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import pytest
from confluent_kafka import TopicPartition
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
)
from prometheus_client import REGISTRY

from runtime.process import Process
from schemas.kafka_record import SourceRecord
from sources.kafka_input import KafkaInput, _KafkaPartition
from sources.progress import INPUT_PROGRESS
from sources.topic import cleanup_policy
from tests.conftest import SettingsFactory
from tests.support import Produced, produce, produce_in_transactions

pytestmark = pytest.mark.integration


def _write_transactions(settings: Any, topic: str, *, aborted_last: bool) -> int:
    """Five committed records on partition 0, then (``aborted_last``) three aborted ones.

    Offsets 0-4 the records, 5 the commit marker; then 6-8 the aborted records, 9 the abort
    marker. Returns the end offset (6 or 10). Nothing is written after them.
    """
    committed = [Produced(topic, str(i).encode(), b"{}", partition=0) for i in range(5)]
    aborted = [Produced(topic, f"aborted-{i}".encode(), b"{}", partition=0) for i in range(3)]
    produce_in_transactions(settings, [(committed, True)] + ([(aborted, False)] if aborted_last
                                                             else []))
    return 10 if aborted_last else 6


def _after_transactions(
    make_settings: SettingsFactory, last: str, *, tail: bool
) -> tuple[Any, int, str]:
    """Partition 0 of a topic written by :func:`_write_transactions`: (part, end, topic)."""
    settings = make_settings(tail=tail)
    topic = settings.topic_favorite_added
    end = _write_transactions(settings, topic, aborted_last=last == "aborted")
    part = KafkaInput(settings.kafka_client_config(), topic, process=Process(),
                      tail=tail, flow="favorites",
                      stuck_after=0).build_part("input", f"{topic}#0", None)
    return part, end, topic


def _read(part: Any, done: Callable[[list[int]], bool], what: str) -> tuple[list[int], bool]:
    """Poll ``part`` until ``done(offsets read)`` or its end; the offsets, and whether it ended."""
    records: list[int] = []
    deadline = time.monotonic() + 30
    while not done(records):
        assert time.monotonic() < deadline, f"{what}: read {records}, at {part.snapshot()}"
        try:
            batch = part.next_batch()
        except StopIteration:
            return records, True
        records += [item.offset for item in batch if isinstance(item, SourceRecord)]
        time.sleep(0.02)
    return records, False


@pytest.mark.parametrize("last", ["committed", "aborted"])
def test_a_bounded_partition_whose_last_offsets_are_never_delivered_ends_at_its_end(
    make_settings: SettingsFactory, last: str,
) -> None:
    part, end, _ = _after_transactions(make_settings, last, tail=False)
    try:
        records, ended = _read(part, lambda _: False, "the partition never ended")
        assert (records, ended) == ([0, 1, 2, 3, 4], True)
        assert part.snapshot() == end  # a resumed run starts at the end, not before it
    finally:
        part.close()


@pytest.mark.parametrize("last", ["committed", "aborted"])
def test_a_tailed_partition_ending_on_a_marker_is_caught_up(
    make_settings: SettingsFactory, last: str,
) -> None:
    """No record behind, no lag."""
    part, end, topic = _after_transactions(make_settings, last, tail=True)
    try:
        records, _ = _read(part, lambda _: part.snapshot() == end, "never caught up")
        part.next_batch()  # one more poll, with the high watermark known
        progress = {(p.topic, p.partition): p for p in INPUT_PROGRESS.partitions()}[(topic, 0)]
        assert records == [0, 1, 2, 3, 4]
        assert (progress.high_watermark, progress.next_offset) == (end, end)
        assert (progress.behind(), progress.lag(time.time())) == (0, 0.0)
    finally:
        part.close()


def _expired(topic: str) -> float:
    value = REGISTRY.get_sample_value("user_activity_input_records_expired_total",
                                      {"topic": topic, "partition": "0"})
    return value or 0.0


def test_records_deleted_before_they_were_read_are_counted_and_logged_as_expired(
    make_settings: SettingsFactory, caplog: pytest.LogCaptureFixture,
) -> None:
    """A job resumed past the topic's retention: its snapshot (5) is before the log start (12).

    The consumer goes on from the log start (nothing else can be read); the 7 records lost are
    counted and logged at ERROR, not skipped silently.
    """
    settings = make_settings(tail=True)
    topic = settings.topic_favorite_added
    produce(settings, [Produced(topic, str(i).encode(), b"{}", partition=0) for i in range(20)])
    admin = AdminClient(settings.kafka_client_config())
    [future] = admin.delete_records([TopicPartition(topic, 0, 12)]).values()
    assert future.result(30).low_watermark == 12
    part = KafkaInput(settings.kafka_client_config(), topic, process=Process(),
                      tail=True, flow="favorites",
                      stuck_after=0).build_part("input", f"{topic}#0", 5)
    try:
        records, _ = _read(part, lambda read: len(read) >= 8, "not read")
    finally:
        part.close()
    assert records == list(range(12, 20))
    assert _expired(topic) == 7
    [line] = [r for r in caplog.records if r.getMessage().startswith("input-records-expired")]
    assert line.levelno == logging.ERROR


def test_records_deleted_up_to_the_partitions_end_while_the_job_was_stopped_are_counted(
    make_settings: SettingsFactory, caplog: pytest.LogCaptureFixture,
) -> None:
    """Every record after the snapshot (5) deleted, none written since: log start = end = 20.

    No record arrives to show the gap: the partition sat at 5 (librdkafka's position is not
    moved by its offset reset), 15 records behind for ever, the loss uncounted. Now the 15 are
    counted and logged, the partition reads on from 20 and is not said behind.
    """
    settings = make_settings(tail=True)
    topic = settings.topic_favorite_added
    produce(settings, [Produced(topic, str(i).encode(), b"{}", partition=0) for i in range(20)])
    admin = AdminClient(settings.kafka_client_config())
    [future] = admin.delete_records([TopicPartition(topic, 0, 20)]).values()
    assert future.result(30).low_watermark == 20
    part = KafkaInput(settings.kafka_client_config(), topic, process=Process(),
                      tail=True, flow="favorites",
                      stuck_after=0).build_part("input", f"{topic}#0", 5)
    assert isinstance(part, _KafkaPartition)
    try:
        deadline = time.monotonic() + 30
        while (state := part.snapshot()) != 20 and not (isinstance(state, tuple)
                                                        and state[0] == 20):
            assert time.monotonic() < deadline, f"still at {part.snapshot()}"
            assert [i for i in part.next_batch() if isinstance(i, SourceRecord)] == []
            time.sleep(0.02)
        assert part._progress.behind() == 0
    finally:
        part.close()
    assert _expired(topic) == 15
    [line] = [r for r in caplog.records if r.getMessage().startswith("input-records-expired")]
    assert line.levelno == logging.ERROR


def test_a_resume_offset_past_the_partitions_end_reads_from_the_log_start_and_says_so(
    make_settings: SettingsFactory, caplog: pytest.LogCaptureFixture,
) -> None:
    """A snapshot (100) of a topic since deleted and created again with 5 records.

    The broker answers "offset out of range" and the consumer goes on from the log start: all
    5 records are read (none skipped), and the reset is logged once at ERROR, not silently.
    """
    settings = make_settings(tail=True)
    topic = settings.topic_favorite_added
    produce(settings, [Produced(topic, str(i).encode(), b"{}", partition=0) for i in range(5)])
    part = KafkaInput(settings.kafka_client_config(), topic, process=Process(),
                      tail=True, flow="favorites",
                      stuck_after=0).build_part("input", f"{topic}#0", 100)
    try:
        records, _ = _read(part, lambda read: len(read) >= 5, "not read")
        assert part.snapshot() == 5
    finally:
        part.close()
    assert records == [0, 1, 2, 3, 4]
    [line] = [r for r in caplog.records if r.getMessage().startswith("input-offset-reset")]
    assert line.levelno == logging.ERROR
    assert (line.expected_offset, line.got_offset) == (100, 0)  # type: ignore[attr-defined]


def test_a_compacted_input_topic_is_said_at_start(
    make_settings: SettingsFactory, caplog: pytest.LogCaptureFixture,
) -> None:
    # Records compacted away before they are read leave gaps like transaction markers: they
    # were lost with /readyz 200, no metric and no line (found by a review helper).
    caplog.set_level(logging.INFO, logger="sources.kafka_input")
    settings = make_settings()
    compacted, kept = settings.topic_user_signed_in, settings.topic_favorite_added
    admin = AdminClient(settings.kafka_client_config())
    resource = ConfigResource("topic", compacted, incremental_configs=[ConfigEntry(
        "cleanup.policy", "compact", incremental_operation=AlterConfigOpType.SET)])
    admin.incremental_alter_configs([resource])[resource].result(15)
    deadline = time.monotonic() + 15
    while cleanup_policy(admin, compacted) != "compact":  # the broker applies it a moment later
        assert time.monotonic() < deadline, "the topic's cleanup.policy was not changed"
        time.sleep(0.2)

    for topic in (compacted, kept):
        assert KafkaInput(settings.kafka_client_config(), topic, process=Process(),
                          tail=False).list_parts()

    gauge = "user_activity_input_topic_compacted"
    assert REGISTRY.get_sample_value(gauge, {"topic": compacted}) == 1
    assert REGISTRY.get_sample_value(gauge, {"topic": kept}) == 0
    [line] = [r for r in caplog.records if r.getMessage() == "input-topic-compacted"]
    assert (line.levelno, line.topic) == (logging.ERROR, compacted)  # type: ignore[attr-defined]
