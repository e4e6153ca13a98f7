"""Operator commands: ``python -m runtime migrate | create-topics | init-recovery | replay``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from runtime.logs import configure_logging
from runtime.settings import Settings


def main(argv: list[str] | None = None) -> int:
    """Run one operator command; settings come from ``USER_ACTIVITY_*``."""
    parser = argparse.ArgumentParser(prog="python -m runtime", description=__doc__)
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
    from runtime import replay

    replay_parser = commands.add_parser(
        "replay",
        help="replay/backfill the favorites topics (bounded; --dry-run writes nothing)",
        description=replay.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    replay.add_arguments(replay_parser)
    args = parser.parse_args(argv)
    settings = Settings()
    configure_logging(settings.log_level)

    if args.command == "migrate":
        from runtime.migrate import apply_migrations

        applied = apply_migrations(settings.database_dsn())
        print(f"applied {len(applied)} migration(s): {', '.join(applied) or '-'}")
    elif args.command == "create-topics":
        from runtime.topics import ensure_topics

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
    return 0


if __name__ == "__main__":
    sys.exit(main())
