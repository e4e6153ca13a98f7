"""Cost of the outbox publisher's produce path and of the consumer's header conversion.

``python -m bench.produce_cost [--bootstrap HOST:PORT] [--records 50000] [--rounds 3]``

Old and new code run in the same process, on the same kind of records, interleaved batch by
batch (order swapped every batch), so the ratio holds on a noisy machine even when absolute
timings do not. Without ``--bootstrap`` a real single-node broker is started
(``devenv.kafka_broker``) in a temporary directory and stopped at the end.

Compared, per record, against a real broker (the producer of ``build_producer``: idempotent,
``acks=all``, ``delivery.report.only.error``):

- ``produce_and_wait``: the old function (copied below: a closure per record, ``list(headers)``
  per record, keyword value/key) against the new one, both given ``OutgoingRecord`` s;
- ``publish_offered`` path: the old ``OutboxRow -> OutgoingRecord`` conversion plus the old
  function, against the new function given the ``OutboxRow`` s themselves.

The times are the calling thread's CPU time (``time.thread_time``: what the publisher takes
from the GIL; librdkafka's own threads are not in it) and wall time (includes waiting for the
broker's acknowledgements, so its ratio says less). Without a broker, first:
``sources.kafka_input._headers`` old against new on the header shapes the job sees, and
``publish_offered``'s bookkeeping after delivery (ids to mark, ``OUTBOX_PUBLISHED``).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from uuid import UUID

import orjson
from confluent_kafka import KafkaError, Message, Producer
from prometheus_client import Counter

from runtime.settings import Settings
from schemas.outbox import OutboxRow
from sinks.kafka_producer import OutgoingRecord, build_producer, produce_and_wait
from sources.kafka_input import _headers as new_headers

# ---------------------------------------------------------------------------------------------
# The baseline: the code before this change, verbatim.
# ---------------------------------------------------------------------------------------------


def old_produce_and_wait(
    producer: Producer, records: Sequence[OutgoingRecord], timeout: float = 35.0
) -> list[KafkaError | None]:
    """The previous ``sinks.kafka_producer.produce_and_wait``."""
    results: list[KafkaError | None] = [None] * len(records)

    def report(index: int) -> Any:
        def on_delivery(err: KafkaError | None, _msg: Message) -> None:
            if err is not None:
                results[index] = err

        return on_delivery

    for index, record in enumerate(records):
        while True:
            try:
                producer.produce(
                    record.topic,
                    value=record.value,
                    key=record.key,
                    headers=list(record.headers),
                    on_delivery=report(index),
                )
                break
            except BufferError:
                producer.poll(0.05)  # local queue full: serve delivery reports, then retry
    if producer.flush(timeout) > 0:
        timed_out = KafkaError(KafkaError._TIMED_OUT)
        return [err or timed_out for err in results]
    return results


def old_publish(producer: Producer, rows: Sequence[OutboxRow]) -> list[KafkaError | None]:
    """The previous ``OutboxPublisher.publish_offered`` conversion + produce."""
    records = [
        OutgoingRecord(
            row.topic, row.key, row.value,
            [(name, value.encode()) for name, value in row.headers.items()],
        )
        for row in rows
    ]
    return old_produce_and_wait(producer, records)


def new_publish(producer: Producer, rows: Sequence[OutboxRow]) -> list[KafkaError | None]:
    """The new ``OutboxPublisher.publish_offered`` produce: rows as they are."""
    return produce_and_wait(producer, rows)


def old_headers(raw: object) -> tuple[tuple[str, bytes], ...]:
    """The previous ``sources.kafka_input._headers``."""
    if not isinstance(raw, list):
        return ()
    return tuple((str(name), value or b"") for name, value in raw)


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------


def make_rows(topic: str, count: int, seed: int) -> list[OutboxRow]:
    """Outbox rows shaped like action-tracked events; a traceparent on every other one."""
    rows = []
    for i in range(count):
        message_id = uuid.uuid4()
        value = orjson.dumps({
            "MessageId": str(message_id), "CreatedAt": "2026-11-29T08:00:00.123456+00:00",
            "Version": 1, "AggregateId": str(uuid.uuid4()), "AggregateType": "UserAction",
            "CorrelationId": f"corr-{seed}-{i:08x}",
            "Payload": {
                "ActionId": str(uuid.uuid4()), "SessionId": str(uuid.uuid4()),
                "UserId": str(uuid.uuid4()), "AnonymousId": str(uuid.uuid4()),
                "ActionType": "AddToFavorites", "PropertyObjectId": str(uuid.uuid4()),
                "OccurredAt": "2026-11-29T08:00:00.1234567+03:00",
            },
        })
        headers = (
            {"traceparent": f"00-{uuid.uuid4().hex}{seed:04x}{i:012x}"[:55] + "-01"}
            if i % 2 == 0 else {}
        )
        rows.append(OutboxRow(message_id, topic, str(uuid.uuid4()).encode(), value, headers))
    return rows


def as_records(rows: Sequence[OutboxRow]) -> list[OutgoingRecord]:
    """The rows as ``OutgoingRecord`` s with list headers (what the DLQ publisher passes)."""
    return [
        OutgoingRecord(r.topic, r.key, r.value, [(k, v.encode()) for k, v in r.headers.items()])
        for r in rows
    ]


# ---------------------------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------------------------

Call = Callable[[Producer, Any], list[KafkaError | None]]


def compare(
    producer: Producer, old: Call, new: Call, old_in: Sequence[Any], new_in: Sequence[Any], *,
    batch: int,
) -> dict[str, float]:
    """Run ``old`` and ``new`` batch by batch, interleaved; µs per record (CPU and wall).

    The garbage collector stays on (allocations that trigger collections are part of the
    cost), but starts each comparison from a clean state.
    """
    gc.collect()
    cpu = {"old": 0.0, "new": 0.0}
    wall = {"old": 0.0, "new": 0.0}
    failed = 0
    for n, start in enumerate(range(0, len(old_in), batch)):
        end = start + batch
        runs = [("old", old, old_in[start:end]), ("new", new, new_in[start:end])]
        for name, call, chunk in runs if n % 2 == 0 else runs[::-1]:
            c0, w0 = time.thread_time(), time.perf_counter()
            errors = call(producer, chunk)
            cpu[name] += time.thread_time() - c0
            wall[name] += time.perf_counter() - w0
            failed += sum(err is not None for err in errors)
    if failed:
        raise RuntimeError(f"{failed} deliveries failed: the timings are not comparable")
    count = len(old_in)
    return {
        "old_cpu_us": cpu["old"] / count * 1e6, "new_cpu_us": cpu["new"] / count * 1e6,
        "old_wall_us": wall["old"] / count * 1e6, "new_wall_us": wall["new"] / count * 1e6,
    }


def report(title: str, rounds: list[dict[str, float]]) -> None:
    """Print each round and the median (µs per record; ratio new/old)."""
    print(f"\n{title}")
    print(f"  {'round':>6} {'old cpu':>9} {'new cpu':>9} {'ratio':>6}   "
          f"{'old wall':>9} {'new wall':>9} {'ratio':>6}")
    rows = [(str(i + 1), r) for i, r in enumerate(rounds)]
    rows.append(("median", {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}))
    for label, r in rows:
        print(f"  {label:>6} {r['old_cpu_us']:9.2f} {r['new_cpu_us']:9.2f} "
              f"{r['new_cpu_us'] / r['old_cpu_us']:6.2f}   {r['old_wall_us']:9.2f} "
              f"{r['new_wall_us']:9.2f} {r['new_wall_us'] / r['old_wall_us']:6.2f}")


def bench_produce(bootstrap: str, count: int, rounds: int, batch: int) -> None:
    """produce_and_wait and the publish path, old against new, on a real broker."""
    from devenv.kafka_broker import create_topics

    topic = f"bench.produce-cost.{uuid.uuid4().hex[:8]}"
    create_topics(bootstrap, [topic], 6)
    producer = build_producer(Settings(kafka_bootstrap_servers=bootstrap), "produce-cost")
    warm = make_rows(topic, 2 * batch, 0)  # connection, idempotent PID, metadata
    old_publish(producer, warm[:batch])
    new_publish(producer, warm[batch:])
    print(f"broker {bootstrap}, topic {topic} (6 partitions), {count} records per variant "
          f"and round, batches of {batch}, {rounds} rounds")
    p_w: list[dict[str, float]] = []
    publish: list[dict[str, float]] = []
    for r in range(rounds):
        old_rows, new_rows = make_rows(topic, count, 4 * r + 1), make_rows(topic, count, 4 * r + 2)
        p_w.append(compare(producer, old_produce_and_wait, produce_and_wait,
                           as_records(old_rows), as_records(new_rows), batch=batch))
        old_rows, new_rows = make_rows(topic, count, 4 * r + 3), make_rows(topic, count, 4 * r + 4)
        publish.append(
            compare(producer, old_publish, new_publish, old_rows, new_rows, batch=batch))
    report("produce_and_wait(OutgoingRecord with list headers), µs per record:", p_w)
    report("publish_offered produce path (OutboxRow -> produced), µs per record:", publish)


def bench_headers(loops: int, repeats: int) -> None:
    """sources.kafka_input._headers, old against new, without a broker."""
    tp = ("traceparent", b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
    shapes: dict[str, list[Any]] = {
        "no headers (None)": [None],
        "traceparent": [[tp]],
        "3 headers": [[tp, ("x-a", b"1"), ("x-b", b"2")]],
        "a null value": [[tp, ("x-a", None)]],
        "job mix (half None)": [None, [tp]],
    }
    print(f"\n_headers, ns per call (best of {repeats} x {loops} calls, interleaved):")
    print(f"  {'shape':<22} {'old':>7} {'new':>7} {'ratio':>6}")
    for name, inputs in shapes.items():
        for raw in inputs:
            assert old_headers(raw) == new_headers(raw), name
        data = inputs * (loops // len(inputs))
        best = {"old": float("inf"), "new": float("inf")}
        for i in range(repeats):
            pair = [("old", old_headers), ("new", new_headers)]
            for label, fn in pair if i % 2 == 0 else pair[::-1]:
                t0 = time.perf_counter()
                for raw in data:
                    fn(raw)
                best[label] = min(best[label], (time.perf_counter() - t0) / len(data) * 1e9)
        print(f"  {name:<22} {best['old']:7.0f} {best['new']:7.0f} "
              f"{best['new'] / best['old']:6.2f}")


def old_bookkeeping(
    counter: Counter, rows: Sequence[OutboxRow], errors: Sequence[KafkaError | None]
) -> list[UUID]:
    """The previous ``publish_offered`` after delivery: ids to mark, one metric call per row."""
    delivered = [row for row, err in zip(rows, errors, strict=True) if err is None]
    ids = [r.id for r in delivered]
    for row in delivered:
        counter.labels(topic=row.topic).inc()
    return ids


def new_bookkeeping(
    counter: Counter, rows: Sequence[OutboxRow], errors: Sequence[KafkaError | None]
) -> list[UUID]:
    """The new ``publish_offered`` after delivery: one metric call per topic."""
    delivered: list[UUID] = []
    per_topic: dict[str, int] = {}
    for row, err in zip(rows, errors, strict=True):
        if err is None:
            delivered.append(row.id)
            per_topic[row.topic] = per_topic.get(row.topic, 0) + 1
    for topic, count in per_topic.items():
        counter.labels(topic=topic).inc(count)
    return delivered


def bench_bookkeeping(count: int, batch: int, repeats: int) -> None:
    """publish_offered's post-delivery bookkeeping, old against new, without a broker."""
    counter = Counter("bench_outbox_published", "bench", ["topic"], registry=None)
    rows = make_rows("t", count, 0)
    errors: list[KafkaError | None] = [None] * batch
    best = {"old": float("inf"), "new": float("inf")}
    for i in range(repeats):
        pair = [("old", old_bookkeeping), ("new", new_bookkeeping)]
        for label, fn in pair if i % 2 == 0 else pair[::-1]:
            t0 = time.perf_counter()
            for start in range(0, count, batch):
                fn(counter, rows[start:start + batch], errors)
            best[label] = min(best[label], (time.perf_counter() - t0) / count * 1e6)
    print(f"\npublish_offered bookkeeping (ids to mark + OUTBOX_PUBLISHED), µs per row "
          f"(best of {repeats}): old {best['old']:.2f}  new {best['new']:.2f}  "
          f"ratio {best['new'] / best['old']:.2f}")


def main(argv: Sequence[str] | None = None) -> int:
    """Run both benchmarks; return the exit code."""
    parser = argparse.ArgumentParser(prog="python -m bench.produce_cost", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bootstrap", help="an existing broker (default: start one)")
    parser.add_argument("--records", type=int, default=50_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=1000, help="records per call (outbox batch)")
    parser.add_argument("--header-loops", type=int, default=200_000)
    args = parser.parse_args(argv)
    bench_headers(args.header_loops, 7)
    bench_bookkeeping(args.records, args.batch, 7)
    if args.bootstrap:
        bench_produce(args.bootstrap, args.records, args.rounds, args.batch)
        return 0
    from devenv.kafka_broker import KafkaBroker

    with tempfile.TemporaryDirectory(prefix="produce-cost-") as tmp, \
            KafkaBroker(Path(tmp) / "kafka") as broker:
        bench_produce(broker.bootstrap, args.records, args.rounds, args.batch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
