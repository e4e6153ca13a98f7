"""The one configuration object of the service, read from ``USER_ACTIVITY_*`` variables.

Validated once at start-up and passed explicitly; no other module reads ``os.environ``.
Secrets (the database URL, Kafka SASL password, TLS key password) are ``SecretStr`` so they never
appear in a log line or a ``repr``.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

ENV_PREFIX = "USER_ACTIVITY_"


class StartingOffset(StrEnum):
    """Where an input step starts when no snapshot says otherwise."""

    EARLIEST = "earliest"
    LATEST = "latest"


class Settings(BaseSettings):
    """Every setting of the service; see README's table for what each one does."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, frozen=True, extra="ignore")

    # Kafka connection (applies to every client the job creates: consumers, outbox, DLQ).
    kafka_bootstrap_servers: str = "127.0.0.1:9092"
    kafka_security_protocol: str = "PLAINTEXT"
    kafka_sasl_mechanism: str | None = None
    kafka_sasl_username: str | None = None
    kafka_sasl_password: SecretStr | None = None
    kafka_ssl_ca_location: str | None = None
    kafka_ssl_certificate_location: str | None = None
    kafka_ssl_key_location: str | None = None
    kafka_ssl_key_password: SecretStr | None = None
    kafka_client_id: str = "user-activity-stream"

    # PostgreSQL.
    database_url: SecretStr = SecretStr("postgresql://postgres@127.0.0.1:5432/user_activity")
    db_statement_timeout_ms: int = Field(default=30_000, ge=100)

    # Topics (defaults: SPEC §2).
    topic_favorite_added: str = "pin.favorites.favorite-added.v1"
    topic_favorite_removed: str = "pin.favorites.favorite-removed.v1"
    topic_action_tracked: str = "pin.user-activity.action-tracked.v1"
    topic_favorites_dlq: str = "pin.user-activity.favorites-dlq.v1"
    topic_user_signed_in: str = "pin.identity.user-signed-in.v1"
    topic_session_linked: str = "pin.user-activity.session-linked.v1"
    # Assumption: the session-started/ended contracts are not among our documents.
    topic_session_started: str = "pin.user-activity.session-started.v1"
    topic_session_ended: str = "pin.user-activity.session-ended.v1"
    topic_session_linking_dlq: str = "pin.user-activity.session-linking-dlq.v1"
    topic_partitions: int = Field(default=6, ge=1)

    # Input.
    starting_offset: StartingOffset = StartingOffset.EARLIEST
    tail: bool = True
    source_batch_size: int = Field(default=1000, ge=1)

    # Favorites flow.
    dedup_ttl_seconds: float = Field(default=86_400.0, gt=0)
    sink_batch_max: int = Field(default=2000, ge=1)
    sink_partitions: int = Field(default=2, ge=1)
    # A favorites batch of at least this many messages commits while the worker goes on: the
    # insert is sent, write_batch returns, and the next write_batch or the epoch's snapshot
    # waits for the commit (dataflows/favorite_actions/sink.py). 0: every batch commits at once.
    sink_defer_min_batch: int = Field(default=500, ge=0)

    # Memory: glibc malloc_trim(0) every N seconds gives the heap freed after a burst back to
    # the OS (runtime/memory.py); 0 disables.
    malloc_trim_interval_seconds: float = Field(default=5.0, ge=0)
    # The cyclic garbage collector (runtime/gc_tuning.py): a young collection every N net
    # allocations once the flow is built (0: Python's defaults) and a full one every N seconds.
    gc_young_threshold: int = Field(default=100_000, ge=0)
    gc_full_collect_interval_seconds: float = Field(default=60.0, ge=0)
    poison_attempts: int = Field(default=3, ge=1)

    # Back-off for infrastructure failures: retried forever.
    retry_initial_seconds: float = Field(default=1.0, gt=0)
    retry_max_seconds: float = Field(default=60.0, gt=0)

    # Outbox publisher.
    outbox_enabled: bool = True
    outbox_batch_size: int = Field(default=1000, ge=1)
    outbox_idle_poll_seconds: float = Field(default=0.5, gt=0)
    outbox_retention_seconds: float = Field(default=3_600.0, ge=0)
    outbox_sweep_grace_seconds: float = Field(default=5.0, ge=0)
    # /readyz turns 503 (and the stall alert fires) when the oldest committed, unpublished and
    # unparked outbox row is older than this.
    outbox_stall_seconds: float = Field(default=60.0, gt=0)

    # Consumer groups the snapshotted input offsets are committed to after each snapshot, for
    # lag tools only (kafka-consumer-groups, exporters, KEDA): positions come from the recovery
    # snapshots, never from these commits. Empty: no commits.
    consumer_group_favorites: str = "pin-user-activity-favorites"
    consumer_group_session_linking: str = "pin-user-activity-session-linking"

    # HTTP (Prometheus /metrics, /livez, /readyz); 0 disables it.
    http_port: int = Field(default=9100, ge=0, le=65535)
    http_host: str = "0.0.0.0"

    log_level: str = "INFO"

    def kafka_client_config(self) -> dict[str, Any]:
        """Librdkafka settings shared by every client (connection, TLS, SASL)."""
        config: dict[str, Any] = {
            "bootstrap.servers": self.kafka_bootstrap_servers,
            "security.protocol": self.kafka_security_protocol,
            "client.id": self.kafka_client_id,
        }
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
            if value is None:
                continue
            config[key] = value.get_secret_value() if isinstance(value, SecretStr) else value
        return config

    def database_dsn(self) -> str:
        """The database URL in clear, for the connection factory only."""
        return self.database_url.get_secret_value()

    def all_topics(self) -> list[str]:
        """Every topic the service reads or writes (the topic-creation helper makes these)."""
        return [
            self.topic_favorite_added,
            self.topic_favorite_removed,
            self.topic_action_tracked,
            self.topic_favorites_dlq,
            self.topic_user_signed_in,
            self.topic_session_linked,
            self.topic_session_started,
            self.topic_session_ended,
            self.topic_session_linking_dlq,
        ]
