"""Replay or backfill a flow's input topics: a bounded run that exits, safe by construction.

    user-activity replay --from 2026-11-01T00:00:00Z [--until 2026-11-02T00:00:00Z] [--dry-run]
    user-activity replay --offsets pin.favorites.favorite-added.v1:0=1200 --topic added
    user-activity replay --from-group legacy-favorites-consumer --dry-run
    user-activity replay --flow session-linking --from 2026-11-01T00:00:00Z

Reads up to the end offsets seen at start (or --until) through the job's steps and sinks;
writes are idempotent. Its own recovery store (--recovery-dir, default temporary), never the
job's; the same directory resumes it. Exit 0 at its end, 75 when stopped (SIGTERM, Ctrl-C).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TextIO

from bytewax.dataflow import Dataflow
from bytewax.recovery import RecoveryConfig, init_db_dir
from bytewax.testing import run_main
from prometheus_client import REGISTRY

from dataflows.session_linking.linking import LinkOutcome
from runtime.bytewax_0_21 import recovery
from runtime.health import Health
from runtime.process import Process
from runtime.settings import Settings
from runtime.shutdown import Shutdown
from sinks.dry_run import Tally
from sinks.outbox import OutboxPublisher
from sinks.transactional import Publishing
from sources.kafka_input import StartPosition

_SKIPPED = "user_activity_favorites_skipped_total"
OUTCOMES = ("recorded", "duplicate", "invalid-owner", "no-session", "dead-lettered")
SESSION_OUTCOMES = (*(outcome.value for outcome in LinkOutcome), "dead-lettered")
_STOPPING = Shutdown()


def parse_offsets(specs: Sequence[str]) -> dict[tuple[str, int], int]:
    """``TOPIC:PARTITION=OFFSET[,PARTITION=OFFSET…]`` specs -> ``{(topic, partition): offset}``."""
    offsets: dict[tuple[str, int], int] = {}
    for spec in specs:
        topic, sep, assignments = spec.rpartition(":")
        if not sep or not topic:
            raise argparse.ArgumentTypeError(f"expected TOPIC:PARTITION=OFFSET, got {spec!r}")
        for assignment in assignments.split(","):
            partition, eq, offset = assignment.partition("=")
            if not eq or not partition.strip().isdigit() or not offset.strip().isdigit():
                raise argparse.ArgumentTypeError(
                    f"expected PARTITION=OFFSET (both whole numbers >= 0) in {spec!r}")
            offsets[(topic, int(partition))] = int(offset)
    return offsets


def parse_timestamp(text: str) -> int:
    """An ISO 8601 instant with offset (``Z`` allowed) -> epoch milliseconds."""
    moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    if moment.tzinfo is None:
        raise argparse.ArgumentTypeError(f"a time needs an offset or Z: {text!r}")
    milliseconds = int(moment.timestamp() * 1000)
    if milliseconds < 0:  # the broker answers UNSUPPORTED_VERSION
        raise argparse.ArgumentTypeError(f"Kafka timestamps start at 1970-01-01: {text!r}")
    return milliseconds


def _value(name: str, labels: dict[str, str] | None = None) -> int:
    return int(REGISTRY.get_sample_value(name, labels or {}) or 0)


def _favorites_totals() -> dict[str, int]:
    return {"recorded": sum(_value("user_activity_favorites_recorded_total", {"action_type": a})
                            for a in ("AddToFavorites", "RemoveFromFavorites")),
            **{r: _value(_SKIPPED, {"reason": r}) for r in ("duplicate", "invalid-owner",
                                                            "no-session")},
            "dead-lettered": _value("user_activity_favorites_dlq_total")}


def _session_totals() -> dict[str, int]:
    return {outcome: _value("user_activity_session_linking_outcomes_total", {"outcome": outcome})
            for outcome in SESSION_OUTCOMES if outcome != "dead-lettered"} | {
        "dead-lettered": _value("user_activity_session_linking_dlq_total")}


@dataclass(frozen=True)
class _Replayed:
    """How one flow is replayed: its outcomes, its bounded flow, its counters."""

    outcomes: tuple[str, ...]
    build: Callable[[Settings, StartPosition, Sequence[str] | None, Tally | None, Process,
                     Publishing | None], Dataflow]
    totals: Callable[[], dict[str, int]]
    upstream: tuple[str, ...]  # counted before the sinks: a dry run adds them to its tally


def _build_favorites(  # noqa: PLR0917
    settings: Settings, start: StartPosition, topics: Sequence[str] | None, tally: Tally | None,
    process: Process, publisher: Publishing | None,
) -> Dataflow:
    from dataflows.favorite_actions.flow import FavoritesSinks, build_flow

    sinks = None if tally is None else FavoritesSinks.dry_run(settings, tally)
    return build_flow(settings, start=start, topics=topics, sinks=sinks, process=process,
                      publisher=publisher)


def _build_session_linking(settings: Settings, start: StartPosition, _topics: Sequence[str] | None,
                           tally: Tally | None, process: Process,
                           publisher: Publishing | None) -> Dataflow:
    from dataflows.session_linking.flow import SessionLinkingSinks, build_flow

    sinks = None if tally is None else SessionLinkingSinks.dry_run(settings, tally)
    return build_flow(settings, start=start, sinks=sinks, process=process, publisher=publisher)


FLOWS = {
    "favorites": _Replayed(OUTCOMES, _build_favorites, _favorites_totals,
                           ("invalid-owner", "duplicate")),
    "session-linking": _Replayed(SESSION_OUTCOMES, _build_session_linking, _session_totals,
                                 ("invalid", "duplicate")),
}


class ReplayRefused(ValueError):
    """A replay that would do something other than what was asked: refused before it reads."""


_MARKER = recovery.REPLAY_MARKER


def _refuse_if_in_use(recovery_dir: Path) -> None:
    if held := recovery.lock(recovery_dir, 0):
        pid = held.partition("(")[2].partition(")")[0] or "pid ?"  # the lock's reason names it
        raise ReplayRefused(f"{recovery_dir} is in use by another process ({pid}: a replay, or"
                            " the job on its own store): wait for it to end, or pass another"
                            " directory")


def _recovery_dir(recovery_dir: Path | None, flow_name: str, start: StartPosition, dry_run: bool,
                  out: TextIO, *, min_free_bytes: int) -> Path:
    """The replay's recovery store: a new one (temporary without a directory), or its own to resume.

    Refused (:class:`ReplayRefused`): a store no replay made, another flow's, one in use.
    """
    if dry_run and recovery_dir is not None:
        print(f"a dry run keeps no recovery store: {recovery_dir} is not used", file=out,
              flush=True)
    if dry_run:
        return Path(tempfile.mkdtemp(prefix="user-activity-replay-"))
    if recovery_dir is None:
        recovery.require_room(Path(tempfile.gettempdir()), min_free_bytes)
        return Path(tempfile.mkdtemp(prefix="user-activity-replay-"))
    wanted = {"flow": flow_name, "start": repr(start)}
    marker = recovery_dir / _MARKER
    if any(recovery_dir.glob("part-*.sqlite3")):
        if not marker.exists():  # refused before anything is written into it (not even a lock)
            raise ReplayRefused(f"{recovery_dir} holds a recovery store no replay made (the main"
                                " job's?): a replay resumes only its own; pass a new directory")
        made = json.loads(marker.read_text())
        if made["flow"] != flow_name:
            raise ReplayRefused(f"{recovery_dir} is a replay of {made['flow']}, not {flow_name}")
        _refuse_if_in_use(recovery_dir)
        if made["start"] != wanted["start"]:
            print(f"resuming the replay in {recovery_dir}: its first run's start applies"
                  f" ({made['start']}), not this one's", file=out, flush=True)
        recovery.require_room(recovery_dir, min_free_bytes)
        return recovery_dir
    recovery_dir.mkdir(parents=True, exist_ok=True)
    recovery.require_room(recovery_dir, min_free_bytes)  # before the marker (ENOSPC)
    _refuse_if_in_use(recovery_dir)  # another replay may be making it
    marker.write_text(json.dumps(wanted))
    return recovery_dir


def replay(settings: Settings, start: StartPosition, *, flow_name: str = "favorites",
           topics: Sequence[str] | None = None, dry_run: bool = False,
           recovery_dir: Path | None = None, progress_every: float = 2.0,
           out: TextIO = sys.stdout) -> dict[str, int]:
    """Run one bounded replay of ``flow_name``; return the outcome counts (also printed)."""
    replayed = FLOWS[flow_name]
    outcomes = replayed.outcomes
    # bounded, and no commits to the consumer groups (the lag tools' view of the job)
    bounded = settings.model_copy(update={
        "tail": False, "consumer_group_favorites": "", "consumer_group_session_linking": ""})
    tally = Tally() if dry_run else None
    directory = _recovery_dir(recovery_dir, flow_name, start, dry_run, out,
                              min_free_bytes=settings.recovery_min_free_bytes)
    process = Process(Health(), _STOPPING)
    publisher = (None if dry_run or not settings.outbox_enabled
                 else OutboxPublisher(bounded, process=process))
    flow = replayed.build(bounded, start, topics, tally, process, publisher)
    if not any(directory.glob("part-*.sqlite3")):
        init_db_dir(directory, 1)  # type: ignore[no-untyped-call]
    before = replayed.totals()

    def counts() -> dict[str, int]:
        if tally is not None:
            snapshot = tally.snapshot()
            now = replayed.totals()
            for key in replayed.upstream:  # counted upstream of the sinks
                snapshot[key] = snapshot.get(key, 0) + now[key] - before[key]
            return {k: snapshot.get(k, 0) for k in outcomes}
        now = replayed.totals()
        return {k: now[k] - before[k] for k in outcomes}

    done = threading.Event()
    started = time.monotonic()

    def report_progress() -> None:
        while not done.wait(progress_every):
            seen = counts()
            print(f"[{time.monotonic() - started:6.1f}s] processed {sum(seen.values()):,}: "
                  + ", ".join(f"{k} {v:,}" for k, v in seen.items()), file=out, flush=True)

    reporter = threading.Thread(target=report_progress, daemon=True)
    reporter.start()
    ended = False
    publishing = threading.Event()  # set: the publisher's loop returns
    loop = None if publisher is None else threading.Thread(
        target=publisher.run, args=(publishing,), name="outbox-publisher", daemon=True)
    if loop is not None:
        loop.start()
    try:
        run_main(flow, epoch_interval=None,  # type: ignore[no-untyped-call]
                 recovery_config=RecoveryConfig(str(directory)))  # type: ignore[no-untyped-call]
        ended = not _STOPPING.requested()
    finally:
        if publisher is not None and loop is not None:  # its rows out before the summary
            publishing.set()
            loop.join(_STOPPING.time_left(30.0))
            publisher.close()
        done.set()
        reporter.join()
        if dry_run or (ended and recovery_dir is None):
            shutil.rmtree(directory, ignore_errors=True)  # nothing to resume
        elif not ended and not _STOPPING.requested():  # failed: the summary below is not printed
            print(f"replay of {flow_name} failed before its end: --recovery-dir {directory}"
                  " resumes it", file=out, flush=True)
    result = counts()
    elapsed = time.monotonic() - started
    title = f"DRY RUN of {flow_name} (nothing written)" if dry_run else f"replay of {flow_name}"
    if _STOPPING.requested():
        title += f", STOPPED ({_STOPPING.signal}) before its end"
        if not dry_run:
            title += f": --recovery-dir {directory} resumes it"
    width = max(len(k) for k in outcomes) + 2
    total = sum(result.values())
    print(f"\n{title}: {total:,} messages in {elapsed:.1f}s", file=out)
    print(f"{'outcome':<{width}}{'messages':>12}", file=out)
    for key in outcomes:
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
    where.add_argument("--from-group", metavar="GROUP",
                       help="start each partition at GROUP's committed offset (earliest where it"
                            " has none): what a cutover from that consumer would do")
    where.add_argument("--from-beginning", action="store_true", help="replay everything")
    parser.add_argument("--until", dest="until_ts", type=parse_timestamp, metavar="DATETIME",
                        help="stop before the first record at or after DATETIME (a closed "
                             "window; default: the end offsets seen at start)")
    parser.add_argument("--flow", choices=tuple(FLOWS), default="favorites",
                        help="which flow's input to replay: favorites (both favorites topics) "
                             "or session-linking (the user-signed-in topic)")
    parser.add_argument("--topic", choices=("added", "removed", "both"), default="both",
                        help="favorites only: which favorites topic to replay (default both)")
    parser.add_argument("--dry-run", action="store_true",
                        help="write nothing; report what each message would do (favorites: "
                             "recorded, duplicate, invalid owner, no session, dead-lettered; "
                             "session linking: linked, already-linked, relinked, started, ...)")
    parser.add_argument("--recovery-dir", type=Path,
                        help="the replay's own recovery store (default: a new temporary one, "
                             "removed when the replay ends); pass the same directory to resume "
                             "an interrupted replay")


def run(args: argparse.Namespace, settings: Settings) -> int:
    """Execute the parsed replay command."""
    try:
        return _run(args, settings, args.until_ts)
    except (ReplayRefused, argparse.ArgumentTypeError) as refused:
        print(f"user-activity replay: {refused}", file=sys.stderr, flush=True)
        return 2


def _run(args: argparse.Namespace, settings: Settings, until: int | None) -> int:
    topics = {"added": [settings.topic_favorite_added],  # the favorites topics to read (None: both)
              "removed": [settings.topic_favorite_removed], "both": None}[args.topic]
    replayed_topics = (
        [settings.topic_user_signed_in] if args.flow == "session-linking"
        else topics or [settings.topic_favorite_added, settings.topic_favorite_removed])
    if args.offsets:
        offsets = parse_offsets(args.offsets)
        if unread := sorted({topic for topic, _ in offsets} - set(replayed_topics)):
            raise ReplayRefused(f"--offsets names {', '.join(unread)}, which this replay does"
                                f" not read (it reads {', '.join(replayed_topics)})")
        start = StartPosition(offsets=offsets, until_ms=until)
    elif args.from_ts is not None:
        start = StartPosition(timestamp_ms=args.from_ts, until_ms=until)
    elif args.from_group:
        start = StartPosition(group=args.from_group, until_ms=until)
    else:
        start = StartPosition(until_ms=until)
    from runtime.memory import tune_gc
    from runtime.shutdown import EXIT_RESTART, install_signal_handlers

    tune_gc(settings.gc_young_threshold)
    # SIGTERM and the first Ctrl-C end the inputs: what was read commits, the summary prints
    _STOPPING.grace = settings.stop_grace_seconds
    install_signal_handlers(_STOPPING)
    replay(settings, start, flow_name=args.flow, topics=topics, dry_run=args.dry_run,
           recovery_dir=args.recovery_dir)
    return EXIT_RESTART if _STOPPING.requested() else 0
