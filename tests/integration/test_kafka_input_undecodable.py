"""A record batch the consumer cannot decompress never stops its partition (real broker).

The broker checks a compressed batch's size against the topic's limit, so a highly compressible
record of many MB (zeros, zstd) is accepted; the consumer then refuses the batch, decompressed
larger than ``receive.message.max.bytes`` (here ``source_receive_max_bytes`` = 2 MB), and
librdkafka would fetch it again forever. The input finds where the batch ends, counts and logs
the records it skips, and reads on after it: every record around the batch is read.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest
from prometheus_client import REGISTRY

from runtime.process import Process
from runtime.settings import Settings
from schemas.kafka_record import ConsumerError, SourceRecord
from sources.kafka_input import KafkaInput
from tests.conftest import SettingsFactory
from tests.support import Produced, produce

pytestmark = pytest.mark.integration

LIMIT = 2_000_000
"""The input's ``source_receive_max_bytes`` in these tests."""
BIG = {"compression_type": "zstd", "message_max_bytes": 100_000_000}
"""A producer that sends records of up to 100 MB (zstd: a few KB on the wire)."""


def _skipped(topic: str) -> float:
    return REGISTRY.get_sample_value(
        "user_activity_input_records_undecodable_total", {"topic": topic, "partition": "0"}
    ) or 0.0


def _partition(settings: Settings, resume: int | None, stuck_after: float = 0) -> Any:
    """Partition 0 of the favorite-added topic, tailed, with the tests' receive limit."""
    topic = settings.topic_favorite_added
    return KafkaInput(settings.kafka_client_config(), topic, process=Process(),
                      tail=True, flow="favorites",
                      stuck_after=stuck_after, receive_max_bytes=LIMIT).build_part(
        "input", f"{topic}#0", resume)


def _read_all(part: Any, count: int) -> tuple[list[int], list[ConsumerError]]:
    """Poll ``part`` until ``count`` records were read (30 s at most)."""
    records: list[int] = []
    errors: list[ConsumerError] = []
    deadline = time.monotonic() + 30
    while len(records) < count:
        assert time.monotonic() < deadline, (
            f"read {records}; {len(errors)} consumer errors, the first {errors[:1]}")
        batch = part.next_batch()
        records += [item.offset for item in batch if isinstance(item, SourceRecord)]
        errors += [item for item in batch if isinstance(item, ConsumerError)]
        time.sleep(0.02)
    return records, errors


def _undecodable_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.getMessage().startswith("input-records-undecodable")]


@pytest.mark.parametrize("batched", [1, 30], ids=["one-record", "a-batch-of-30"])
def test_a_batch_larger_than_the_limit_once_decompressed_is_skipped_said_and_the_rest_read(
    make_settings: SettingsFactory, caplog: pytest.LogCaptureFixture, batched: int,
) -> None:
    """Offsets: 0 and 1 readable; 2 .. 2+batched-1 one batch of 5 MB decompressed; 2 more after.

    ``batched`` records of zeros (5 MB in all) are sent in one batch (``linger.ms``, a large
    ``batch.size``), so finding the batch's end takes several probes.
    """
    settings = make_settings(tail=True, source_receive_max_bytes=LIMIT)
    topic = settings.topic_favorite_added
    produce(settings, [Produced(topic, str(i).encode(), b"{}", partition=0) for i in range(2)])
    size = 5_000_000 // batched
    produce(settings, [Produced(topic, b"big", bytes(size), partition=0)] * batched,
            linger_ms=500, batch_size=200_000_000, **BIG)
    produce(settings, [Produced(topic, str(i).encode(), b"{}", partition=0) for i in range(2)])
    after = 2 + batched
    part = _partition(settings, None)
    before = _skipped(topic)
    try:
        records, errors = _read_all(part, 4)
        assert part.snapshot() == after + 2
    finally:
        part.close()
    assert records == [0, 1, after, after + 1]  # nothing before or after the batch is lost
    assert errors == []  # the batch's error is not also passed on as a consumer error
    assert _skipped(topic) - before == batched
    [line] = _undecodable_lines(caplog)
    assert line.levelno == logging.ERROR
    assert (line.from_offset, line.to_offset, line.records) == (2, after, batched)  # type: ignore[attr-defined]


def test_a_resumed_partition_whose_next_batch_is_undecodable_skips_it_and_reads_on(
    make_settings: SettingsFactory, caplog: pytest.LogCaptureFixture,
) -> None:
    """Resumed at the bad batch (offset 0, the first record), with nothing after it at first.

    The batch reaches the high watermark, so its end is the watermark; a record produced
    afterwards is read.
    """
    settings = make_settings(tail=True, source_receive_max_bytes=LIMIT)
    topic = settings.topic_favorite_added
    produce(settings, [Produced(topic, b"big", bytes(3_000_000), partition=0)], **BIG)
    part = _partition(settings, 0)
    try:
        deadline = time.monotonic() + 30
        while part.snapshot() != 1:
            assert time.monotonic() < deadline, f"at {part.snapshot()}"
            assert not [i for i in part.next_batch() if isinstance(i, SourceRecord)]
            time.sleep(0.02)
        produce(settings, [Produced(topic, b"k", b"{}", partition=0)])
        records, _ = _read_all(part, 1)
    finally:
        part.close()
    assert records == [1]
    [line] = _undecodable_lines(caplog)
    assert (line.from_offset, line.to_offset) == (0, 1)  # type: ignore[attr-defined]


def test_two_undecodable_batches_in_a_row_are_each_skipped_and_the_rest_read(
    make_settings: SettingsFactory, caplog: pytest.LogCaptureFixture,
) -> None:
    """Offsets: 0 readable; 1 and 2 two batches of one record each, 3 MB decompressed; 3 after.

    The probe of the first batch, asking from offset 2, gets the second batch's error: that
    error is past the first batch, not inside it.
    """
    settings = make_settings(tail=True, source_receive_max_bytes=LIMIT)
    topic = settings.topic_favorite_added
    produce(settings, [Produced(topic, b"0", b"{}", partition=0)])
    for _ in range(2):  # one produce call each: two batches
        produce(settings, [Produced(topic, b"big", bytes(3_000_000), partition=0)], **BIG)
    produce(settings, [Produced(topic, b"3", b"{}", partition=0)])
    part = _partition(settings, None)
    before = _skipped(topic)
    try:
        records, errors = _read_all(part, 2)
        assert part.snapshot() == 4
    finally:
        part.close()
    assert records == [0, 3]
    assert errors == []
    assert _skipped(topic) - before == 2
    lines = _undecodable_lines(caplog)
    assert [(r.from_offset, r.to_offset) for r in lines] == [(1, 2), (2, 3)]  # type: ignore[attr-defined]


def test_skipping_a_batch_after_a_quiet_spell_does_not_look_like_a_stuck_consumer(
    make_settings: SettingsFactory, caplog: pytest.LogCaptureFixture,
) -> None:
    """The partition read nothing for longer than ``stuck_after``, then a bad batch comes.

    Skipping it is progress: the consumer is not taken for stuck (no restart).
    """
    settings = make_settings(tail=True, source_receive_max_bytes=LIMIT)
    topic = settings.topic_favorite_added
    produce(settings, [Produced(topic, b"big", bytes(3_000_000), partition=0)], **BIG)
    produce(settings, [Produced(topic, b"k", b"{}", partition=0)])
    part = _partition(settings, 0, stuck_after=2.0)
    time.sleep(3)  # the consumer fetches the batch's error meanwhile: the first poll has it
    part._read_at -= 60  # a minute without a record,
    part._stuck_check_at = 0  # and a stuck check due
    try:
        records, _ = _read_all(part, 1)
    finally:
        part.close()
    assert records == [1]
    assert not part._src.process.stopping.requested()
    assert [r for r in caplog.records if r.getMessage() == "kafka-consumer-stuck"] == []
