"""A record whose header name is not UTF-8, on real Kafka and PostgreSQL, through both flows.

confluent-kafka cannot give such a record's headers (``msg.headers()`` raises); raised from the
input, it stopped the job on that record at every start. Now the record takes its normal way
without headers, and the records around it theirs.
"""

from __future__ import annotations

import uuid
from typing import Any

import orjson
import psycopg
import pytest

from dataflows.favorite_actions import build_flow as build_favorites_flow
from dataflows.session_linking import build_flow as build_session_linking_flow
from devenv.harness.messages import favorite_envelope, new_id, sign_in_envelope
from devenv.harness.sessions import insert_session
from tests.conftest import SettingsFactory
from tests.raw_kafka import produce_raw
from tests.support import action_rows, consume_all, envelope_record, produce, run_flow

pytestmark = pytest.mark.e2e

TRACEPARENT = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
NOT_UTF8 = (b"\xff", b"x-\xff\xfe-name", b"\xc3\x28")
WARM = 1000
"""Records with a header read before the hostile ones: CPython then specializes a plain call of
``msg.headers()`` into a direct C call that does not check for a raised exception; the list
came back holding a NULL, and reading it crashed the process (a segmentation fault)."""


def test_favorites_with_a_header_name_that_is_not_utf8_are_recorded_and_so_are_their_neighbours(
    make_settings: SettingsFactory, db: psycopg.Connection[Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    settings = make_settings()
    anonymous = new_id()
    insert_session(db, anonymous_id=anonymous, user_id=new_id())
    topic = settings.topic_favorite_added
    before = [favorite_envelope(anonymous_id=anonymous) for _ in range(WARM)]
    after = favorite_envelope(anonymous_id=anonymous)
    hostile = [favorite_envelope(anonymous_id=anonymous) for _ in NOT_UTF8]
    produce(settings, [envelope_record(topic, envelope, partition=2, headers=(("x", b"1"),))
                       for envelope in before])
    for envelope, name in zip(hostile, NOT_UTF8, strict=True):
        produce_raw(settings.kafka_bootstrap_servers, topic, 2, key=b"hostile",
                    value=orjson.dumps(envelope),
                    headers=[(name, b"v"), (b"traceparent", TRACEPARENT)])
    produce_raw(settings.kafka_bootstrap_servers, topic, 2, key=b"poison", value=b"{not json",
                headers=[(b"\xff", b"v")])
    produce(settings, [envelope_record(topic, after, partition=2)])

    run_flow(build_favorites_flow, settings)

    ids = [uuid.UUID(e["MessageId"]) for e in (*before, *hostile, after)]
    assert {row["source_message_id"] for row in action_rows(db, ids)} == set(ids)
    tracked = consume_all(settings, settings.topic_action_tracked, expect_at_least=len(ids))
    assert sorted(uuid.UUID(r.json()["Payload"]["FavoriteId"]) for r in tracked) == sorted(
        uuid.UUID(e["Payload"]["FavoriteId"]) for e in (*before, *hostile, after))
    (letter,) = consume_all(settings, settings.topic_favorites_dlq, expect_at_least=1)
    assert (letter.key, letter.value, letter.header("x-dlq-reason")) == (
        b"poison", b"{not json", b"invalid-json")
    unreadable = [r for r in caplog.records if r.getMessage() == "input-headers-unreadable"]
    assert [r.__dict__["source"] for r in unreadable] == [
        f"{topic}[2]@{offset}" for offset in range(WARM, WARM + 4)]


def test_a_sign_in_with_a_header_name_that_is_not_utf8_links_its_device(
    make_settings: SettingsFactory, db: psycopg.Connection[Any]
) -> None:
    settings = make_settings()
    anonymous, user = new_id(), new_id()
    session = insert_session(db, anonymous_id=anonymous)
    produce_raw(settings.kafka_bootstrap_servers, settings.topic_user_signed_in, 1, key=b"hostile",
                value=orjson.dumps(sign_in_envelope(user_id=user, anonymous_id=anonymous)),
                headers=[(b"\xc3\x28", b"v")])

    run_flow(build_session_linking_flow, settings)

    assert db.execute("SELECT user_id FROM user_activity.sessions WHERE id = %s",
                      (session,)).fetchone() == (user,)
    assert len(consume_all(settings, settings.topic_session_linked, expect_at_least=1)) == 1
