"""``python -m bench.report_cost``: CPU per message of the favorites sink's ``report``, old vs new.

Old: the per-message report (``inc()``, ``observe`` and one ``log_event`` per message). New:
``_ActionHistoryPartition.report`` (counters ``inc(n)`` per batch, ``observe`` per message, the
lines of each outcome written at once by ``log_events``). Both run in this process on the same
outcomes, alternating, through the production handler: ``configure_logging`` with fd 2
redirected to a temporary file, so lines really go through ``BufferedStderrHandler`` to a file.
The timed region includes a final flush of that handler. Machines are noisy: read the ratio.

Before timing, one pass of each writes its lines and the two outputs are compared line by line
with the timestamp removed (they must be identical).
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

import orjson

from bench.workload import EnvelopeFactory, make_sessions, uuid4_from
from dataflows.favorite_actions.decode import (
    SKIP_OUTCOMES,
    FavoriteMessage,
    SkipReason,
    decode_favorite,
)
from dataflows.favorite_actions.records import SessionSnapshot, build_recorded_action
from runtime.logs import BufferedStderrHandler, configure_logging, log_event, log_events
from runtime.metrics import FAVORITES_CONSUME_DURATION_MS
from schemas.favorites import ActionType
from schemas.kafka_record import SourceRecord
from sinks.action_history import (
    _RECORDED,
    _SKIPPED,
    _ActionHistoryPartition,
    message_fields,
)
from sinks.action_history import logger as sink_logger
from sinks.favorites_store import BatchOutcome

ADDED, REMOVED = "favorite-added", "favorite-removed"


def old_report(outcome: BatchOutcome) -> None:
    """The sink's ``report`` before batching (verbatim, for comparison)."""
    logger = sink_logger
    now_mono = time.monotonic()
    oldest = None
    for action in outcome.recorded:
        message = action.message
        _RECORDED[message.action_type].inc()
        FAVORITES_CONSUME_DURATION_MS.observe((now_mono - message.record.received_at) * 1000)
        created = message.envelope.created_at
        oldest = created if oldest is None or created < oldest else oldest
        log_event(
            logger,
            "recorded",
            outcome="recorded",
            SessionId=action.event.session_id,
            **message_fields(message),
        )
    for reason, messages in (
        (SkipReason.DUPLICATE, outcome.duplicates),
        (SkipReason.NO_SESSION, outcome.no_session),
    ):
        skipped = _SKIPPED[reason]
        for message in messages:
            skipped.inc()
            FAVORITES_CONSUME_DURATION_MS.observe(
                (now_mono - message.record.received_at) * 1000
            )
            log_event(
                logger, SKIP_OUTCOMES[reason], outcome=SKIP_OUTCOMES[reason],
                **message_fields(message),
            )


def make_outcomes(
    count: int, batch: int, rng: random.Random, skip_share: float = 0.015
) -> list[BatchOutcome]:
    """Committed batches of ``batch`` messages: ``skip_share`` duplicates / no-session skips."""
    factory = EnvelopeFactory(make_sessions(500, rng), rng, ADDED, REMOVED)
    action_types = {ADDED: ActionType.ADD_TO_FAVORITES, REMOVED: ActionType.REMOVE_FROM_FAVORITES}
    now = datetime.now(UTC)
    outcomes = []
    for start in range(0, count, batch):
        outcome = BatchOutcome()
        for offset in range(start, min(count, start + batch)):
            out = factory.record("valid")
            decoded = decode_favorite(
                SourceRecord(out.topic, offset % 12, offset, out.key, out.value, out.headers),
                action_types,
            )
            assert isinstance(decoded, FavoriteMessage)
            draw = rng.random()
            if draw < skip_share * 2 / 3:
                outcome.duplicates.append(decoded)
            elif draw < skip_share:
                outcome.no_session.append(decoded)
            else:
                session = SessionSnapshot(uuid4_from(rng), uuid4_from(rng), None)
                outcome.recorded.append(build_recorded_action(
                    decoded, session, action_event_id=uuid4_from(rng),
                    outbox_message_id=uuid4_from(rng), topic="action-tracked", now=now,
                ))
        outcomes.append(outcome)
    return outcomes


def _messages(outcomes: Sequence[BatchOutcome]) -> list[FavoriteMessage]:
    return [m for o in outcomes
            for m in ([a.message for a in o.recorded] + o.duplicates + o.no_session)]


def refresh_received_at(outcomes: Sequence[BatchOutcome], rng: random.Random) -> None:
    """Each message consumed 20-400 ms ago (realistic histogram buckets for every pass)."""
    now = time.monotonic()
    for message in _messages(outcomes):
        object.__setattr__(message.record, "received_at", now - rng.uniform(0.02, 0.4))


def _production_handler() -> BufferedStderrHandler:
    handlers = [h for h in logging.getLogger().handlers if isinstance(h, BufferedStderrHandler)]
    assert len(handlers) == 1
    return handlers[0]


_TS = re.compile(rb'^\{"ts":"[^"]*",')


def _lines_without_ts(data: bytes) -> list[bytes]:
    return [_TS.sub(b"{", line) for line in data.splitlines()]


def _timed(fn: Callable[[BatchOutcome], None], outcomes: Sequence[BatchOutcome],
           handler: BufferedStderrHandler) -> tuple[float, float]:
    c0, w0 = time.process_time(), time.perf_counter()
    for outcome in outcomes:
        fn(outcome)
    handler._flush_now()  # the write syscalls belong to the cost
    return time.process_time() - c0, time.perf_counter() - w0


def component_costs(outcomes: Sequence[BatchOutcome], rng: random.Random,
                    handler: BufferedStderrHandler) -> dict[str, float]:
    """µs per call / per line of the parts: metrics, and one log line old vs batched."""
    n = 100_000
    values = [rng.uniform(20, 400) for _ in range(n)]
    observe = FAVORITES_CONSUME_DURATION_MS.observe
    counter = _RECORDED[ActionType.ADD_TO_FAVORITES]
    t0 = time.process_time()
    for value in values:
        observe(value)
    t1 = time.process_time()
    for _ in values:
        counter.inc()
    t2 = time.process_time()
    batches = [[{"outcome": "recorded", "SessionId": a.event.session_id,
                 **message_fields(a.message)} for a in o.recorded] for o in outcomes]
    lines = sum(len(rows) for rows in batches)
    t3 = time.process_time()
    for rows in batches:
        for row in rows:
            log_event(sink_logger, "recorded", **row)
    handler._flush_now()
    t4 = time.process_time()
    for rows in batches:
        log_events(sink_logger, "recorded", rows)
    handler._flush_now()
    t5 = time.process_time()
    return {
        "histogram_observe_us": round(1e6 * (t1 - t0) / n, 3),
        "counter_inc_call_us": round(1e6 * (t2 - t1) / n, 3),
        "log_event_us_per_line": round(1e6 * (t4 - t3) / lines, 3),
        "log_events_us_per_line": round(1e6 * (t5 - t4) / lines, 3),
    }


def main(argv: list[str] | None = None) -> int:
    """Run the comparison; prints JSON results to stdout."""
    parser = argparse.ArgumentParser(prog="python -m bench.report_cost", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    outcomes = make_outcomes(args.messages, args.batch, rng)
    messages = len(_messages(outcomes))
    partition = object.__new__(_ActionHistoryPartition)  # report uses no instance state
    variants: dict[str, Callable[[BatchOutcome], None]] = {
        "old": old_report, "new": partition.report,
    }

    log = tempfile.NamedTemporaryFile(prefix="report-cost-", suffix=".log")  # noqa: SIM115
    saved_stderr = os.dup(2)
    os.dup2(log.fileno(), 2)
    try:
        configure_logging("INFO")
        handler = _production_handler()
        # Same lines? One pass each, then compare what reached the file.
        refresh_received_at(outcomes, rng)
        outputs = {}
        for name, fn in variants.items():
            start = os.lseek(log.fileno(), 0, os.SEEK_END)
            _timed(fn, outcomes, handler)
            with open(log.name, "rb") as f:
                f.seek(start)
                outputs[name] = _lines_without_ts(f.read())
        identical = outputs["old"] == outputs["new"]
        lines = len(outputs["new"])

        cpu: dict[str, list[float]] = {name: [] for name in variants}
        wall: dict[str, list[float]] = {name: [] for name in variants}
        for round_ in range(args.rounds):
            order = list(variants) if round_ % 2 == 0 else list(reversed(variants))
            for name in order:
                refresh_received_at(outcomes, rng)
                c, w = _timed(variants[name], outcomes, handler)
                cpu[name].append(c)
                wall[name].append(w)
        costs = component_costs(outcomes, rng, handler)
        handler.close()
    finally:
        os.dup2(saved_stderr, 2)
        os.close(saved_stderr)
        log.close()

    def per_message(samples: list[float]) -> float:
        return round(1e6 * statistics.median(samples) / messages, 2)

    result: dict[str, Any] = {
        "messages": messages, "batch": args.batch, "rounds": args.rounds,
        "log_lines_per_pass": lines, "lines_identical_except_ts": identical,
        "old_cpu_us_per_message": per_message(cpu["old"]),
        "new_cpu_us_per_message": per_message(cpu["new"]),
        "old_wall_us_per_message": per_message(wall["old"]),
        "new_wall_us_per_message": per_message(wall["new"]),
        "cpu_ratio_old_over_new": round(statistics.median(cpu["old"])
                                        / statistics.median(cpu["new"]), 2),
        "per_round_cpu_ratio": [round(o / n, 2) for o, n in zip(cpu["old"], cpu["new"],
                                                                  strict=True)],
        **costs,
    }
    sys.stdout.write(orjson.dumps(result, option=orjson.OPT_INDENT_2).decode() + "\n")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
