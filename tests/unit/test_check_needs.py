"""What ``user-activity check`` reads is what the job uses."""

from __future__ import annotations

import re
from pathlib import Path

from cli import check
from cli.topics import input_topics, own_topics
from runtime.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("sinks", "dataflows", "runtime", "sources")


def test_the_job_needs_read_on_inputs_and_groups_write_on_its_topics_and_its_progress(
) -> None:
    settings = Settings()

    topics, groups = check.needs(settings, check.FLOWS)

    assert topics == {**dict.fromkeys(input_topics(settings), "READ"),
                      **dict.fromkeys(own_topics(settings), "WRITE"),
                      settings.topic_outbox_progress: "READ, WRITE"}
    assert groups == {settings.consumer_group_favorites: "READ",
                      settings.consumer_group_session_linking: "READ"}
    assert set(own_topics(settings)) | set(input_topics(settings)) == set(settings.all_topics())


def test_one_flow_needs_its_own_inputs_group_and_dead_letters_and_a_start_group_describe() -> None:
    settings = Settings(start_from_group="legacy")

    topics, groups = check.needs(settings, ("session-linking",))

    assert {t for t, op in topics.items() if op == "READ"} == {settings.topic_user_signed_in}
    assert settings.topic_session_linking_dlq in topics
    assert settings.topic_favorites_dlq not in topics
    assert groups == {settings.consumer_group_session_linking: "READ", "legacy": "DESCRIBE"}


def test_every_table_the_product_sql_names_has_its_privileges_checked() -> None:
    statement = re.compile(r"(?:FROM|JOIN|INTO|UPDATE|TABLE(?: ONLY)?|,)\s+user_activity\."
                           r"([a-z_]+)\b(?!\()")
    named = {table for folder in PRODUCT for path in (ROOT / folder).rglob("*")
             if path.suffix in {".py", ".sql"} for table in statement.findall(path.read_text())}

    assert named == set(check.TABLES)


def test_the_session_lifecycle_topics_are_needed_only_while_published() -> None:
    settings = Settings(publish_session_lifecycle=False)

    assert settings.topic_session_started not in own_topics(settings)
    assert settings.topic_session_ended not in own_topics(settings)
    assert settings.topic_session_started in own_topics(Settings())
