"""``create-topics`` and ``check`` on the suite's one broker and PostgreSQL."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from confluent_kafka.admin import AdminClient, ConfigResource  # type: ignore[attr-defined]

from cli import check
from cli.topics import create_topics, input_topics, own_topics
from runtime.settings import Settings
from tests.conftest import SettingsFactory

pytestmark = pytest.mark.e2e


def _fresh_settings(kafka_bootstrap: str, database_url: str, **overrides: Any) -> Settings:
    """Settings whose topics do not exist yet."""
    prefix = f"t.create-topics.{uuid.uuid4().hex[:8]}"
    topics: dict[str, Any] = {
        name: f"{prefix}.{name.removeprefix('topic_')}" for name in Settings.model_fields
        if name.startswith("topic_") and isinstance(Settings.model_fields[name].default, str)}
    return Settings(kafka_bootstrap_servers=kafka_bootstrap, database_url=database_url,
                    **topics, **overrides)


def _described(settings: Settings, topics: list[str]) -> dict[str, tuple[int, int, str]]:
    """``{topic: (partitions, replicas, min.insync.replicas)}`` of those that exist."""
    admin = AdminClient(settings.kafka_client_config())
    metadata = admin.list_topics(timeout=10).topics
    found = [t for t in topics if t in metadata]
    if not found:
        return {}
    configs = admin.describe_configs([ConfigResource(ConfigResource.Type.TOPIC, t) for t in found])
    isr = {r.name: f.result(10)["min.insync.replicas"].value for r, f in configs.items()}
    return {t: (len(metadata[t].partitions), len(metadata[t].partitions[0].replicas), isr[t])
            for t in found}


def _cleanup_policy(settings: Settings, topic: str) -> str:
    admin = AdminClient(settings.kafka_client_config())
    [future] = admin.describe_configs([ConfigResource(ConfigResource.Type.TOPIC, topic)]).values()
    return str(future.result(10)["cleanup.policy"].value)


def test_create_topics_on_one_broker_makes_only_our_topics_with_one_replica_and_says_why(
    kafka_bootstrap: str, database_url: str, capsys: pytest.CaptureFixture[str],
) -> None:
    settings = _fresh_settings(kafka_bootstrap, database_url)
    ours, theirs = own_topics(settings), input_topics(settings)

    assert create_topics(settings, dry_run=True) == 0
    planned = capsys.readouterr().out
    assert _described(settings, ours + theirs) == {}
    assert create_topics(settings) == 0
    made = capsys.readouterr().out

    assert "1 broker(s)" in planned and "(one broker: replication factor 1)" in planned
    assert [line.split()[-2:] for line in planned.splitlines()[2:]] == [["would", "create"]] * 7
    assert [line.split()[-1] for line in made.splitlines()[2:]] == ["create"] * 7
    progress = settings.topic_outbox_progress
    assert _described(settings, ours + theirs) == {
        **dict.fromkeys(ours, (6, 1, "1")), progress: (1, 1, "1")}
    assert _cleanup_policy(settings, progress) == "compact"


def test_an_existing_topic_that_differs_is_named_and_left_as_is(
    kafka_bootstrap: str, database_url: str, capsys: pytest.CaptureFixture[str],
) -> None:
    settings = _fresh_settings(kafka_bootstrap, database_url)
    assert create_topics(settings) == 0
    capsys.readouterr()

    assert create_topics(settings.model_copy(update={"topic_partitions": 3})) == 2

    lines = capsys.readouterr().err.splitlines()
    progress = settings.topic_outbox_progress  # one partition, whatever the setting
    assert lines == [f"user-activity create-topics: {topic}: partitions 6 (want 3): an existing"
                     " topic is never changed (change it by hand, or the settings)"
                     for topic in own_topics(settings) if topic != progress]
    assert _described(settings, own_topics(settings)) == {
        **dict.fromkeys(own_topics(settings), (6, 1, "1")), progress: (1, 1, "1")}


def test_check_of_a_complete_setup_exits_0_and_names_each_missing_topic_in_one_line(
    make_settings: SettingsFactory, capsys: pytest.CaptureFixture[str],
) -> None:
    settings = make_settings()
    assert check.run(settings) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("complete")

    missing = settings.model_copy(update={"topic_user_signed_in": f"{uuid.uuid4().hex}.absent"})
    assert check.run(missing) == 2
    assert check.run(missing, ["favorites"]) == 0  # not a topic the favorites flow reads

    err = capsys.readouterr().err.splitlines()
    assert err == [f"user-activity check: topic {missing.topic_user_signed_in}: missing (its"
                   " owners create it)"]
