"""The one configuration object of the service, read from ``USER_ACTIVITY_*`` variables.

Validated once at start-up and passed explicitly; no other module reads ``os.environ``.
Secrets (the database URL, Kafka SASL password, TLS key password) are ``SecretStr`` so they never
appear in a log line or a ``repr``.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict
from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

ENV_PREFIX = "USER_ACTIVITY_"
_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
_BROKER = re.compile(
    r"(?:(?:" + "|".join(_PROTOCOLS) + r")://)?(?:\[[0-9A-Fa-f:.]+\]|[^\s:/,\[\]]+)(?::\d{1,5})?",
    re.IGNORECASE)
"""One bootstrap server: ``[protocol://]host[:port]``, the forms librdkafka reads."""


class StartingOffset(StrEnum):
    """Where an input step starts when no snapshot says otherwise."""

    EARLIEST = "earliest"
    LATEST = "latest"


class Settings(BaseSettings):
    """Every setting of the service (docs/configuration.md is generated from these fields)."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, frozen=True, extra="ignore",
                                      allow_inf_nan=False)

    # Kafka connection (applies to every client the job creates: consumers, outbox, DLQ).
    kafka_bootstrap_servers: str = Field(
        "127.0.0.1:9092", description="Kafka bootstrap servers (every client of the job).")
    kafka_security_protocol: str = Field(
        "PLAINTEXT", description="`PLAINTEXT`, `SSL`, `SASL_PLAINTEXT` or `SASL_SSL`.")
    kafka_sasl_mechanism: str | None = Field(
        None, description="SASL mechanism of the m2m ACL credentials (e.g. `SCRAM-SHA-512`).")
    kafka_sasl_username: str | None = Field(None, description="SASL user name.")
    kafka_sasl_password: SecretStr | None = Field(
        None, description="SASL password (secret: never logged).")
    kafka_ssl_ca_location: str | None = Field(None, description="CA bundle file for TLS.")
    kafka_ssl_certificate_location: str | None = Field(
        None, description="Client certificate file for TLS.")
    kafka_ssl_key_location: str | None = Field(None, description="Client key file for TLS.")
    kafka_ssl_key_password: SecretStr | None = Field(
        None, description="Password of the client key (secret).")
    kafka_client_id: str = Field(
        "user-activity-stream", description="Prefix of every Kafka client id.")

    # PostgreSQL.
    database_url: SecretStr = Field(
        SecretStr("postgresql://postgres@127.0.0.1:5432/user_activity"),
        description="PostgreSQL URI, `postgresql://user:password@host:port/database?...`"
                    " (secret: never logged).")
    db_statement_timeout_ms: int = Field(
        30_000, ge=100, le=2_147_483_647,
        description="Statement timeout; a timeout is an infrastructure failure (retried).")
    db_dead_connection_seconds: float = Field(
        30.0, ge=0, le=86_400,
        description="A PostgreSQL connection whose server stops answering, even TCP"
                    " (its host or address gone in a failover, no reset sent), fails after about"
                    " this long and is retried (TCP keepalives and user timeout); and the server"
                    " ends the session of a job that vanished (its node lost) as fast, releasing"
                    " its locks and the outbox lease. `0`: the OS's defaults, about two hours.")

    # Topics (defaults: the specification, docs/spec.md).
    topic_favorite_added: str = Field(
        "pin.favorites.favorite-added.v1", description="Input: favorite-added.")
    topic_favorite_removed: str = Field(
        "pin.favorites.favorite-removed.v1", description="Input: favorite-removed.")
    topic_action_tracked: str = Field(
        "pin.user-activity.action-tracked.v1", description="Output (outbox): action-tracked.")
    topic_favorites_dlq: str = Field(
        "pin.user-activity.favorites-dlq.v1", description="Dead letters of the favorites flow.")
    topic_user_signed_in: str = Field(
        "pin.identity.user-signed-in.v1", description="Input of session linking.")
    topic_session_linked: str = Field(
        "pin.user-activity.session-linked.v1", description="Output (outbox): session-linked.")
    # Assumption: the session-started/ended contracts are not among our documents.
    topic_session_started: str = Field(
        "pin.user-activity.session-started.v1",
        description="Output (outbox): session-started (assumed contract).")
    topic_session_ended: str = Field(
        "pin.user-activity.session-ended.v1",
        description="Output (outbox): session-ended (assumed contract).")
    publish_session_lifecycle: bool = Field(
        True, description="Announce the sessions session linking starts and ends on the"
                          " session-started and session-ended topics (our own contracts); `false`:"
                          " no outbox row is written for them (session-linked is always sent).")
    topic_session_linking_dlq: str = Field(
        "pin.user-activity.session-linking-dlq.v1",
        description="Dead letters of session linking.")
    topic_partitions: int = Field(6, ge=1, description="Partitions `create-topics` makes.")
    topic_replication_factor: int = Field(
        3, ge=1, le=32,
        description="Replication factor of the topics we own (`create-topics`); 1 on a"
                    " one-broker cluster (detected).")
    topic_min_insync_replicas: int = Field(
        2, ge=1, le=32,
        description="`min.insync.replicas` of the topics we own (`create-topics`), at most the"
                    " replication factor.")

    # Input.
    starting_offset: StartingOffset = Field(
        StartingOffset.EARLIEST,
        description="`earliest` or `latest`: where a partition without a snapshot starts.")
    start_from_group: str = Field(
        "",
        description="A consumer group whose committed offsets are where a partition without a"
                    " snapshot starts (cutover from an existing consumer); a partition it has"
                    " no offset for starts at `starting_offset`. Empty: none.")
    tail: bool = Field(
        True, description="`false`: stop at the end offsets seen at start (a bounded run).")
    source_batch_size: int = Field(
        1000, ge=1, le=1_000_000, description="Records per poll per partition.")
    source_fetch_wait_ms: int = Field(
        10, ge=0, le=5000,
        description="How long the broker may hold a fetch of a worker's consumer (one per"
                    " worker, for all its input partitions) to gather 64 KiB: the most the input"
                    " adds to a record's latency when traffic is light. Longer: fewer fetches.")
    source_stuck_seconds: float = Field(
        30.0, ge=0,
        description="A partition that read nothing for this long while the broker says records"
                    " are waiting, at two checks this far apart, stops the job with exit code 75"
                    " (librdkafka can stop fetching an assigned partition after a broker"
                    " restart); `0`: never.")
    source_receive_max_bytes: int = Field(
        100_000_000, ge=2_000_000, le=2_147_483_647,
        description="The largest zstd record batch, once decompressed, that an input consumer"
                    " reads (librdkafka `receive.message.max.bytes`, which also bounds a fetch"
                    " response; librdkafka holds no other codec's batches to it). A zstd batch"
                    " larger than this (a highly compressible huge record) cannot be read: it is"
                    " skipped, counted and logged (`input-records-undecodable`). To read it,"
                    " replay its offsets with a larger value.")
    source_partition_check_seconds: float = Field(
        60.0, ge=0,
        description="How often the job asks the broker whether an input topic gained"
                    " partitions; if one did, the job stops cleanly with exit code 75 so its"
                    " restart reads them from their first record (Bytewax lists partitions"
                    " only at start); `0`: never.")

    # Favorites flow.
    dedup_ttl_seconds: float = Field(
        86_400.0, gt=0, le=366 * 86_400,
        description="How long the in-memory dedup window remembers a MessageId.")
    dedup_max_ids: int = Field(
        2_000_000, ge=1,
        description="The most MessageIds a flow's in-memory dedup windows hold, over all its"
                    " processes (about 24 bytes each, twice that while a snapshot is taken):"
                    " beyond it the oldest are forgotten before the TTL (counted in"
                    " `user_activity_dedup_forgotten_early_total`) and their redeliveries are"
                    " found duplicate by the database instead. Bounds the job's memory and its"
                    " snapshots whatever the input's volume (a replay, a backfill).")
    sink_batch_max: int = Field(2000, ge=1, description="Messages per transaction at most.")
    sink_partitions: int = Field(
        2, ge=1,
        description="Fixed sink partitions (one connection each), spread over all workers;"
                    " keep it at least the total worker count.")
    favorites_session_wait_seconds: int = Field(
        30, ge=0, le=86_400,
        description="A favorite whose owner has no session yet (its sign-in is still being"
                    " applied: a new user's first like) waits this long for one in"
                    " `waiting_actions`, checked every second, before it is skipped as"
                    " `no-session`; `0`: skipped at once. A bounded run (replay) never waits."
                    " Keep it above the session-linking lateness.")
    sink_defer_min_batch: int = Field(
        500, ge=0,
        description="A favorites batch of at least this many messages, written while the"
                    " inputs read a backlog, commits while the worker goes on (the next write"
                    " or the epoch's snapshot waits for it); `0`: every batch commits before"
                    " `write_batch` returns.")

    # Memory and the garbage collector.
    malloc_trim_interval_seconds: float = Field(
        5.0, ge=0,
        description="Give heap freed after a burst back to the OS (`malloc_trim(0)`) this"
                    " often; `0` disables.")
    gc_young_threshold: int = Field(
        1_000_000, ge=0, le=2_147_483_647,
        description="Once the flow is built: start-up heap frozen, a young collection every N"
                    " net allocations, no automatic full collection; `0`: Python's defaults.")
    gc_full_collect_interval_seconds: float = Field(
        60.0, ge=0,
        description="A full `gc.collect()` this often instead (frees reference cycles);"
                    " `0`: never.")
    session_linking_lateness_seconds: float = Field(
        10.0, ge=0, le=86_400,
        description="Allowed lateness of sign-ins: each device's sign-ins are held until its"
                    " event-time watermark minus this has passed them and applied in"
                    " SignedInAt order (linking waits up to this long); a sign-in later than"
                    " this that would change who owns a session is a `late-conflict`.")
    session_linking_max_pending: int = Field(
        50_000, ge=16, le=10_000_000,
        description="The most sign-ins the reorder buffer holds (about 2.7 KB each), spread"
                    " over its 16 device shards: over it, the devices due first are applied"
                    " early (`user_activity_session_linking_released_early_total`), so a"
                    " backlog read faster than the lateness releases it cannot fill the pod's"
                    " memory.")
    session_linking_max_clock_skew_seconds: float = Field(
        60.0, ge=0, le=366 * 86_400,
        description="A SignedInAt further ahead of the job's clock than this (a producer's"
                    " clock or time zone wrong) is taken as the moment the job read the sign-in"
                    " (logged `sign-in-from-the-future`): else that one sign-in would make every"
                    " real one of its device look late until then.")
    poison_attempts: int = Field(
        3, ge=1, description="Immediate attempts before a message is dead-lettered.")

    stop_grace_seconds: float = Field(
        20.0, ge=0,
        description="After SIGTERM, how long a commit or publish blocked by an outage keeps"
                    " retrying; then the process exits with code 75, leaving it to the next"
                    " start (nothing is lost). Keep it below the pod's"
                    " `terminationGracePeriodSeconds` (30).")

    # Back-off for infrastructure failures: retried forever.
    retry_initial_seconds: float = Field(
        1.0, gt=0, description="First back-off delay after an infrastructure failure.")
    retry_max_seconds: float = Field(60.0, gt=0, description="Longest back-off delay.")

    # Outbox publisher.
    outbox_enabled: bool = Field(
        True, description="Run the outbox publisher (and its stall watchdog) in this process.")
    outbox_batch_size: int = Field(1000, ge=1, description="Rows per publish cycle.")
    outbox_idle_poll_seconds: float = Field(
        0.25, gt=0,
        description="How often the publisher holding the lease looks for rows committed by"
                    " other processes (its own process's commits wake it at once), and how"
                    " often a standby publisher tries to take the lease.")
    outbox_fast_path_grace_seconds: float = Field(
        0.5, ge=0,
        description="A publish window leaves rows committed less than this long ago to the fast"
                    " path (the committing process hands them over from memory); older ones it"
                    " reads back from the table and sends. Rows committed by other processes"
                    " reach the topic this much later; a stop or drain waits for nothing.")
    outbox_stall_seconds: float = Field(
        60.0, gt=0,
        description="`/readyz` is 503 (and the stall alert fires) while the oldest committed,"
                    " unpublished, unparked outbox row is older than this.")

    # Retention (bounded storage): daily partitions dropped by the maintenance step.
    retention_days: int = Field(
        7, ge=1, le=3_660,
        description="Idempotency marks and published outbox rows are kept at least this many"
                    " days (longer than any redelivery or replay window), then dropped a daily"
                    " partition at a time (`user-activity maintain`).")
    maintenance_interval_seconds: float = Field(
        3_600.0, ge=0,
        description="How often the job runs the maintenance step itself (partitions created"
                    " ahead, expired ones dropped; one process at a time); `0`: only the"
                    " `user-activity maintain` command (a CronJob) does.")

    # The Bytewax recovery store (`python -m bytewax.run ... -r DIR`).
    recovery_min_free_bytes: int = Field(
        128 * 1024 * 1024, ge=0,
        description="The free space the recovery directory's volume needs: at least the largest"
                    " snapshot twice (the dedup windows, about 21 bytes per id, and their copy in"
                    " SQLite's write-ahead log). With less, the job does not start (one"
                    " `recovery-volume-full` line, exit code 74), and a crash while the volume"
                    " is that full says so; `user_activity_recovery_volume_free_bytes` below it"
                    " fires `UserActivityRecoveryVolumeLow`. `0`: never checked.")

    # Consumer groups for lag tools only.
    consumer_group_favorites: str = Field(
        "pin-user-activity-favorites",
        description="Snapshotted offsets of the favorites inputs are also committed here after"
                    " each snapshot, for lag tools only (positions come from the recovery"
                    " snapshots); empty: no commits.")
    consumer_group_session_linking: str = Field(
        "pin-user-activity-session-linking",
        description="The same for the user-signed-in input.")

    # HTTP (Prometheus /metrics, /livez, /readyz).
    http_port: int = Field(
        9100, ge=0, le=65535, description="`/metrics`, `/livez`, `/readyz`; `0` disables.")
    http_host: str = Field("0.0.0.0", description="Address the HTTP server binds.")

    log_level: str = Field(
        "INFO", description="JSON log lines on stderr at this level (`DEBUG`, `INFO`, `WARNING`,"
                            " `ERROR`, `CRITICAL`).")

    @field_validator("kafka_bootstrap_servers")
    @classmethod
    def _brokers(cls, value: str) -> str:
        # A scheme librdkafka does not know (`http://`) or an empty list was retried forever as
        # a broker outage, silently.
        for broker in value.split(","):
            if _BROKER.fullmatch(broker.strip()) is None:
                raise ValueError("not a comma-separated list of host[:port] (an optional"
                                 " PLAINTEXT://, SSL://, SASL_PLAINTEXT:// or SASL_SSL:// before)")
        return value

    @field_validator("kafka_security_protocol")
    @classmethod
    def _a_protocol(cls, value: str) -> str:
        if value.upper() not in _PROTOCOLS:  # librdkafka panicked the job on another
            raise ValueError(f"not one of {', '.join(_PROTOCOLS)}")
        return value.upper()

    @field_validator("log_level")
    @classmethod
    def _a_level(cls, value: str) -> str:
        if value.upper() not in _LEVELS:
            raise ValueError(f"not one of {', '.join(_LEVELS)}")
        return value.upper()

    @field_validator("database_url")
    @classmethod
    def _a_dsn(cls, value: SecretStr) -> SecretStr:
        # A URL libpq cannot parse (`postgresql+psycopg://`, `jdbc:postgresql://`) failed every
        # write without an SQLSTATE, as a data error: every message was dead-lettered.
        # A key=value string works for psycopg but not for the migrations (yoyo takes a URL).
        dsn = value.get_secret_value()
        try:
            conninfo_to_dict(dsn)
        except psycopg.ProgrammingError:
            valid = False
        else:
            valid = dsn.startswith(("postgresql://", "postgres://"))
        if not valid:  # the message never quotes the value: it holds the password
            raise ValueError("not a postgresql:// URI that libpq reads")
        return value

    def kafka_client_config(self) -> dict[str, Any]:
        """Librdkafka settings shared by every client (connection, TLS, SASL)."""
        config: dict[str, Any] = {"bootstrap.servers": self.kafka_bootstrap_servers,
                                  "security.protocol": self.kafka_security_protocol,
                                  "client.id": self.kafka_client_id,
                                  # Java's client's request and connection set-up time-outs
                                  # (librdkafka: 60 s and 30 s): a request to a broker that
                                  # accepts and never answers fails sooner, so its partitions'
                                  # leadership moves sooner, and producers see it sooner
                                  "socket.timeout.ms": 30_000,
                                  "socket.connection.setup.timeout.ms": 10_000}
        optional: dict[str, str | SecretStr | None] = {
            "sasl.mechanism": self.kafka_sasl_mechanism,
            "sasl.username": self.kafka_sasl_username,
            "sasl.password": self.kafka_sasl_password,
            "ssl.ca.location": self.kafka_ssl_ca_location,
            "ssl.certificate.location": self.kafka_ssl_certificate_location,
            "ssl.key.location": self.kafka_ssl_key_location,
            "ssl.key.password": self.kafka_ssl_key_password,
        }
        for key, value in optional.items():
            if value is not None:
                config[key] = value.get_secret_value() if isinstance(value, SecretStr) else value
        return config

    def database_dsn(self) -> str:
        """The database URL in clear, for the connection factory only."""
        return self.database_url.get_secret_value()

    def database_tcp_options(self) -> dict[str, Any]:
        """The libpq parameters that end a dead connection in ``db_dead_connection_seconds``.

        At both ends. The client: keepalive probes while it waits for an answer (idle a third of
        it, then 4 probes a sixth apart: a server busy on a long statement still answers them)
        and a TCP user timeout on data sent and never acknowledged. The server, for this session
        (``options``: the same four settings as session GUCs): a job whose node vanished would
        otherwise keep its backend, its open transaction's locks and the outbox lease (a
        session advisory lock) for about two hours, and no other publisher could take over.
        """
        seconds = self.db_dead_connection_seconds
        if not seconds:
            return {}
        idle, interval, user_timeout_ms = (max(1, round(seconds / 3)),
                                           max(1, round(seconds / 6)), int(seconds * 1000))
        return {"keepalives": 1, "keepalives_idle": idle, "keepalives_interval": interval,
                "keepalives_count": 4, "tcp_user_timeout": user_timeout_ms,
                "options": f"-c tcp_keepalives_idle={idle} -c tcp_keepalives_interval={interval}"
                           f" -c tcp_keepalives_count=4 -c tcp_user_timeout={user_timeout_ms}"}

    def all_topics(self) -> list[str]:
        """Every topic the service reads or writes: the ``topic_*`` fields (``create-topics``)."""
        return [getattr(self, name) for name in type(self).model_fields
                if name.startswith("topic_") and isinstance(getattr(self, name), str)]
