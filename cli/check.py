"""Check what the job needs, before it starts: one table, then one line per problem.

Kafka, as the job's principal: each topic exists, and the broker's own verdict (KIP-430
authorized operations) lets it READ the inputs and groups, WRITE the outputs and dead letters,
READ and WRITE the outbox's progress, DESCRIBE USER_ACTIVITY_START_FROM_GROUP; nothing is
written. ``--transactions`` also initializes the outbox's transactional id (its WRITE): that
fences a running publisher, which restarts (nothing lost or sent twice). PostgreSQL: it
connects, the role's privileges, every migration applied (unknown newer ones are shown).
Exit 0: complete; 2: problems (one line each on stderr); 75: Kafka or PostgreSQL did not answer.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any, TextIO

import psycopg
from confluent_kafka import (
    ConsumerGroupTopicPartitions,
    KafkaError,
    KafkaException,
    TopicCollection,
)

from cli import table
from cli.migrate import MIGRATIONS_DIR
from cli.topics import admin_client, own_topics
from runtime.settings import Settings
from runtime.shutdown import Shutdown
from sinks.outbox.stream import OutcomeUnknownError, StreamFencedError, TransactionalStream

FLOWS = ("favorites", "session-linking")

TABLES = {
    "sessions": "SELECT, INSERT, UPDATE", "action_events": "SELECT, INSERT",
    "waiting_actions": "SELECT, INSERT, UPDATE, DELETE",
    "consumer_idempotency_marks": "SELECT, INSERT",
    "consumer_idempotency_marks_default": "SELECT, DELETE", "outbox": "SELECT, INSERT",
    "outbox_default": "SELECT, DELETE", "outbox_parked": "SELECT, INSERT, UPDATE, DELETE",
    "outbox_held": "SELECT, INSERT, DELETE", "outbox_watermark": "SELECT, UPDATE",
    "sign_in_conflicts": "SELECT, INSERT, DELETE", "stream_stops": "SELECT, INSERT"}
MAINTAINED = ("outbox", "consumer_idempotency_marks")
MAINTENANCE_FUNCTION = "user_activity.ensure_daily_partitions(date, date)"

Row = tuple[str, str, bool, str]


def run(settings: Settings, flows: Iterable[str] = FLOWS, out: TextIO | None = None, *,
        transactions: bool = False) -> int:
    """Check, print the table and a line per problem; the exit code (0 or 2)."""
    out = out or sys.stdout
    rows = [*kafka_rows(settings, tuple(flows)), *postgres_rows(settings)]
    if transactions and settings.outbox_enabled:
        rows.append(transactional_id_row(settings))
    print(table(("check", "name", "result", "found"),
                [(kind, name, "ok" if ok else "FAIL", found) for kind, name, ok, found in rows]),
          file=out, flush=True)
    problems = [f"user-activity check: {kind} {name}: {found}"
                for kind, name, ok, found in rows if not ok]
    for line in problems:
        print(line, file=sys.stderr, flush=True)
    print(f"{len(problems)} problem(s): the job would not run as it should" if problems
          else "complete: everything the job needs is there", file=out)
    return 2 if problems else 0


def needs(settings: Settings, flows: tuple[str, ...]) -> tuple[dict[str, str], dict[str, str]]:
    """What ``flows`` need: ``{topic: operation}``, ``{consumer group: operation}``."""
    topics: dict[str, str] = {}
    groups: dict[str, str] = {}
    if "favorites" in flows:
        topics |= {settings.topic_favorite_added: "READ", settings.topic_favorite_removed: "READ",
                   settings.topic_favorites_dlq: "WRITE"}
        groups[settings.consumer_group_favorites] = "READ"
    if "session-linking" in flows:
        topics |= {settings.topic_user_signed_in: "READ",
                   settings.topic_session_linking_dlq: "WRITE"}
        groups[settings.consumer_group_session_linking] = "READ"
    if settings.outbox_enabled:
        topics |= dict.fromkeys(settings.outbox_topics(), "WRITE")
        topics[settings.topic_outbox_progress] = "READ, WRITE"  # read back at every start
    if settings.start_from_group:
        groups[settings.start_from_group] = "DESCRIBE"
    groups.pop("", None)  # no group: no commits
    return topics, groups


def kafka_rows(settings: Settings, flows: tuple[str, ...]) -> list[Row]:
    """A row per topic and consumer group the flows need (module doc)."""
    topics, groups = needs(settings, flows)
    admin = admin_client(settings.kafka_client_config())
    rows: list[Row] = []
    described = admin.describe_topics(TopicCollection(list(topics)),
                                      include_authorized_operations=True, request_timeout=10)
    for topic, future in described.items():
        wanted = topics[topic]
        try:
            found = future.result()
        except KafkaException as exc:
            rows.append(("topic", topic, False, _refused(exc, wanted, topic in own_topics(
                settings))))
            continue
        replicas = len(found.partitions[0].replicas) if found.partitions else 0
        lacking = _lacking(wanted, found.authorized_operations)
        rows.append(("topic", topic, not lacking,
                     f"{len(found.partitions)} partitions, RF {replicas}; "
                     + (f"no {wanted} for this principal" if lacking else wanted)))
    if not groups:
        return rows
    described = admin.describe_consumer_groups(list(groups), include_authorized_operations=True,
                                               request_timeout=10)
    for group, future in described.items():
        wanted = groups[group]
        try:
            lacking = _lacking(wanted, future.result().authorized_operations)
        except KafkaException as exc:
            rows.append(("group", group, False, _refused(exc, wanted, False)))
            continue
        found = f"no {wanted} for this principal" if lacking else wanted
        if group == settings.start_from_group and not lacking:
            found += f" (start from its offsets: {_committed(admin, group, topics)})"
        rows.append(("group", group, not lacking, found))
    return rows


def transactional_id_row(settings: Settings) -> Row:
    """The outbox's transactional id, initialized for real (the only check librdkafka has)."""
    name = settings.outbox_transactional_id
    stream = TransactionalStream(settings, stopping=Shutdown())
    try:
        stream.open()
    except (StreamFencedError, OutcomeUnknownError) as exc:  # fatal: the refusal, named
        unauthorized = str(exc) == "TRANSACTIONAL_ID_AUTHORIZATION_FAILED"
        return ("transactional-id", name, False,
                "no WRITE for this principal" if unauthorized else f"refused ({exc})")
    finally:
        stream.close()
    return ("transactional-id", name, True, "WRITE (initialized)")


def _lacking(wanted: str, authorized: list[Any] | None) -> bool:
    if authorized is None:
        return False
    names = {op.name for op in authorized}
    return any(op not in names for op in wanted.split(", "))


def _refused(exc: KafkaException, wanted: str, ours: bool) -> str:
    error = exc.args[0]
    if error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART:
        return ("missing (user-activity create-topics makes it)" if ours
                else "missing (its owners create it)")
    if error.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED:
        return f"no {wanted} for this principal (not even DESCRIBE), or missing"
    if error.code() == KafkaError.GROUP_AUTHORIZATION_FAILED:
        return f"no {wanted} for this principal (not even DESCRIBE)"
    raise exc


def _committed(admin: Any, group: str, topics: dict[str, str]) -> str:
    [future] = admin.list_consumer_group_offsets(
        [ConsumerGroupTopicPartitions(group)], request_timeout=10).values()
    committed = [p for p in future.result().topic_partitions
                 if topics.get(p.topic) == "READ" and p.offset >= 0]
    return f"committed offsets on {len(committed)} input partition(s)"


def postgres_rows(settings: Settings) -> list[Row]:
    """Connection, privileges, migration level (module doc)."""
    with psycopg.connect(settings.database_dsn(), autocommit=True, connect_timeout=10,
                         application_name="user-activity-check",
                         **settings.database_tcp_options()) as conn:
        role, database = _one(conn, "SELECT current_user::text, current_database()::text")
        rows: list[Row] = [("postgresql", f"{conn.info.host}:{conn.info.port}/{database}", True,
                            f"connected as {role}")]
        maintains = settings.maintenance_interval_seconds > 0
        schema = "USAGE, CREATE" if maintains else "USAGE"
        rows.append(_privileges("schema", "user_activity", schema, _one(
            conn, "SELECT CASE WHEN n IS NOT NULL THEN ARRAY(SELECT p FROM unnest(%s::text[]) p"
                  " WHERE NOT has_schema_privilege(n, p)) END FROM to_regnamespace(%s) n",
            (schema.split(", "), "user_activity"))))
        for name, wanted in TABLES.items():
            rows.append(_privileges("table", f"user_activity.{name}", wanted, _one(
                conn, "SELECT CASE WHEN c IS NOT NULL THEN ARRAY(SELECT p FROM unnest(%s::text[]) p"
                      " WHERE NOT has_table_privilege(c, p)) END FROM to_regclass(%s) c",
                (wanted.split(", "), f"user_activity.{name}"))))
        if maintains:
            rows += _maintenance(conn)
        rows.append(_migrations(conn))
    return rows


def _one(conn: psycopg.Connection[Any], query: str, params: Any = None) -> Any:
    row = conn.execute(query, params).fetchone()
    assert row is not None
    return row if len(row) > 1 else row[0]


def _privileges(kind: str, name: str, wanted: str, lacking: list[str] | None) -> Row:
    if lacking is None:
        return (kind, name, False, "missing (user-activity migrate makes it)")
    if lacking:
        return (kind, name, False, f"this role lacks {', '.join(lacking)} (needs {wanted})")
    return (kind, name, True, wanted)


def _maintenance(conn: psycopg.Connection[Any]) -> list[Row]:
    executes = _one(conn, "SELECT CASE WHEN f IS NOT NULL THEN has_function_privilege(f,"
                          " 'EXECUTE') END FROM to_regprocedure(%s) f", (MAINTENANCE_FUNCTION,))
    rows: list[Row] = [("function", MAINTENANCE_FUNCTION, bool(executes),
                        "EXECUTE" if executes else "missing" if executes is None
                        else "this role lacks EXECUTE")]
    for name in MAINTAINED:
        owns = _one(conn, "SELECT pg_has_role(relowner, 'USAGE') FROM pg_class"
                          " WHERE oid = to_regclass(%s)", (f"user_activity.{name}",))
        rows.append(("partitions", f"user_activity.{name}", bool(owns),
                     "owned (creates and drops daily partitions)" if owns else
                     "not owned by this role: it cannot create or drop the daily partitions"
                     " (run maintenance as the owner: USER_ACTIVITY_MAINTENANCE_INTERVAL_SECONDS"
                     "=0 and the CronJob)"))
    return rows


def _migrations(conn: psycopg.Connection[Any]) -> Row:
    files = {path.stem for path in MIGRATIONS_DIR.glob("*.sql")}
    try:
        applied = {row[0] for row in conn.execute("SELECT migration_id FROM _yoyo_migration")}
    except psycopg.errors.UndefinedTable:
        applied = set()
    except psycopg.Error as exc:
        return ("migrations", "_yoyo_migration", False, str(exc).splitlines()[0])
    pending, unknown = sorted(files - applied), sorted(applied - files)
    if pending:
        return ("migrations", f"{len(files)} files", False,
                f"not applied: {', '.join(pending)} (user-activity migrate)")
    return ("migrations", f"{len(files)} files", True, "all applied" + (
        f"; the database also has {', '.join(unknown)} (a newer release's)" if unknown else ""))
