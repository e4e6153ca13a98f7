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
from pydantic import Field, SecretStr, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

ENV_PREFIX = "USER_ACTIVITY_"
_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
_BROKER = re.compile(  # [protocol://]host[:port], the forms librdkafka reads
    r"(?:(?:" + "|".join(_PROTOCOLS) + r")://)?(?:\[[0-9A-Fa-f:.]+\]|[^\s:/,\[\]]+)(?::\d{1,5})?",
    re.IGNORECASE)


class StartingOffset(StrEnum):
    """Where an input step starts when no snapshot says otherwise."""

    EARLIEST = "earliest"
    LATEST = "latest"


class Settings(BaseSettings):
    """Every setting of the service (docs/configuration.md is generated from these fields)."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, frozen=True, extra="ignore",
                                      allow_inf_nan=False)

    # Kafka connection.
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
        description="A connection whose server stops answering, even TCP, fails after about"
                    " this long (retried); the server ends a vanished job's session as fast,"
                    " releasing its locks and the outbox lease. `0`: the OS's ~2 hours.")

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
    topic_session_started: str = Field(
        "pin.user-activity.session-started.v1",
        description="Output (outbox): session-started (assumed contract).")
    topic_session_ended: str = Field(
        "pin.user-activity.session-ended.v1",
        description="Output (outbox): session-ended (assumed contract).")
    publish_session_lifecycle: bool = Field(
        True, description="Announce the sessions session linking starts and ends (session-linked"
                          " is always sent); `false`: no outbox row for them.")
    topic_session_linking_dlq: str = Field(
        "pin.user-activity.session-linking-dlq.v1", description="Dead letters of session linking.")
    topic_outbox_progress: str = Field(
        "pin.user-activity.outbox-progress.v1",
        description="The outbox stream's progress, committed in each of its Kafka transactions:"
                    " one partition, compacted, the stream's own (`create-topics`).")
    topic_partitions: int = Field(6, ge=1, description="Partitions `create-topics` makes.")
    topic_replication_factor: int = Field(
        3, ge=1, le=32,
        description="Replication factor of our topics (`create-topics`); 1 on one broker.")
    topic_min_insync_replicas: int = Field(
        2, ge=1, le=32,
        description="`min.insync.replicas` of our topics, at most the replication factor.")

    # Input.
    starting_offset: StartingOffset = Field(
        StartingOffset.EARLIEST,
        description="`earliest` or `latest`: where a partition without a snapshot starts.")
    start_from_group: str = Field(
        "",
        description="Start a partition without a snapshot at this group's committed offset"
                    " (a cutover), else at `starting_offset`. Empty: none.")
    tail: bool = Field(
        True, description="`false`: stop at the end offsets seen at start (a bounded run).")
    source_batch_size: int = Field(
        1000, ge=1, le=1_000_000, description="Records per poll per partition.")
    source_fetch_wait_ms: int = Field(
        10, ge=0, le=5000,
        description="How long the broker may hold a worker's fetch to gather 64 KiB: the most"
                    " the input adds to latency when traffic is light. Longer: fewer fetches.")
    source_stuck_seconds: float = Field(
        30.0, ge=0,
        description="A partition that read nothing for this long while records wait (two"
                    " checks) stops the job with exit code 75; `0`: never.")
    source_receive_max_bytes: int = Field(
        100_000_000, ge=2_000_000, le=2_147_483_647,
        description="The largest zstd batch, decompressed, an input reads (librdkafka"
                    " `receive.message.max.bytes`); a larger one is skipped, counted and logged"
                    " (`input-records-undecodable`): replay it with a larger value.")
    source_partition_check_seconds: float = Field(
        60.0, ge=0,
        description="How often the job checks whether an input topic gained partitions (then"
                    " exit code 75: the restart reads them from their first record); `0`: never.")

    # Favorites flow.
    dedup_ttl_seconds: float = Field(
        86_400.0, gt=0, le=366 * 86_400,
        description="How long the in-memory dedup window remembers a MessageId.")
    dedup_max_ids: int = Field(
        2_000_000, ge=1,
        description="The most MessageIds a flow's dedup windows hold over all its processes"
                    " (~24 bytes each): beyond it the oldest are forgotten early (counted) and the"
                    " database finds their redeliveries duplicate. Bounds memory and snapshots.")
    sink_batch_max: int = Field(2000, ge=1, description="Messages per transaction at most.")
    sink_partitions: int = Field(
        2, ge=1,
        description="Sink partitions (one connection each); at least the total worker count.")
    favorites_session_wait_seconds: int = Field(
        30, ge=0, le=86_400,
        description="A favorite whose owner has no session yet waits this long for one"
                    " (`waiting_actions`), then is skipped as `no-session`; `0`: at once. A replay"
                    " never waits. Keep it above the session-linking lateness.")
    sink_defer_min_batch: int = Field(
        500, ge=0,
        description="A favorites batch this large, written during a backlog, commits while the"
                    " worker goes on (the next write or snapshot waits); `0`: never deferred.")

    # Memory and the garbage collector.
    malloc_trim_interval_seconds: float = Field(
        5.0, ge=0,
        description="Give freed heap back to the OS (`malloc_trim(0)`) this often; `0`: never.")
    gc_young_threshold: int = Field(
        1_000_000, ge=0, le=2_147_483_647,
        description="Start-up heap frozen, a young collection every N net allocations, no"
                    " automatic full one; `0`: Python's defaults.")
    gc_full_collect_interval_seconds: float = Field(
        60.0, ge=0, description="A full `gc.collect()` this often instead; `0`: never.")
    session_linking_lateness_seconds: float = Field(
        10.0, ge=0, le=86_400,
        description="Allowed lateness of sign-ins: each device's are applied in SignedInAt"
                    " order once its watermark minus this passed them; a later one that would"
                    " change a session's owner is a `late-conflict`.")
    session_linking_max_pending: int = Field(
        50_000, ge=16, le=10_000_000,
        description="The most sign-ins the reorder buffer holds (~2.7 KB each); over it the"
                    " devices due first are applied early (counted): bounded memory.")
    session_linking_max_clock_skew_seconds: float = Field(
        60.0, ge=0, le=366 * 86_400,
        description="A SignedInAt further ahead of the job's clock is taken as the time it"
                    " was read (logged `sign-in-from-the-future`).")
    poison_attempts: int = Field(
        3, ge=1, description="Immediate attempts before a message is dead-lettered.")

    stop_grace_seconds: float = Field(
        20.0, ge=0,
        description="After SIGTERM, how long a commit or publish blocked by an outage retries;"
                    " then exit code 75 (nothing lost). Below `terminationGracePeriodSeconds`.")

    # Back-off for infrastructure failures: retried forever.
    retry_initial_seconds: float = Field(
        1.0, gt=0, description="First back-off delay after an infrastructure failure.")
    retry_max_seconds: float = Field(60.0, gt=0, description="Longest back-off delay.")

    # Outbox publisher.
    outbox_enabled: bool = Field(
        True, description="Run the outbox publisher (and its stall watchdog) in this process.")
    outbox_batch_size: int = Field(
        1000, ge=1, description="Rows a window reads back per page (one Kafka transaction).")
    outbox_transactional_id: str = Field(
        "user-activity-outbox", min_length=1,
        description="The outbox stream's Kafka `transactional.id`: whichever process holds the"
                    " lease publishes with it, fencing any earlier one. One per database, as"
                    " its progress topic: two databases on one stream would read each other's"
                    " progress.")
    outbox_transaction_timeout_ms: int = Field(
        60_000, ge=1_000, le=900_000,
        description="`transaction.timeout.ms`: the broker aborts a transaction open this long"
                    " (a holder that died and has no successor yet); above the message time-out.")
    outbox_message_timeout_ms: int = Field(
        30_000, ge=1_000, le=300_000,
        description="`message.timeout.ms` of the outbox producer: a transaction waiting this"
                    " long for a partition's leader is aborted and sent again. Above the"
                    " brokers' session time-out plus 5 s (a frozen leader's failover).")
    outbox_lease_seconds: float = Field(
        30.0, ge=1,
        description="A lease holder whose PostgreSQL session stays idle this long (frozen, or"
                    " waiting out an outage) loses the lease to a standby.")
    outbox_idle_poll_seconds: float = Field(
        0.25, gt=0,
        description="How often the lease holder looks for other processes' rows, and a"
                    " standby tries to take the lease.")
    outbox_fast_path_grace_seconds: float = Field(
        0.5, ge=0,
        description="Rows committed less than this long ago are left to the fast path (from"
                    " memory); older ones are read back and sent.")
    outbox_stall_seconds: float = Field(
        60.0, gt=0,
        description="`/readyz` is 503 (the stall alert fires) while the oldest unpublished,"
                    " unparked outbox row is older than this.")

    # Retention: daily partitions dropped by the maintenance step.
    retention_days: int = Field(
        7, ge=1, le=3_660,
        description="Idempotency marks and published outbox rows are kept at least this"
                    " long (longer than any replay window), then dropped by daily partition.")
    maintenance_interval_seconds: float = Field(
        3_600.0, ge=0,
        description="How often the job runs the maintenance step itself; `0`: only"
                    " `user-activity maintain` (a CronJob) does.")

    # The Bytewax recovery store (`python -m bytewax.run ... -r DIR`).
    recovery_min_free_bytes: int = Field(
        128 * 1024 * 1024, ge=0,
        description="Free space the recovery volume needs (the largest snapshot twice): with"
                    " less the job does not start (`recovery-volume-full`, exit code 74) and"
                    " `UserActivityRecoveryVolumeLow` fires. `0`: never checked.")

    # Consumer groups for lag tools only.
    consumer_group_favorites: str = Field(
        "pin-user-activity-favorites",
        description="Snapshotted favorites offsets are also committed here, for lag tools"
                    " only; empty: no commits.")
    consumer_group_session_linking: str = Field(
        "pin-user-activity-session-linking", description="The same for the user-signed-in input.")

    # HTTP (Prometheus /metrics, /livez, /readyz).
    http_port: int = Field(
        9100, ge=0, le=65535, description="`/metrics`, `/livez`, `/readyz`; `0` disables.")
    http_host: str = Field("0.0.0.0", description="Address the HTTP server binds.")

    log_level: str = Field(
        "INFO", description="JSON log lines on stderr at this level (`DEBUG` ... `CRITICAL`).")

    @field_validator("kafka_bootstrap_servers")
    @classmethod
    def _brokers(cls, value: str) -> str:
        # else an unknown scheme (`http://`) is retried forever as a broker outage
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

    @field_validator("outbox_message_timeout_ms")
    @classmethod
    def _below_the_transaction_timeout(cls, value: int, info: ValidationInfo) -> int:
        limit = info.data.get("outbox_transaction_timeout_ms")
        if limit is not None and value >= limit:  # librdkafka refuses the producer
            raise ValueError(f"must be below USER_ACTIVITY_OUTBOX_TRANSACTION_TIMEOUT_MS ({limit})")
        return value

    @field_validator("log_level")
    @classmethod
    def _a_level(cls, value: str) -> str:
        if value.upper() not in _LEVELS:
            raise ValueError(f"not one of {', '.join(_LEVELS)}")
        return value.upper()

    @field_validator("database_url")
    @classmethod
    def _a_dsn(cls, value: SecretStr) -> SecretStr:
        # else every write fails without an SQLSTATE; key=value: yoyo takes only a URL
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
                                  # the Java client's: a silent broker is given up sooner
                                  "socket.timeout.ms": 30_000,
                                  "socket.connection.setup.timeout.ms": 10_000}
        optional: dict[str, str | SecretStr | None] = {
            "sasl.mechanism": self.kafka_sasl_mechanism, "sasl.username": self.kafka_sasl_username,
            "sasl.password": self.kafka_sasl_password,
            "ssl.ca.location": self.kafka_ssl_ca_location,
            "ssl.certificate.location": self.kafka_ssl_certificate_location,
            "ssl.key.location": self.kafka_ssl_key_location,
            "ssl.key.password": self.kafka_ssl_key_password}
        for key, value in optional.items():
            if value is not None:
                config[key] = value.get_secret_value() if isinstance(value, SecretStr) else value
        return config

    def database_dsn(self) -> str:
        """The database URL in clear, for the connection factory only."""
        return self.database_url.get_secret_value()

    def database_tcp_options(self) -> dict[str, Any]:
        """The libpq parameters that end a dead connection in ``db_dead_connection_seconds``.

        At both ends: client keepalives and TCP user timeout, and the same as the session's GUCs
        (``options``), so the server drops a vanished job's locks and outbox lease as fast.
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

    def outbox_topics(self) -> list[str]:
        """The outbox's outputs (the session lifecycle topics only while published)."""
        lifecycle = [self.topic_session_started, self.topic_session_ended] \
            if self.publish_session_lifecycle else []
        return [self.topic_action_tracked, self.topic_session_linked, *lifecycle]

    def all_topics(self) -> list[str]:
        """Every topic the service reads or writes: the ``topic_*`` fields (``create-topics``)."""
        return [getattr(self, name) for name in type(self).model_fields
                if name.startswith("topic_") and isinstance(getattr(self, name), str)]
