"""One consumer per worker (:mod:`sources.consumer`): its partitions still read exactly.

Each test builds several partitions of two topics on this thread, as a Bytewax worker does,
and reads them the way Bytewax polls them: round robin, one ``next_batch`` each.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from runtime.backoff import Backoff
from runtime.process import Process
from schemas.kafka_record import SourceRecord
from sources.kafka_input import KafkaInput, _KafkaPartition
from tests.conftest import SettingsFactory
from tests.support import Produced, produce

pytestmark = pytest.mark.integration


def _parts(settings: Any, topics: list[str], partitions: range, **options: Any) -> list[Any]:
    return [
        KafkaInput(settings.kafka_client_config(), topic, tail=True,
                   **{"process": Process(), **options}).build_part(
            "input", f"{topic}#{p}", None)
        for topic in topics for p in partitions
    ]


@contextmanager
def _open_parts(settings: Any, topics: list[str], partitions: range,
                **options: Any) -> Iterator[list[Any]]:
    """:func:`_parts`, closed at the end."""
    parts = _parts(settings, topics, partitions, **options)
    try:
        yield parts
    finally:
        for part in parts:
            part.close()


def _values(topic: str, partition: int, count: int, start: int = 0) -> list[Produced]:
    return [Produced(topic, b"k", f"{topic}/{partition}/{i}".encode(), partition=partition)
            for i in range(start, start + count)]


def _read_round_robin(
    parts: list[Any], want: int, seconds: float,
) -> dict[tuple[str, int], list[Any]]:
    """Poll every part in turn until ``want`` records came in all; records per partition."""
    got: dict[tuple[str, int], list[Any]] = {(p.topic, p.partition): [] for p in parts}
    deadline = time.monotonic() + seconds
    while sum(map(len, got.values())) < want and time.monotonic() < deadline:
        for part in parts:
            got[part.topic, part.partition] += [
                item for item in part.next_batch() if isinstance(item, SourceRecord)]
        time.sleep(0.005)
    return got


def test_partitions_of_a_worker_share_one_consumer_and_each_reads_only_its_own_in_order(
    make_settings: SettingsFactory,
) -> None:
    settings = make_settings(tail=True)
    topics = [settings.topic_favorite_added, settings.topic_favorite_removed]
    with _open_parts(settings, topics, range(3), batch_size=7) as parts:
        assert len({id(p._consumer) for p in parts}) == 1, "one consumer for the worker"
        produce(settings, [r for t in topics for p in range(3) for r in _values(t, p, 40)])
        got = _read_round_robin(parts, 6 * 40, 30)
        for (topic, partition), records in got.items():
            assert [r.offset for r in records] == list(range(40)), (topic, partition)
            assert {(r.topic, r.partition) for r in records} == {(topic, partition)}
            assert [r.value for r in records] == [v.value for v in _values(topic, partition, 40)]
        assert all(p.snapshot() == 40 for p in parts)


def test_a_partition_that_leaves_does_not_stop_the_others_and_the_last_one_closes_the_consumer(
    make_settings: SettingsFactory,
) -> None:
    settings = make_settings(tail=True)
    topic = settings.topic_favorite_added
    parts = _parts(settings, [topic], range(2))
    shared = parts[0]._shared
    try:
        produce(settings, [r for p in range(2) for r in _values(topic, p, 10)])
        assert sum(map(len, _read_round_robin(parts, 20, 30).values())) == 20
        parts[0].close()
        produce(settings, [r for p in range(2) for r in _values(topic, p, 10, start=10)])
        got = _read_round_robin(parts[1:], 10, 30)
        assert [r.offset for r in got[topic, 1]] == list(range(10, 20))
        # A partition built again after leaving (a later run in this process) reads on from
        # its snapshot, from the same consumer while another partition still holds it.
        again = KafkaInput(settings.kafka_client_config(), topic, process=Process(),
                           tail=True).build_part(
            "input", f"{topic}#0", 10)
        assert isinstance(again, _KafkaPartition) and again._shared is shared
        assert [r.offset for r in _read_round_robin([again], 10, 30)[topic, 0]] == list(
            range(10, 20))
        again.close()
    finally:
        parts[1].close()
    assert shared.users == set()
    with _open_parts(settings, [topic], range(1)) as fresh:
        assert fresh[0]._shared is not shared, "the last partition leaving forgot the consumer"


def test_one_partition_with_a_backlog_does_not_fill_the_buffers_without_bound(
    make_settings: SettingsFactory,
) -> None:
    """Idle partitions' polls fill the others' buffers, but only up to a few polls' worth."""
    settings = make_settings(tail=True)
    topic = settings.topic_favorite_added
    batch = 20
    with _open_parts(settings, [topic], range(6), batch_size=batch) as parts:
        busy, idle = parts[0], parts[1:]
        produce(settings, _values(topic, 0, 2_000))
        deadline = time.monotonic() + 30
        high = 0
        read: list[int] = []
        while len(read) < 2_000 and time.monotonic() < deadline:
            for part in idle:  # five empty buffers, five fills per round
                assert part.next_batch() == []
                high = max(high, busy._shared._buffered)
            read += [r.offset for r in busy.next_batch() if isinstance(r, SourceRecord)]
        assert read == list(range(2_000)), "skipped, reordered or read twice"
        # Four polls' worth, plus the one fill that crossed it; unbounded, it reaches ~2,000.
        assert high <= 5 * batch, high


def test_a_broker_outage_is_checked_once_per_step_for_the_worker_and_every_partition_pauses(
    make_settings: SettingsFactory, kafka_broker: Any, caplog: pytest.LogCaptureFixture,
) -> None:
    """Every broker down: one metadata call per back-off step for all of a worker's partitions.

    Each retry line names every waiting partition; every partition is a paused health waiter
    (one that joins during the outage at once) until one ``kafka-consumer-recovered``;
    afterwards each reads on exactly where it was.
    """
    if kafka_broker is None:
        pytest.skip("needs the suite's own broker to stop and start")
    caplog.set_level(logging.INFO, "sources.consumer")
    process = Process()
    settings = make_settings(tail=True)
    topics = [settings.topic_favorite_added, settings.topic_favorite_removed]
    backoff = Backoff(initial=0.5, maximum=1.0)
    with _open_parts(settings, topics, range(3), batch_size=50, backoff=backoff,
                     process=process) as parts:
        shared = parts[0]._shared
        counting = shared.consumer = _CountingConsumer(shared.consumer)
        produce(settings, [r for t in topics for p in range(3) for r in _values(t, p, 5)])
        assert sum(map(len, _read_round_robin(parts, 30, 30).values())) == 30
        waiters = {f"{p.topic}[{p.partition}]" for p in parts}
        kafka_broker.stop()
        try:
            deadline = time.monotonic() + 60
            while len(_events(caplog, "kafka-consumer-retry")) < 3:
                assert time.monotonic() < deadline, "no reachability checks while down"
                for part in parts:
                    assert part.next_batch() == []
                time.sleep(0.05)
            late = KafkaInput(settings.kafka_client_config(), topics[0], process=process,
                              tail=True,
                              backoff=backoff).build_part("input", f"{topics[0]}#3", None)
            parts.append(late)
            waiting = dict(process.health.snapshot().waiting)
            assert waiters | {f"{topics[0]}[3]"} <= set(waiting), "every partition waits"
            assert {waiting[w] for w in waiters} == {"kafka"}
        finally:
            kafka_broker.start()
        produce(settings, [r for t in topics for p in range(3) for r in _values(t, p, 5, 5)]
                + _values(topics[0], 3, 5, 5))
        got = _read_round_robin(parts, 35, 60)
        retries = _events(caplog, "kafka-consumer-retry")
        said = [(r.attempt, r.error) for r in retries[-3:]]  # what the last probes met
        for (topic, partition), records in got.items():
            expected = range(5, 10) if partition < 3 else range(5)
            assert [r.offset for r in records] == list(expected), (topic, partition, said)
        assert [r.attempt for r in retries] == list(range(1, len(retries) + 1)), (
            "one line per step, not one per partition")
        assert all(set(r.partitions) >= waiters for r in retries)
        # the first line comes from the client's error; each later one and the recovery from
        # one metadata call
        assert counting.metadata_calls == len(retries)
        recovered = _events(caplog, "kafka-consumer-recovered")
        assert len(recovered) == 1
        assert set(recovered[0].partitions) == waiters | {f"{topics[0]}[3]"}
        assert not (waiters | {f"{topics[0]}[3]"}) & set(dict(process.health.snapshot().waiting))


class _CountingConsumer:
    """A consumer that counts its metadata calls (the reachability checks)."""

    def __init__(self, consumer: Any) -> None:
        self._consumer = consumer
        self.metadata_calls = 0

    def list_topics(self, *args: Any, **kwargs: Any) -> Any:
        self.metadata_calls += 1
        return self._consumer.list_topics(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._consumer, name)


def _events(caplog: pytest.LogCaptureFixture, event: str) -> list[Any]:
    return [r for r in caplog.records if r.getMessage() == event]
