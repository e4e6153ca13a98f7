"""The child process of :mod:`sources.guarded_read`: reads one partition under a memory cap.

Run as ``python -m sources.guarded_child`` with one JSON line on stdin: the client
configuration, ``topic``, ``partition``, ``offset`` (where to start), ``until`` (stop once past
it), ``single`` (stop after the first fetch that delivers anything) and ``cap_bytes``. It caps
its own data segment (``RLIMIT_DATA``) first, so a batch that inflates past the cap makes
librdkafka's allocation fail (an abort) or Python's (``MemoryError``, exit :data:`NO_MEMORY`)
in this process, not in the job.

Fetches hold one record batch each (``max.partition.fetch.bytes`` 1: the broker still sends
the first batch whole), so the first fetch from an offset is the batch holding that offset and
nothing more. What it read goes to stdout as pickled frames, flushed per fetch:
``("records", [(offset, timestamp_ms, key, value, headers | None), ...])`` (``None``: headers
that cannot be read), ``("passed", position)`` (offsets passed with nothing delivered: control
records) and ``("undecodable", base_offset, reason)`` (a batch librdkafka refuses, then exit).
Exit 0 when done, :data:`NO_PROGRESS` when the broker gave nothing for ``idle_timeout`` seconds.
With ``until`` at ``offset`` it only makes its client and exits 0: a control that a child can
live under the cap at all.
"""

from __future__ import annotations

import json
import os
import pickle
import resource
import sys
import time
from typing import Any, BinaryIO

NO_MEMORY = 70
"""Exit code: Python could not allocate (a record past the cap)."""
NO_PROGRESS = 75
"""Exit code: nothing came from the broker in time (it is down or slow): try again later."""

ONE_BATCH_PER_FETCH = {
    "max.partition.fetch.bytes": 1,
    "fetch.max.bytes": 1000,
    "message.max.bytes": 1000,
    "queued.min.messages": 1,
    "fetch.queue.backoff.ms": 0,
    "enable.auto.commit": False,
    "enable.auto.offset.store": False,
    "enable.partition.eof": False,
    "auto.offset.reset": "earliest",
}
"""What makes each fetch one record batch, and this reader leave no trace in the group.

``fetch.queue.backoff.ms`` 0: one batch fills the fetch queue to ``queued.min.messages``, and
librdkafka would otherwise wait its default 1000 ms before the next fetch: one batch a second
(measured: 20 records in 20 s with a record a batch; 5,000 in 2.1 s without the wait, and
200,000 records in batches of about 2,000 in 0.7 s)."""


def _headers(msg: Any) -> list[tuple[str, bytes | None]] | None:
    try:
        return list(msg.headers() or ())
    except Exception:  # noqa: BLE001 - a name that is not UTF-8: the record goes without them
        return None


def _read(order: dict[str, Any], out: BinaryIO) -> int:
    from confluent_kafka import Consumer, KafkaError, TopicPartition  # after the cap is set

    topic, partition, until = order["topic"], order["partition"], order["until"]
    consumer = Consumer({**order["config"], **ONE_BATCH_PER_FETCH,
                         "group.id": order["config"].get("group.id", "user-activity-guarded")})
    if order["offset"] >= until:  # a control: the client alone lives under the cap
        return 0
    consumer.assign([TopicPartition(topic, partition, order["offset"])])
    handle = TopicPartition(topic, partition)
    next_offset = order["offset"]
    deadline = time.monotonic() + order["idle_timeout"]
    while next_offset < until:
        records = []
        for msg in consumer.consume(500, 0.2):
            error = msg.error()
            if error is not None:
                if error.code() == KafkaError._BAD_COMPRESSION:
                    pickle.dump(("undecodable", msg.offset(), error.str()), out)
                    out.flush()
                    return 0
                continue
            offset = msg.offset()
            if offset is None or offset < next_offset:
                continue
            records.append((offset, msg.timestamp()[1], msg.key(), msg.value(), _headers(msg)))
            next_offset = offset + 1
        if records:
            pickle.dump(("records", records), out)
        else:
            position = consumer.position([handle])[0].offset
            if position > next_offset:
                next_offset = position
                pickle.dump(("passed", position), out)
            elif time.monotonic() > deadline:
                return NO_PROGRESS
            else:
                continue
        out.flush()
        deadline = time.monotonic() + order["idle_timeout"]
        if order["single"]:
            break
    return 0


def main() -> int:
    """Read the order from stdin, cap the memory, read, and exit without cleaning up."""
    order = json.loads(sys.stdin.readline())
    cap = int(order["cap_bytes"])
    resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))
    out = sys.stdout.buffer
    try:
        code = _read(order, out)
    except MemoryError:
        code = NO_MEMORY
    out.flush()
    os._exit(code)  # no consumer close: it would wait for nothing we need


if __name__ == "__main__":
    main()
