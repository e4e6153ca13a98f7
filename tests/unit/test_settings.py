"""Settings: one frozen object read from ``USER_ACTIVITY_*`` variables, secrets kept secret."""

from __future__ import annotations

import os

import pytest
from pydantic import SecretStr, ValidationError

from runtime.settings import ENV_PREFIX, Settings, StartingOffset

SASL_PASSWORD = "s3cr3t-sasl-password"
KEY_PASSWORD = "s3cr3t-key-password"
DB_PASSWORD = "s3cr3t-db-password"


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """No ``USER_ACTIVITY_*`` variable of the machine running the tests leaks in."""
    for name in list(os.environ):
        if name.upper().startswith(ENV_PREFIX):
            monkeypatch.delenv(name)


def secure_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("USER_ACTIVITY_KAFKA_BOOTSTRAP_SERVERS", "kafka-0:9093,kafka-1:9093")
    monkeypatch.setenv("USER_ACTIVITY_KAFKA_SECURITY_PROTOCOL", "SASL_SSL")
    monkeypatch.setenv("USER_ACTIVITY_KAFKA_SASL_MECHANISM", "SCRAM-SHA-512")
    monkeypatch.setenv("USER_ACTIVITY_KAFKA_SASL_USERNAME", "svc-user-activity")
    monkeypatch.setenv("USER_ACTIVITY_KAFKA_SASL_PASSWORD", SASL_PASSWORD)
    monkeypatch.setenv("USER_ACTIVITY_KAFKA_SSL_CA_LOCATION", "/etc/kafka/ca.pem")
    monkeypatch.setenv("USER_ACTIVITY_KAFKA_SSL_CERTIFICATE_LOCATION", "/etc/kafka/client.pem")
    monkeypatch.setenv("USER_ACTIVITY_KAFKA_SSL_KEY_LOCATION", "/etc/kafka/client.key")
    monkeypatch.setenv("USER_ACTIVITY_KAFKA_SSL_KEY_PASSWORD", KEY_PASSWORD)
    monkeypatch.setenv(
        "USER_ACTIVITY_DATABASE_URL", f"postgresql://svc:{DB_PASSWORD}@db:5432/user_activity"
    )


def test_defaults_name_the_spec_topics() -> None:
    settings = Settings()

    assert settings.topic_favorite_added == "pin.favorites.favorite-added.v1"
    assert settings.topic_favorite_removed == "pin.favorites.favorite-removed.v1"
    assert settings.topic_action_tracked == "pin.user-activity.action-tracked.v1"
    assert settings.topic_favorites_dlq == "pin.user-activity.favorites-dlq.v1"
    assert settings.topic_user_signed_in == "pin.identity.user-signed-in.v1"
    assert settings.topic_session_linked == "pin.user-activity.session-linked.v1"
    assert settings.topic_partitions == 6


def test_defaults_follow_the_failure_policy() -> None:
    settings = Settings()

    assert (settings.retry_initial_seconds, settings.retry_max_seconds) == (1.0, 60.0)
    assert settings.poison_attempts == 3
    assert settings.starting_offset is StartingOffset.EARLIEST


def test_all_topics_lists_every_spec_topic_once() -> None:
    settings = Settings()

    topics = settings.all_topics()

    assert len(topics) == len(set(topics))
    assert {
        "pin.favorites.favorite-added.v1",
        "pin.favorites.favorite-removed.v1",
        "pin.user-activity.action-tracked.v1",
        "pin.user-activity.favorites-dlq.v1",
        "pin.identity.user-signed-in.v1",
        "pin.user-activity.session-linked.v1",
    } <= set(topics)


def test_settings_are_read_from_user_activity_prefixed_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("USER_ACTIVITY_TOPIC_FAVORITE_ADDED", "test.favorite-added")
    monkeypatch.setenv("USER_ACTIVITY_POISON_ATTEMPTS", "5")
    monkeypatch.setenv("USER_ACTIVITY_STARTING_OFFSET", "latest")
    monkeypatch.setenv("USER_ACTIVITY_TAIL", "false")

    settings = Settings()

    assert settings.topic_favorite_added == "test.favorite-added"
    assert settings.poison_attempts == 5
    assert settings.starting_offset is StartingOffset.LATEST
    assert settings.tail is False


@pytest.mark.parametrize(
    "name", ["TOPIC_FAVORITE_ADDED", "BYTEWAX_TOPIC_FAVORITE_ADDED", "KAFKA_BOOTSTRAP_SERVERS"]
)
def test_unprefixed_or_foreign_prefixed_variables_are_ignored(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    monkeypatch.setenv(name, "ignored")

    settings = Settings()

    assert settings.topic_favorite_added == "pin.favorites.favorite-added.v1"
    assert settings.kafka_bootstrap_servers == "127.0.0.1:9092"


def test_invalid_value_is_rejected_at_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("USER_ACTIVITY_POISON_ATTEMPTS", "0")

    with pytest.raises(ValidationError):
        Settings()


def test_settings_are_frozen() -> None:
    settings = Settings()

    with pytest.raises(ValidationError):
        settings.topic_favorite_added = "other"  # type: ignore[misc]


def test_secrets_never_appear_in_repr_or_str(monkeypatch: pytest.MonkeyPatch) -> None:
    secure_environment(monkeypatch)

    settings = Settings()

    rendered = repr(settings) + str(settings) + settings.model_dump_json()
    for secret in (SASL_PASSWORD, KEY_PASSWORD, DB_PASSWORD):
        assert secret not in rendered
    assert isinstance(settings.kafka_sasl_password, SecretStr)
    assert isinstance(settings.database_url, SecretStr)


def test_database_dsn_reveals_the_url_for_the_connection_factory_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    secure_environment(monkeypatch)

    settings = Settings()

    assert settings.database_dsn() == f"postgresql://svc:{DB_PASSWORD}@db:5432/user_activity"


def test_plaintext_client_config_carries_no_sasl_or_tls_settings() -> None:
    settings = Settings()

    config = settings.kafka_client_config()

    assert config == {
        "bootstrap.servers": "127.0.0.1:9092",
        "security.protocol": "PLAINTEXT",
        "client.id": "user-activity-stream",
        "socket.timeout.ms": 30_000,
        "socket.connection.setup.timeout.ms": 10_000,
    }


def test_client_config_includes_sasl_and_tls_settings_when_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    secure_environment(monkeypatch)

    config = Settings().kafka_client_config()

    assert config == {
        "bootstrap.servers": "kafka-0:9093,kafka-1:9093",
        "security.protocol": "SASL_SSL",
        "client.id": "user-activity-stream",
        "socket.timeout.ms": 30_000,
        "socket.connection.setup.timeout.ms": 10_000,
        "sasl.mechanism": "SCRAM-SHA-512",
        "sasl.username": "svc-user-activity",
        "sasl.password": SASL_PASSWORD,
        "ssl.ca.location": "/etc/kafka/ca.pem",
        "ssl.certificate.location": "/etc/kafka/client.pem",
        "ssl.key.location": "/etc/kafka/client.key",
        "ssl.key.password": KEY_PASSWORD,
    }


def test_client_config_includes_only_the_tls_settings_that_are_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("USER_ACTIVITY_KAFKA_SECURITY_PROTOCOL", "SSL")
    monkeypatch.setenv("USER_ACTIVITY_KAFKA_SSL_CA_LOCATION", "/etc/kafka/ca.pem")

    config = Settings().kafka_client_config()

    assert config["security.protocol"] == "SSL"
    assert config["ssl.ca.location"] == "/etc/kafka/ca.pem"
    assert not any(key.startswith("sasl.") for key in config)
    assert "ssl.key.password" not in config
