"""Operator commands: ``user-activity migrate|create-topics|init-recovery|replay|outbox``.

Also ``python -m cli …``. Settings come from ``USER_ACTIVITY_*``; a bad one stops the command with
one line naming the variable and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from uuid import UUID

from runtime.configuration import load_settings
from runtime.logs import configure_logging
from runtime.settings import Settings


def main(argv: list[str] | None = None) -> int:
    """Run one operator command; settings come from ``USER_ACTIVITY_*``."""
    parser = argparse.ArgumentParser(
        prog="user-activity", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("migrate", help="apply pending SQL migrations (USER_ACTIVITY_DATABASE_URL)")
    commands.add_parser("create-topics", help="create every topic of the service (idempotent)")
    recovery = commands.add_parser(
        "init-recovery", help="create a Bytewax recovery store (SQLite partitions) in a directory"
    )
    recovery.add_argument("directory", type=Path)
    recovery.add_argument(
        "--partitions", type=int, default=4,
        help="recovery partitions: at least the largest planned worker count (default 4)",
    )
    outbox = commands.add_parser(
        "outbox", help="parked outbox rows: list them, or give them back to the publisher"
    )
    outbox_commands = outbox.add_subparsers(dest="outbox_command", required=True)
    outbox_commands.add_parser("parked", help="list parked rows (id, topic, attempts, error)")
    requeue = outbox_commands.add_parser(
        "requeue", help="re-publish parked rows once the cause is fixed (idempotent)"
    )
    which = requeue.add_mutually_exclusive_group(required=True)
    which.add_argument("--id", dest="ids", action="append", type=UUID, metavar="ID",
                       help="a parked row's id (repeatable)")
    which.add_argument("--all", action="store_true", help="every parked row")
    from cli import replay

    replay_parser = commands.add_parser(
        "replay",
        help="replay/backfill a flow's input (bounded; --until closes the window; --dry-run "
             "writes nothing)",
        description=replay.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    replay.add_arguments(replay_parser)
    args = parser.parse_args(argv)
    settings = load_settings()
    configure_logging(settings.log_level)

    if args.command == "migrate":
        from cli.migrate import apply_migrations

        applied = apply_migrations(settings.database_dsn())
        print(f"applied {len(applied)} migration(s): {', '.join(applied) or '-'}")
    elif args.command == "create-topics":
        from cli.topics import ensure_topics

        ensure_topics(
            settings.kafka_client_config(), settings.all_topics(), settings.topic_partitions
        )
        print(f"topics ready: {', '.join(settings.all_topics())}")
    elif args.command == "init-recovery":
        from bytewax.recovery import init_db_dir

        args.directory.mkdir(parents=True, exist_ok=True)
        init_db_dir(args.directory, args.partitions)  # type: ignore[no-untyped-call]
        print(f"recovery store with {args.partitions} partition(s) in {args.directory}")
    elif args.command == "replay":
        return replay.run(args, settings)
    elif args.command == "outbox":
        return _outbox(args, settings)
    return 0


def _outbox(args: argparse.Namespace, settings: Settings) -> int:
    import psycopg

    from sinks.outbox import parked_rows, requeue_parked

    with psycopg.connect(settings.database_dsn(), autocommit=True) as conn:
        if args.outbox_command == "parked":
            rows = parked_rows(conn, limit=1000)
            print(f"{'id':<38}{'topic':<45}{'attempts':>9}  {'error':<24}{'parked at':<34}bytes")
            for row_id, topic, attempts, error, parked_at, size in rows:
                print(f"{row_id!s:<38}{topic:<45}{attempts:>9}  {error:<24}"
                      f"{parked_at.isoformat():<34}{size}")
            print(f"{len(rows)} parked row(s)")
            return 0
        count = requeue_parked(conn, None if args.all else args.ids)
    print(f"requeued {count} parked outbox row(s): the publisher sends them within seconds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
