"""Operator commands of the user-activity stream: user-activity COMMAND (or python -m cli).

Settings are the USER_ACTIVITY_* variables (docs/configuration.md). Every command is idempotent.
Exit codes: 0 done; 2 refused (a bad setting, a missing right, a problem check found);
75 PostgreSQL or Kafka down or silent for 10 s: run it again. COMMAND --help says more.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any
from uuid import UUID

from runtime.configuration import load_settings
from runtime.logs import configure_logging
from runtime.settings import Settings

CONNECT_TIMEOUT_S = 10
UNAVAILABLE = 75


def _at_least_one(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return int(text)


def main(argv: list[str] | None = None) -> int:
    """Run one operator command; settings come from ``USER_ACTIVITY_*``."""
    from cli import check, maintain, migrate, replay, topics

    parser = argparse.ArgumentParser(prog="user-activity", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)

    def command(name: str, summary: str, module: Any = None) -> argparse.ArgumentParser:
        return commands.add_parser(name, help=summary, description=module and module.__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)

    command("migrate", "apply pending SQL migrations (one run at a time)", migrate)
    create = command("create-topics", "create the topics this service owns", topics)
    create.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    create.add_argument("--allow-single-replica", action="store_true",
                        help="allow replication factor 1 on a cluster of several brokers")
    checking = command("check", "check what the job needs before it starts", check)
    checking.add_argument("--flow", choices=(*check.FLOWS, "both"), default="both",
                          help="the flow whose needs are checked (default both)")
    checking.add_argument("--transactions", action="store_true",
                          help="also initialize the outbox's transactional id (librdkafka cannot"
                               " describe one): a running publisher is fenced and restarts")
    recovery = command("init-recovery", "create a Bytewax recovery store in a directory")
    recovery.add_argument("directory", type=Path)
    recovery.add_argument(
        "--partitions", type=_at_least_one, default=4,
        help="recovery partitions: at least the largest planned worker count (default 4)")
    outbox = command("outbox", "parked outbox rows (list, give back); the stream's progress")
    outbox_commands = outbox.add_subparsers(dest="outbox_command", required=True)
    outbox_commands.add_parser(
        "adopt-watermark", help="start the stream's progress in Kafka from the PostgreSQL"
                                " watermark (at least once for the rows after it)")
    outbox_commands.add_parser("parked", help="list parked rows (id, topic, attempts, error)")
    requeue = outbox_commands.add_parser(
        "requeue", help="re-publish parked rows once the cause is fixed (idempotent)")
    which = requeue.add_mutually_exclusive_group(required=True)
    which.add_argument("--id", dest="ids", action="append", type=UUID, metavar="ID",
                       help="a parked row's id (repeatable)")
    which.add_argument("--all", action="store_true", help="every parked row")
    command("maintain", "create the daily partitions ahead, drop the expired ones", maintain)
    replay.add_arguments(command("replay", "replay or backfill a flow's input (bounded)", replay))
    args = parser.parse_args(argv)
    settings = load_settings()
    configure_logging(settings.log_level)
    if args.command == "replay":  # its flow waits out outages itself (paused, said)
        return replay.run(args, settings)
    import psycopg
    from confluent_kafka import KafkaException

    name = " ".join(filter(None, (args.command, getattr(args, "outbox_command", None))))
    try:
        return _run(args, settings)
    except psycopg.OperationalError as exc:
        if not _postgres_unavailable(exc):
            raise  # not the service's state (e.g. a program limit): a bug to see whole
        reason = (f"no answer within {CONNECT_TIMEOUT_S} s (the server accepts connections and"
                  " does not answer)" if isinstance(exc, psycopg.errors.ConnectionTimeout)
                  else " ".join(str(exc).split()))
        print(f"user-activity {name}: PostgreSQL: {reason}; run it again once it answers",
              file=sys.stderr, flush=True)
    except (KafkaException, TimeoutError) as exc:
        error = exc.args[0] if exc.args else "no answer"
        text = getattr(error, "str", lambda: error)()
        if isinstance(exc, KafkaException) and not _kafka_unavailable(exc):
            print(f"user-activity {name}: Kafka ({settings.kafka_bootstrap_servers}) refused:"
                  f" {text}; fix the settings or the grants", file=sys.stderr, flush=True)
            return 2
        print(f"user-activity {name}: Kafka ({settings.kafka_bootstrap_servers}):"
              f" {text}; run it again once it answers", file=sys.stderr, flush=True)
    return UNAVAILABLE


def _postgres_unavailable(exc: BaseException) -> bool:
    # a failed connect (no SQLSTATE), or an infrastructure class other than 42 (a migration's)
    from sinks.errors import is_infrastructure_error

    state = getattr(exc, "sqlstate", None)
    return state is None or (is_infrastructure_error(exc) and not state.startswith("42"))


def _kafka_unavailable(exc: BaseException) -> bool:
    # the broker is not there or not answering; anything else (a right, a policy) is refused
    from confluent_kafka import KafkaError

    error = exc.args[0] if exc.args else None
    if not isinstance(error, KafkaError):
        return True
    return error.code() in {
        KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN, KafkaError._TIMED_OUT,
        KafkaError._MSG_TIMED_OUT, KafkaError._RESOLVE, KafkaError.REQUEST_TIMED_OUT,
        KafkaError.NOT_CONTROLLER, KafkaError.LEADER_NOT_AVAILABLE,
        KafkaError.COORDINATOR_NOT_AVAILABLE, KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
        KafkaError.BROKER_NOT_AVAILABLE, KafkaError.NETWORK_EXCEPTION, KafkaError._WAIT_COORD,
        KafkaError._DESTROY}


def _run(args: argparse.Namespace, settings: Settings) -> int:
    if args.command == "migrate":
        from cli.migrate import MigrationBusy, MigrationRefused, apply_migrations

        logging.getLogger("yoyo").setLevel(logging.WARNING)  # a line per step; ours sums up
        try:
            applied = apply_migrations(settings.database_dsn(),
                                       connect_options=settings.database_tcp_options())
        except MigrationRefused as exc:
            print(f"user-activity migrate: {exc}", file=sys.stderr)
            return 2
        except MigrationBusy as exc:
            print(f"user-activity migrate: {exc}", file=sys.stderr)
            return UNAVAILABLE
        print(f"applied {len(applied)} migration(s): {', '.join(applied) or '-'}")
    elif args.command == "create-topics":
        from cli.topics import create_topics

        return create_topics(settings, dry_run=args.dry_run,
                             allow_single_replica=args.allow_single_replica)
    elif args.command == "check":
        from cli import check

        return check.run(settings, check.FLOWS if args.flow == "both" else (args.flow,),
                         transactions=args.transactions)
    elif args.command == "init-recovery":
        from bytewax.recovery import init_db_dir

        from runtime.bytewax_0_21 import recovery

        if held := sorted(p.name for p in args.directory.glob("part-*.sqlite3")):
            print(f"user-activity init-recovery: {args.directory} already holds a recovery"
                  f" store ({', '.join(held)}); nothing changed", file=sys.stderr)
            return 2
        args.directory.mkdir(parents=True, exist_ok=True)
        recovery.require_room(args.directory, settings.recovery_min_free_bytes)
        init_db_dir(args.directory, args.partitions)  # type: ignore[no-untyped-call]
        print(f"recovery store with {args.partitions} partition(s) in {args.directory}")
    elif args.command == "outbox":
        from cli import outbox as outbox_command

        return outbox_command.run(args, settings)
    elif args.command == "maintain":
        from cli import maintain

        return maintain.run(settings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
