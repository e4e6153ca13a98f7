"""Replay / backfill the favorites topics: a bounded run that exits, safe by construction.

    python -m cli replay --from 2026-11-01T00:00:00Z [--dry-run]
    python -m cli replay --offsets pin.favorites.favorite-added.v1:0=1200 --topic added

Reads from a timestamp (``offsets_for_times``) or explicit per-partition offsets up to the end
offsets seen at start, through the same steps and sinks as the main job. Idempotent writes mean
an already processed range writes no row and publishes nothing; rows missing from the database
are restored. The run keeps its own Bytewax recovery store (``--recovery-dir``, default: a new
temporary one), so the main job's offsets and dedup state are untouched, and an interrupted
backfill can be resumed by passing the same directory. ``--dry-run`` writes nothing at all and
reports what would happen.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import TextIO

from bytewax.recovery import RecoveryConfig, init_db_dir
from bytewax.testing import run_main
from prometheus_client import REGISTRY

from dataflows.favorite_actions.dry_run import Tally
from runtime.settings import Settings
from sources.kafka_input import StartPosition

_SKIPPED = "user_activity_favorites_skipped_total"
OUTCOMES = ("recorded", "duplicate", "invalid-owner", "no-session", "dead-lettered")


def parse_offsets(specs: Sequence[str]) -> dict[tuple[str, int], int]:
    """``TOPIC:PARTITION=OFFSET[,PARTITION=OFFSET…]`` specs -> ``{(topic, partition): offset}``."""
    offsets: dict[tuple[str, int], int] = {}
    for spec in specs:
        topic, sep, assignments = spec.rpartition(":")
        if not sep or not topic:
            raise argparse.ArgumentTypeError(f"expected TOPIC:PARTITION=OFFSET, got {spec!r}")
        for assignment in assignments.split(","):
            partition, eq, offset = assignment.partition("=")
            if not eq:
                raise argparse.ArgumentTypeError(f"expected PARTITION=OFFSET in {spec!r}")
            offsets[(topic, int(partition))] = int(offset)
    return offsets


def parse_timestamp(text: str) -> int:
    """An ISO 8601 instant with offset (``Z`` allowed) -> epoch milliseconds."""
    moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    if moment.tzinfo is None:
        raise argparse.ArgumentTypeError(f"--from needs an offset or Z: {text!r}")
    return int(moment.timestamp() * 1000)


def _metric_totals() -> dict[str, int]:
    def value(name: str, labels: dict[str, str] | None = None) -> int:
        return int(REGISTRY.get_sample_value(name, labels or {}) or 0)

    return {
        "recorded": sum(
            value("user_activity_favorites_recorded_total", {"action_type": action})
            for action in ("AddToFavorites", "RemoveFromFavorites")
        ),
        "duplicate": value(_SKIPPED, {"reason": "duplicate"}),
        "invalid-owner": value(_SKIPPED, {"reason": "invalid-owner"}),
        "no-session": value(_SKIPPED, {"reason": "no-session"}),
        "dead-lettered": value("user_activity_favorites_dlq_total"),
    }


def replay(
    settings: Settings,
    start: StartPosition,
    *,
    topics: Sequence[str] | None = None,
    dry_run: bool = False,
    recovery_dir: Path | None = None,
    progress_every: float = 2.0,
    out: TextIO = sys.stdout,
) -> dict[str, int]:
    """Run one bounded replay; return the outcome counts (also printed as a table)."""
    from dataflows.favorite_actions.flow import FavoritesSinks, build_flow

    # bounded, and no commits to the consumer groups: a replay's old offsets must not move
    # the lag tools' view of the main job
    bounded = settings.model_copy(
        update={"tail": False, "consumer_group_favorites": "", "consumer_group_session_linking": ""}
    )
    tally = Tally() if dry_run else None
    sinks = None if tally is None else FavoritesSinks.dry_run(bounded, tally)
    flow = build_flow(bounded, start=start, topics=topics, sinks=sinks)
    directory = recovery_dir or Path(tempfile.mkdtemp(prefix="user-activity-replay-"))
    if not any(directory.glob("part-*.sqlite3")):
        directory.mkdir(parents=True, exist_ok=True)
        init_db_dir(directory, 1)  # type: ignore[no-untyped-call]
    before = _metric_totals()

    def counts() -> dict[str, int]:
        if tally is not None:
            snapshot = tally.snapshot()
            now = _metric_totals()
            for key in ("invalid-owner", "duplicate"):  # counted upstream of the sinks
                snapshot[key] = snapshot.get(key, 0) + now[key] - before[key]
            return {k: snapshot.get(k, 0) for k in OUTCOMES}
        now = _metric_totals()
        return {k: now[k] - before[k] for k in OUTCOMES}

    done = threading.Event()
    started = time.monotonic()

    def report_progress() -> None:
        while not done.wait(progress_every):
            seen = counts()
            print(
                f"[{time.monotonic() - started:6.1f}s] processed {sum(seen.values()):,}: "
                + ", ".join(f"{k} {v:,}" for k, v in seen.items()),
                file=out,
                flush=True,
            )

    reporter = threading.Thread(target=report_progress, daemon=True)
    reporter.start()
    try:
        run_main(  # type: ignore[no-untyped-call]
            flow,
            epoch_interval=None,
            recovery_config=RecoveryConfig(str(directory)),  # type: ignore[no-untyped-call]
        )
    finally:
        done.set()
        reporter.join()
    result = counts()
    elapsed = time.monotonic() - started
    title = "DRY RUN (nothing written)" if dry_run else "replay"
    width = max(len(k) for k in OUTCOMES) + 2
    total = sum(result.values())
    print(f"\n{title}: {total:,} messages in {elapsed:.1f}s", file=out)
    print(f"{'outcome':<{width}}{'messages':>12}", file=out)
    for key in OUTCOMES:
        label = f"would be {key}" if dry_run else key
        print(f"{label:<{width + 9}}{result[key]:>12,}", file=out)
    if tally is not None:
        for key, value in sorted(tally.snapshot().items()):
            if key.startswith("dead-lettered:"):
                print(f"  {key:<{width + 7}}{value:>12,}", file=out)
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The replay command's flags (Kafka-style)."""
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--from", dest="from_ts", type=parse_timestamp, metavar="DATETIME",
                       help="replay records with a timestamp >= DATETIME (ISO 8601, e.g. "
                            "2026-11-01T00:00:00Z)")
    where.add_argument("--offsets", action="append", metavar="TOPIC:PARTITION=OFFSET[,...]",
                       help="start offsets per partition (repeatable); other partitions of the "
                            "replayed topics start at the earliest offset")
    where.add_argument("--from-beginning", action="store_true", help="replay everything")
    parser.add_argument("--topic", choices=("added", "removed", "both"), default="both",
                        help="which favorites topic to replay (default both)")
    parser.add_argument("--dry-run", action="store_true",
                        help="write nothing; report how many messages would be recorded, "
                             "skipped as duplicates, invalid owner, no session, dead-lettered")
    parser.add_argument("--recovery-dir", type=Path,
                        help="the replay's own recovery store (default: a new temporary one); "
                             "pass the same directory to resume an interrupted replay")


def run(args: argparse.Namespace, settings: Settings) -> int:
    """Execute the parsed replay command."""
    if args.offsets:
        start = StartPosition(offsets=parse_offsets(args.offsets))
    elif args.from_ts is not None:
        start = StartPosition(timestamp_ms=args.from_ts)
    else:
        start = StartPosition()
    topics = {
        "added": [settings.topic_favorite_added],
        "removed": [settings.topic_favorite_removed],
        "both": None,
    }[args.topic]
    from runtime.gc_tuning import tune_gc

    tune_gc(settings.gc_young_threshold, settings.gc_full_collect_interval_seconds)
    replay(settings, start, topics=topics, dry_run=args.dry_run, recovery_dir=args.recovery_dir)
    return 0
