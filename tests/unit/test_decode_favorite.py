"""decode_favorite (SPEC §4 steps 1-2): every record becomes a message, a skip or a dead letter."""

from __future__ import annotations

import json
import pickle
from typing import Any
from uuid import UUID

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dataflows.envelopes import EMPTY_GUID
from dataflows.favorite_actions.decode import (
    FavoriteMessage,
    Skipped,
    SkipReason,
    decode_favorite,
    uuid_text,
)
from dataflows.favorite_actions.store import owner_of
from dataflows.favorite_actions.wire import decode_fast
from schemas.dlq import DlqReason
from schemas.dlq_letter import DeadLetter
from schemas.favorites import ActionType
from schemas.kafka_record import SourceRecord
from schemas.outbox import MessageTrace

ADDED_TOPIC = "pin.favorites.favorite-added.v1"
REMOVED_TOPIC = "pin.favorites.favorite-removed.v1"
ACTION_TYPES = {
    ADDED_TOPIC: ActionType.ADD_TO_FAVORITES,
    REMOVED_TOPIC: ActionType.REMOVE_FROM_FAVORITES,
}

MESSAGE_ID = UUID("01938a4e-7c1a-7cc3-9a55-3f2b1c0d9e11")
FAVORITE_ID = UUID("5d1c2b3a-4e5f-4a6b-8c7d-9e0f1a2b3c4d")
PROPERTY_OBJECT_ID = UUID("a1b2c3d4-e5f6-4789-abcd-ef0123456789")
ANONYMOUS_ID = UUID("0f1e2d3c-4b5a-4968-8776-a5b4c3d2e1f0")
USER_ID = UUID("7c9e6679-7425-40de-944b-e07fc1f90ae7")
EMPTY = str(EMPTY_GUID)


def favorite_value(**overrides: Any) -> dict[str, Any]:
    """A valid favorites envelope (a guest like); ``Payload__X`` overrides a payload field."""
    payload: dict[str, Any] = {
        "FavoriteId": str(FAVORITE_ID),
        "PropertyObjectId": str(PROPERTY_OBJECT_ID),
        "UserId": None,
        "AnonymousId": str(ANONYMOUS_ID),
        "OccurredAt": "2026-11-29T11:00:00.1234567+03:00",
    }
    envelope: dict[str, Any] = {
        "MessageId": str(MESSAGE_ID),
        "CreatedAt": "2026-11-29T08:00:00.123+00:00",
        "Version": 1,
        "AggregateId": str(FAVORITE_ID),
        "AggregateType": "Favorite",
        "CorrelationId": "corr-1",
        "Payload": payload,
    }
    for name, value in overrides.items():
        if name.startswith("Payload__"):
            payload[name.removeprefix("Payload__")] = value
        else:
            envelope[name] = value
    return envelope


def record(value: bytes | None, topic: str = ADDED_TOPIC) -> SourceRecord:
    return SourceRecord(
        topic=topic,
        partition=3,
        offset=42,
        key=str(FAVORITE_ID).encode(),
        value=value,
        headers=(("traceparent", b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),),
    )


def encoded(envelope: dict[str, Any]) -> bytes:
    return json.dumps(envelope).encode()


# --- valid messages ---------------------------------------------------------------------------


def test_valid_favorite_added_decodes_to_an_add_to_favorites_message() -> None:
    source = record(encoded(favorite_value()), topic=ADDED_TOPIC)

    decoded = decode_favorite(source, ACTION_TYPES)

    assert isinstance(decoded, FavoriteMessage)
    assert decoded.action_type is ActionType.ADD_TO_FAVORITES
    assert decoded.record is source
    assert decoded.message_id == MESSAGE_ID
    assert decoded.envelope.payload.favorite_id == FAVORITE_ID
    assert decoded.envelope.payload.property_object_id == PROPERTY_OBJECT_ID
    assert decoded.envelope.correlation_id == "corr-1"
    assert decoded.version_mismatch is False


def test_valid_favorite_removed_takes_its_action_type_from_the_topic() -> None:
    source = record(encoded(favorite_value()), topic=REMOVED_TOPIC)

    decoded = decode_favorite(source, ACTION_TYPES)

    assert isinstance(decoded, FavoriteMessage)
    assert decoded.action_type is ActionType.REMOVE_FROM_FAVORITES


def test_guest_like_without_user_id_is_a_valid_owner() -> None:
    source = record(encoded(favorite_value(Payload__UserId=None)))

    decoded = decode_favorite(source, ACTION_TYPES)

    assert isinstance(decoded, FavoriteMessage)
    assert decoded.envelope.payload.user_id is None
    assert owner_of(decoded) == (ANONYMOUS_ID, None)


def test_signed_in_like_without_anonymous_id_is_owned_by_the_user() -> None:
    value = favorite_value(Payload__UserId=str(USER_ID), Payload__AnonymousId=None)

    decoded = decode_favorite(record(encoded(value)), ACTION_TYPES)

    assert isinstance(decoded, FavoriteMessage)
    assert owner_of(decoded) == (None, USER_ID)


def test_owner_fields_may_be_absent_rather_than_null() -> None:
    value = favorite_value()
    del value["Payload"]["UserId"]

    decoded = decode_favorite(record(encoded(value)), ACTION_TYPES)

    assert isinstance(decoded, FavoriteMessage)
    assert owner_of(decoded) == (ANONYMOUS_ID, None)


@pytest.mark.parametrize(
    ("topic", "action_type"),
    [(ADDED_TOPIC, "AddToFavorites"), (REMOVED_TOPIC, "RemoveFromFavorites")],
)
def test_idempotency_key_names_the_consumer_the_action_type_and_the_message_id(
    topic: str, action_type: str
) -> None:
    source = record(encoded(favorite_value(MessageId=str(MESSAGE_ID).upper())), topic=topic)

    decoded = decode_favorite(source, ACTION_TYPES)

    assert isinstance(decoded, FavoriteMessage)
    assert decoded.idempotency_key == f"user-activity-favorites:{action_type}:{MESSAGE_ID}"


def test_added_and_removed_with_the_same_message_id_have_distinct_dedup_ids() -> None:
    value = encoded(favorite_value())

    added = decode_favorite(record(value, ADDED_TOPIC), ACTION_TYPES)
    removed = decode_favorite(record(value, REMOVED_TOPIC), ACTION_TYPES)

    assert isinstance(added, FavoriteMessage)
    assert isinstance(removed, FavoriteMessage)
    assert added.dedup_id != removed.dedup_id
    assert len(added.dedup_id) == 17


@given(
    message_id=st.uuids(),
    owner=st.uuids(),
    by_user=st.booleans(),
    upper=st.booleans(),
    topic=st.sampled_from([ADDED_TOPIC, REMOVED_TOPIC]),
)
def test_keys_use_the_canonical_text_of_any_uuid_however_it_was_written(
    message_id: UUID, owner: UUID, by_user: bool, upper: bool, topic: str
) -> None:
    def written(value: UUID) -> str:
        return str(value).upper() if upper else str(value)

    value = favorite_value(
        MessageId=written(message_id),
        Payload__UserId=written(owner) if by_user else None,
        Payload__AnonymousId=None if by_user else written(owner),
    )

    decoded = decode_favorite(record(encoded(value), topic), ACTION_TYPES)

    assert isinstance(decoded, FavoriteMessage)
    action_type = ACTION_TYPES[topic].value
    assert decoded.idempotency_key == f"user-activity-favorites:{action_type}:{message_id}"
    assert owner_of(decoded) == ((None, owner) if by_user else (owner, None))
    prefix = b"A" if topic == ADDED_TOPIC else b"R"
    assert decoded.dedup_id == prefix + message_id.bytes


@given(value=st.uuids())
def test_uuid_text_is_str_of_the_uuid(value: UUID) -> None:
    assert uuid_text(value) == str(value)


def test_unknown_fields_and_a_payload_note_are_dropped() -> None:
    value = favorite_value(Payload__Note="private note", Extra="x")

    decoded = decode_favorite(record(encoded(value)), ACTION_TYPES)

    assert isinstance(decoded, FavoriteMessage)
    assert b"private note" not in msgspec.json.encode(decoded.envelope)


@pytest.mark.parametrize("version", [0, 2, 99])
def test_wrong_version_is_still_processed_and_flagged_as_a_mismatch(version: int) -> None:
    source = record(encoded(favorite_value(Version=version)))

    decoded = decode_favorite(source, ACTION_TYPES)

    assert isinstance(decoded, FavoriteMessage)
    assert decoded.version_mismatch is True


# --- dead letters -----------------------------------------------------------------------------


def test_tombstone_is_dead_lettered_with_reason_tombstone() -> None:
    source = record(None)

    decoded = decode_favorite(source, ACTION_TYPES)

    assert isinstance(decoded, DeadLetter)
    assert decoded.reason is DlqReason.TOMBSTONE
    assert decoded.record is source


def test_value_that_is_not_utf8_is_dead_lettered_with_reason_not_utf8() -> None:
    source = record(b'{"MessageId": "\xff\xfe"}')

    decoded = decode_favorite(source, ACTION_TYPES)

    assert isinstance(decoded, DeadLetter)
    assert decoded.reason is DlqReason.NOT_UTF8
    assert decoded.exception_type == "UnicodeDecodeError"


@pytest.mark.parametrize(
    "value",
    [b"", b"{", b"not json", b'{"MessageId": }', b"{'MessageId': 1}"],
    ids=["empty", "truncated", "text", "missing-value", "single-quotes"],
)
def test_value_that_is_not_json_is_dead_lettered_with_reason_invalid_json(value: bytes) -> None:
    decoded = decode_favorite(record(value), ACTION_TYPES)

    assert isinstance(decoded, DeadLetter)
    assert decoded.reason is DlqReason.INVALID_JSON


@pytest.mark.parametrize(
    "value",
    [
        favorite_value(MessageId="not-a-guid"),
        favorite_value(Payload__OccurredAt="2026-11-29T08:00:00"),
        favorite_value(Payload__FavoriteId=None),
        favorite_value(Payload=None),
        favorite_value(Version="one"),
        [favorite_value()],
        "a string",
    ],
    ids=[
        "bad-guid",
        "datetime-without-offset",
        "null-favorite-id",
        "null-payload",
        "non-integer-version",
        "array",
        "string",
    ],
)
def test_json_that_does_not_fit_the_contract_is_dead_lettered_with_reason_schema_mismatch(
    value: Any,
) -> None:
    source = record(json.dumps(value).encode())

    decoded = decode_favorite(source, ACTION_TYPES)

    assert isinstance(decoded, DeadLetter)
    assert decoded.reason is DlqReason.SCHEMA_MISMATCH
    assert decoded.exception_type == "ValidationError"


@pytest.mark.parametrize("field", ["MessageId", "CreatedAt", "Version", "Payload"])
def test_envelope_missing_a_required_field_is_a_schema_mismatch(field: str) -> None:
    value = favorite_value()
    del value[field]

    decoded = decode_favorite(record(encoded(value)), ACTION_TYPES)

    assert isinstance(decoded, DeadLetter)
    assert decoded.reason is DlqReason.SCHEMA_MISMATCH


def test_record_from_a_topic_without_an_action_type_is_a_processing_error() -> None:
    source = record(encoded(favorite_value()), topic="pin.favorites.favorite-renamed.v1")

    decoded = decode_favorite(source, ACTION_TYPES)

    assert isinstance(decoded, DeadLetter)
    assert decoded.reason is DlqReason.PROCESSING_ERROR
    assert decoded.exception_type == "KeyError"


def test_dead_letter_keeps_the_original_bytes_and_adds_the_dlq_headers() -> None:
    source = record(b"not json")

    decoded = decode_favorite(source, ACTION_TYPES)

    assert isinstance(decoded, DeadLetter)
    headers = dict(decoded.headers())
    assert decoded.record.value == b"not json"
    assert headers["traceparent"] == source.headers[0][1]
    assert headers["x-dlq-reason"] == b"invalid-json"
    assert headers["x-source-topic"] == ADDED_TOPIC.encode()
    assert headers["x-source-partition"] == b"3"
    assert headers["x-source-offset"] == b"42"
    assert headers["x-exception-type"] == b"ValidationError"
    assert headers["x-attempts"] == b"1"


# --- invalid owner: acknowledged, no row, no DLQ --------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        favorite_value(Payload__UserId=str(USER_ID), Payload__AnonymousId=str(ANONYMOUS_ID)),
        favorite_value(Payload__UserId=None, Payload__AnonymousId=None),
        favorite_value(Payload__UserId=None, Payload__AnonymousId=EMPTY),
        favorite_value(Payload__UserId=EMPTY, Payload__AnonymousId=None),
        favorite_value(Payload__UserId=EMPTY, Payload__AnonymousId=str(ANONYMOUS_ID)),
        favorite_value(Payload__FavoriteId=EMPTY),
        favorite_value(Payload__PropertyObjectId=EMPTY),
        favorite_value(MessageId=EMPTY),
    ],
    ids=[
        "both-owners",
        "neither-owner",
        "empty-anonymous-id",
        "empty-user-id",
        "empty-user-id-beside-anonymous-id",
        "empty-favorite-id",
        "empty-property-object-id",
        "empty-message-id",
    ],
)
def test_invalid_owner_or_empty_guid_is_skipped_as_invalid_owner(value: dict[str, Any]) -> None:
    source = record(encoded(value), topic=REMOVED_TOPIC)

    decoded = decode_favorite(source, ACTION_TYPES)

    assert isinstance(decoded, Skipped)
    assert decoded.reason is SkipReason.INVALID_OWNER
    assert decoded.record is source
    assert decoded.action_type is ActionType.REMOVE_FROM_FAVORITES
    assert decoded.message is not None
    assert decoded.message.message_id == UUID(value["MessageId"])


# --- never raises -----------------------------------------------------------------------------


@given(value=st.none() | st.binary(max_size=512), topic=st.sampled_from([*ACTION_TYPES, "x"]))
def test_arbitrary_bytes_never_raise(value: bytes | None, topic: str) -> None:
    source = record(value, topic=topic)

    decoded = decode_favorite(source, ACTION_TYPES)

    assert isinstance(decoded, FavoriteMessage | Skipped | DeadLetter)
    assert decoded.record is source


json_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=40)
)
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=12,
)
MISSING = object()
wrong_values = st.one_of(
    st.none(),
    st.just(MISSING),
    json_values,
    st.sampled_from(["", EMPTY, "2026-11-29T08:00:00", "01938a4e", "1"]),
)
"""What a corrupted field becomes: null, absent, any JSON value, or a near-miss string."""

guid_texts = st.uuids().map(str) | st.uuids().map(lambda u: str(u).upper()) | st.just(EMPTY)
datetime_texts = st.sampled_from(
    [
        "2026-11-29T08:00:00.1234567+03:00",
        "2026-11-29T08:00:00-05:30",
        "2026-11-29T08:00:00Z",
        "2026-11-29T08:00:00.123+00:00",
    ]
)


def corrupted(
    valid: dict[str, st.SearchStrategy[Any]], extra_names: list[str]
) -> st.SearchStrategy[dict[str, Any]]:
    """An object built from ``valid`` field strategies, with a few fields corrupted or added."""

    def apply(fields: dict[str, Any], corruptions: dict[str, Any], extra: dict[str, Any]) -> Any:
        merged = {**extra, **fields, **corruptions}
        return {name: value for name, value in merged.items() if value is not MISSING}

    return st.builds(
        apply,
        st.fixed_dictionaries(valid),
        st.dictionaries(st.sampled_from(sorted(valid)), wrong_values, max_size=3),
        st.dictionaries(st.sampled_from(extra_names), json_values, max_size=2),
    )


payloads = corrupted(
    {
        "FavoriteId": guid_texts,
        "PropertyObjectId": guid_texts,
        "UserId": st.none() | guid_texts,
        "AnonymousId": st.none() | guid_texts,
        "OccurredAt": datetime_texts,
    },
    ["Note", "Extra", "userId", "Tags"],
)
wrong_envelopes = corrupted(
    {
        "MessageId": guid_texts,
        "CreatedAt": datetime_texts,
        "Version": st.integers(-3, 3),
        "AggregateId": guid_texts,
        "AggregateType": st.just("Favorite"),
        "CorrelationId": st.none() | st.text(max_size=20),
        "Payload": payloads,
    },
    ["TenantId", "messageId", "Trace"],
)


@given(envelope=wrong_envelopes, topic=st.sampled_from(list(ACTION_TYPES)))
def test_structurally_valid_but_wrong_envelopes_never_raise(
    envelope: dict[str, Any], topic: str
) -> None:
    source = record(json.dumps(envelope).encode(), topic=topic)

    decoded = decode_favorite(source, ACTION_TYPES)

    assert isinstance(decoded, FavoriteMessage | Skipped | DeadLetter)
    if isinstance(decoded, DeadLetter):
        assert decoded.reason is DlqReason.SCHEMA_MISMATCH
    elif isinstance(decoded, FavoriteMessage):
        payload = decoded.envelope.payload
        assert (payload.user_id is None) != (payload.anonymous_id is None)
        assert EMPTY_GUID not in (
            decoded.message_id,
            payload.favorite_id,
            payload.property_object_id,
            payload.user_id,
            payload.anonymous_id,
        )
    else:
        assert decoded.reason is SkipReason.INVALID_OWNER


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("Payload", "OccurredAt"), 12345),
        (("CreatedAt",), 1_764_403_200),
        (("Version",), True),
        (("Version",), "1"),
        (("Payload", "FavoriteId"), 42),
    ],
)
def test_json_values_of_the_wrong_type_are_not_coerced_but_dead_lettered(
    path: tuple[str, ...], value: Any
) -> None:
    envelope = favorite_value()
    target = envelope
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value

    decoded = decode_favorite(record(encoded(envelope)), ACTION_TYPES)

    assert isinstance(decoded, DeadLetter)
    assert decoded.reason is DlqReason.SCHEMA_MISMATCH


UNIX_TIMES = ["1733356800", "1733356800000", "1733356800.5", "-1", "0", "20241205", "1.0e-5"]
"""Unix time as text: pydantic read each as seconds or milliseconds ("20241205": 1970-08-23)."""


@pytest.mark.parametrize("field", ["CreatedAt", "Payload__OccurredAt"])
@pytest.mark.parametrize("text", UNIX_TIMES)
def test_a_timestamp_written_as_unix_time_is_a_schema_mismatch_not_a_moment(
    field: str, text: str,
) -> None:
    decoded = decode_favorite(record(encoded(favorite_value(**{field: text}))), ACTION_TYPES)

    assert isinstance(decoded, DeadLetter)
    assert decoded.reason is DlqReason.SCHEMA_MISMATCH


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2026-11-29T11:00:00.1234567+03:00", "2026-11-29T11:00:00.123456+03:00"),  # truncated
        ("2026-11-29T08:00:00.9999999Z", "2026-11-29T08:00:00.999999+00:00"),
        ("2026-11-29T11:00:00+03:00", "2026-11-29T11:00:00+03:00"),
        ("2026-11-29T08:00:00Z", "2026-11-29T08:00:00+00:00"),
    ],
)
@pytest.mark.parametrize("path", ["fast", "contract"])
def test_dotnet_timestamps_decode_on_both_paths_with_their_offset(
    text: str, expected: str, path: str,
) -> None:
    # A braced MessageId is outside the fast subset: the contract (pydantic) decodes it.
    message_id = str(MESSAGE_ID) if path == "fast" else "{" + str(MESSAGE_ID).upper() + "}"
    value = favorite_value(MessageId=message_id, CreatedAt=text, Payload__OccurredAt=text)

    decoded = decode_favorite(record(encoded(value)), ACTION_TYPES)

    assert isinstance(decoded, FavoriteMessage)
    assert (decode_fast(encoded(value)) is not None) is (path == "fast")
    assert decoded.envelope.created_at.isoformat() == expected
    assert decoded.envelope.payload.occurred_at.isoformat() == expected


@pytest.mark.parametrize("offset", ["+03:60", "-05:99"])
def test_an_offset_of_sixty_minutes_or_more_is_a_schema_mismatch_not_a_later_hour(
    offset: str,
) -> None:
    value = favorite_value(Payload__OccurredAt="2026-11-29T11:00:00.1234567" + offset)

    decoded = decode_favorite(record(encoded(value)), ACTION_TYPES)

    assert isinstance(decoded, DeadLetter)
    assert decoded.reason is DlqReason.SCHEMA_MISMATCH


@pytest.mark.parametrize("depth", [200, 1_000, 100_000])
def test_a_payload_nested_deeper_than_the_json_parser_reads_is_dead_lettered_as_invalid_json(
    depth: int,
) -> None:
    # 200 levels in a Note, 202 in all: beyond pydantic's parser, which decides on every path
    value = encoded(favorite_value(Payload__Note=None)).replace(
        b'"Note": null', b'"Note": ' + b"[" * depth + b"]" * depth)

    decoded = decode_favorite(record(value), ACTION_TYPES)

    assert isinstance(decoded, DeadLetter)
    assert decoded.reason is DlqReason.INVALID_JSON


def test_a_schema_mismatch_letter_carries_the_ids_that_could_be_read_for_its_log_line() -> None:
    envelope = {
        "MessageId": "01938a4e-7c1a-7cc3-9a55-3f2b1c0d9e11", "Version": 1,
        "Payload": {"FavoriteId": "5d1c2b3a-4e5f-4a6b-8c7d-9e0f1a2b3c4d",
                    "PropertyObjectId": "x" * 65, "Note": "private note"},
    }  # no CreatedAt: a contract violation; the PropertyObjectId is too long to be an id
    record = SourceRecord(ADDED_TOPIC, 0, 7, b"k", json.dumps(envelope).encode())

    letter = decode_favorite(record, ACTION_TYPES)

    assert isinstance(letter, DeadLetter)
    assert letter.reason is DlqReason.SCHEMA_MISMATCH
    assert letter.ids == (("MessageId", "01938a4e-7c1a-7cc3-9a55-3f2b1c0d9e11"),
                          ("FavoriteId", "5d1c2b3a-4e5f-4a6b-8c7d-9e0f1a2b3c4d"))
    assert "private note" not in repr(letter.ids)


def test_an_undecodable_letter_carries_no_ids() -> None:
    letter = decode_favorite(SourceRecord(ADDED_TOPIC, 0, 8, b"k", b"{not json"), ACTION_TYPES)

    assert isinstance(letter, DeadLetter)
    assert letter.ids == ()


# --- crossing to another process ----------------------------------------------------------------


@pytest.mark.parametrize("trace", [None, MessageTrace(0x0AF7651916CD43DD8448EB211C80319C,
                                                      0xB7AD6B7169203331, 0x1122334455667788)])
def test_a_message_pickled_to_another_worker_arrives_equal_with_its_record_and_trace(
    trace: MessageTrace | None,
) -> None:
    """Bytewax pickles items sent to another process: what arrives is the message that left."""
    decoded = decode_favorite(record(encoded(favorite_value(Payload__UserId=None))), ACTION_TYPES)
    assert isinstance(decoded, FavoriteMessage)
    message = msgspec.structs.replace(decoded, trace=trace)

    arrived = pickle.loads(pickle.dumps(message))

    assert arrived == message
    assert arrived.trace == trace
    assert arrived.record == message.record and arrived.record.headers == message.record.headers
    assert (arrived.idempotency_key, arrived.dedup_id) == (
        message.idempotency_key, message.dedup_id)
    assert arrived.envelope.payload.occurred_at == message.envelope.payload.occurred_at
