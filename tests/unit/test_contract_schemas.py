"""The wire contracts: committed JSON Schemas, round trips, and .NET producer compatibility."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any
from uuid import UUID

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from schemas.envelope import MAX_CORRELATION_ID_LENGTH
from schemas.export import (
    CONTRACT_MODELS,
    SCHEMA_DIR,
    drifted_schemas,
    main,
    render_schema,
    schema_file_name,
    write_schemas,
)
from schemas.favorites import (
    ActionTrackedEnvelope,
    ActionTrackedPayload,
    ActionType,
    FavoriteEnvelope,
    FavoritePayload,
)
from schemas.sessions import (
    SessionEndedEnvelope,
    SessionEndedPayload,
    SessionLinkedEnvelope,
    SessionLinkedPayload,
    SessionStartedEnvelope,
    SessionStartedPayload,
    UserSignedInEnvelope,
    UserSignedInPayload,
)

# --- strategies -----------------------------------------------------------------------------

# .NET DateTimeOffset offsets are whole minutes within +-14 h.
offsets = st.integers(min_value=-14 * 60, max_value=14 * 60).map(
    lambda minutes: timezone(timedelta(minutes=minutes))
)
aware_datetimes = st.datetimes(
    min_value=datetime(1900, 1, 1), max_value=datetime(2200, 12, 31), timezones=offsets
)
uuids = st.uuids()
optional_uuids = st.none() | uuids
int32 = st.integers(min_value=-(2**31), max_value=2**31 - 1)


def models(model: type[BaseModel], **fields: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Instances of ``model`` from strategies for its snake_case fields (passed as the aliases).

    Not ``st.builds``: a pydantic model's signature names its aliases, so builds() would also
    invent the PascalCase arguments from their annotations. The contracts take the wire names
    only (no ``populate_by_name``), so the values are passed under the aliases.
    """
    aliases = {name: info.alias or name for name, info in model.model_fields.items()}
    return st.fixed_dictionaries(fields).map(
        lambda kwargs: model(**{aliases[name]: value for name, value in kwargs.items()})
    )


def envelopes(model: type[BaseModel], payloads: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return models(
        model,
        message_id=uuids,
        created_at=aware_datetimes,
        version=int32,
        aggregate_id=st.text(),
        aggregate_type=st.text(),
        correlation_id=st.none() | st.text(max_size=MAX_CORRELATION_ID_LENGTH),
        payload=payloads,
    )


MODEL_INSTANCES: dict[type[BaseModel], st.SearchStrategy[Any]] = {
    FavoriteEnvelope: envelopes(
        FavoriteEnvelope,
        models(
            FavoritePayload,
            favorite_id=uuids,
            property_object_id=uuids,
            user_id=optional_uuids,
            anonymous_id=optional_uuids,
            occurred_at=aware_datetimes,
        ),
    ),
    ActionTrackedEnvelope: envelopes(
        ActionTrackedEnvelope,
        models(
            ActionTrackedPayload,
            action_type=st.sampled_from(ActionType),
            session_id=uuids,
            anonymous_id=uuids,
            user_id=optional_uuids,
            occurred_at=aware_datetimes,
            property_object_id=uuids,
            favorite_id=uuids,
        ),
    ),
    UserSignedInEnvelope: envelopes(
        UserSignedInEnvelope,
        models(
            UserSignedInPayload,
            user_id=uuids,
            anonymous_id=uuids,
            signed_in_at=aware_datetimes,
        ),
    ),
    SessionLinkedEnvelope: envelopes(
        SessionLinkedEnvelope,
        models(
            SessionLinkedPayload,
            session_id=uuids,
            anonymous_id=uuids,
            user_id=uuids,
            linked_at=aware_datetimes,
        ),
    ),
    SessionStartedEnvelope: envelopes(
        SessionStartedEnvelope,
        models(
            SessionStartedPayload,
            session_id=uuids,
            anonymous_id=uuids,
            user_id=optional_uuids,
            started_at=aware_datetimes,
        ),
    ),
    SessionEndedEnvelope: envelopes(
        SessionEndedEnvelope,
        models(
            SessionEndedPayload,
            session_id=uuids,
            anonymous_id=uuids,
            user_id=optional_uuids,
            ended_at=aware_datetimes,
        ),
    ),
}

# --- a .NET producer's favorite-added value -------------------------------------------------

MESSAGE_ID = "01938A4E-7C1A-7CC3-9A55-3F2B1C0D9E11"
FAVORITE_ID = "5D1C2B3A-4E5F-4A6B-8C7D-9E0F1A2B3C4D"
PROPERTY_OBJECT_ID = "A1B2C3D4-E5F6-4789-ABCD-EF0123456789"
ANONYMOUS_ID = "0F1E2D3C-4B5A-4968-8776-A5B4C3D2E1F0"


def dotnet_favorite(**payload_overrides: Any) -> dict[str, Any]:
    """A favorite-added value as the .NET favorites service writes it."""
    payload: dict[str, Any] = {
        "FavoriteId": FAVORITE_ID,
        "PropertyObjectId": PROPERTY_OBJECT_ID,
        "UserId": None,
        "AnonymousId": ANONYMOUS_ID,
        "OccurredAt": "2026-11-29T11:00:00.1234567+03:00",
    }
    payload.update(payload_overrides)
    return {
        "MessageId": MESSAGE_ID,
        "CreatedAt": "2026-11-29T08:00:00.1234567+00:00",
        "Version": 1,
        "AggregateId": FAVORITE_ID,
        "AggregateType": "Favorite",
        "CorrelationId": "corr-42",
        "Payload": payload,
    }


# --- committed JSON Schemas ---------------------------------------------------------------


@pytest.mark.parametrize("model", CONTRACT_MODELS, ids=lambda model: model.__name__)
def test_committed_json_schema_matches_the_model(model: type[BaseModel]) -> None:
    path = SCHEMA_DIR / schema_file_name(model)

    committed = path.read_text(encoding="utf-8") if path.exists() else None

    assert committed == render_schema(model), (
        f"{path.name} drifted from {model.__name__}: run `python -m schemas.export`"
    )


def test_schema_directory_holds_exactly_one_file_per_contract_model() -> None:
    expected = {schema_file_name(model) for model in CONTRACT_MODELS}

    committed = {path.name for path in SCHEMA_DIR.glob("*.schema.json")}

    assert committed == expected
    assert drifted_schemas() == []


def test_every_contract_the_spec_names_is_exported() -> None:
    names = {model.__name__ for model in CONTRACT_MODELS}

    assert names == {
        "FavoriteEnvelope",
        "ActionTrackedEnvelope",
        "UserSignedInEnvelope",
        "SessionLinkedEnvelope",
        "SessionStartedEnvelope",
        "SessionEndedEnvelope",
    }


def test_schema_file_names_are_kebab_case() -> None:
    assert schema_file_name(UserSignedInEnvelope) == "user-signed-in-envelope.schema.json"
    assert schema_file_name(ActionTrackedEnvelope) == "action-tracked-envelope.schema.json"


def test_rendered_schema_uses_wire_names_sorted_keys_and_a_trailing_newline() -> None:
    text = render_schema(FavoriteEnvelope)

    schema = json.loads(text)

    assert text.endswith("}\n")
    assert text == json.dumps(schema, sort_keys=True, indent=2, ensure_ascii=False) + "\n"
    assert set(schema["required"]) == {
        "MessageId",
        "CreatedAt",
        "Version",
        "AggregateId",
        "AggregateType",
        "Payload",
    }
    payload = schema["$defs"]["FavoritePayload"]
    assert set(payload["properties"]) == {
        "FavoriteId",
        "PropertyObjectId",
        "UserId",
        "AnonymousId",
        "OccurredAt",
    }


def test_check_reports_a_changed_a_missing_and_a_stale_schema_file(tmp_path: Path) -> None:
    write_schemas(tmp_path)
    changed = tmp_path / schema_file_name(FavoriteEnvelope)
    changed.write_text(changed.read_text(encoding="utf-8").replace("uuid", "guid"), "utf-8")
    missing = tmp_path / schema_file_name(SessionEndedEnvelope)
    missing.unlink()
    stale = tmp_path / "retired-envelope.schema.json"
    stale.write_text("{}\n", encoding="utf-8")

    drifted = drifted_schemas(tmp_path)

    assert sorted(drifted) == sorted([changed, missing, stale])


def test_check_command_exits_1_listing_drifted_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_schemas(tmp_path)
    drifted = tmp_path / schema_file_name(ActionTrackedEnvelope)
    drifted.write_text("{}\n", encoding="utf-8")

    exit_code = main(["--check", "--directory", str(tmp_path)])

    assert exit_code == 1
    assert drifted.name in capsys.readouterr().err
    assert drifted.read_text(encoding="utf-8") == "{}\n", "--check must not write"


def test_export_command_repairs_drift_and_then_check_passes(tmp_path: Path) -> None:
    (tmp_path / schema_file_name(FavoriteEnvelope)).write_text("{}\n", encoding="utf-8")
    (tmp_path / "retired-envelope.schema.json").write_text("{}\n", encoding="utf-8")

    export_code = main(["--directory", str(tmp_path)])
    check_code = main(["--check", "--directory", str(tmp_path)])

    assert (export_code, check_code) == (0, 0)
    assert not (tmp_path / "retired-envelope.schema.json").exists()


def test_committed_schemas_pass_the_check_command() -> None:
    assert main(["--check"]) == 0


# --- round trips ------------------------------------------------------------------------------


@pytest.mark.parametrize("model", CONTRACT_MODELS, ids=lambda model: model.__name__)
def test_every_contract_round_trips_through_its_wire_json(model: type[BaseModel]) -> None:
    @given(MODEL_INSTANCES[model])
    def round_trip(original: BaseModel) -> None:
        wire = original.model_dump_json(by_alias=True)

        parsed = model.model_validate_json(wire)

        assert parsed == original
        assert parsed.model_dump_json(by_alias=True) == wire

    round_trip()


@given(MODEL_INSTANCES[FavoriteEnvelope])
def test_wire_json_uses_pascal_case_names_only(original: FavoriteEnvelope) -> None:
    wire = json.loads(original.model_dump_json(by_alias=True))

    assert set(wire) == {
        "MessageId",
        "CreatedAt",
        "Version",
        "AggregateId",
        "AggregateType",
        "CorrelationId",
        "Payload",
    }
    assert set(wire["Payload"]) == {
        "FavoriteId",
        "PropertyObjectId",
        "UserId",
        "AnonymousId",
        "OccurredAt",
    }


@given(MODEL_INSTANCES[FavoriteEnvelope])
def test_round_trip_keeps_each_timestamps_offset(original: FavoriteEnvelope) -> None:
    parsed = FavoriteEnvelope.model_validate_json(original.model_dump_json(by_alias=True))

    assert parsed.created_at.utcoffset() == original.created_at.utcoffset()
    assert parsed.payload.occurred_at.utcoffset() == original.payload.occurred_at.utcoffset()


# --- .NET producer compatibility ---------------------------------------------------------------


def test_upper_case_guids_from_dotnet_parse_to_the_same_uuids() -> None:
    value = json.dumps(dotnet_favorite())

    envelope = FavoriteEnvelope.model_validate_json(value)

    assert envelope.message_id == UUID(MESSAGE_ID.lower())
    assert envelope.payload.favorite_id == UUID(FAVORITE_ID.lower())
    assert envelope.payload.property_object_id == UUID(PROPERTY_OBJECT_ID.lower())
    assert envelope.payload.anonymous_id == UUID(ANONYMOUS_ID.lower())


@pytest.mark.parametrize(
    ("wire", "expected"),
    [
        (
            "2026-11-29T11:00:00.1234567+03:00",
            datetime(2026, 11, 29, 11, 0, 0, 123456, tzinfo=timezone(timedelta(hours=3))),
        ),
        (
            "2026-11-29T02:30:00.1234567-05:30",
            datetime(2026, 11, 29, 2, 30, 0, 123456, tzinfo=timezone(timedelta(minutes=-330))),
        ),
        ("2026-11-29T08:00:00.1234567Z", datetime(2026, 11, 29, 8, 0, 0, 123456, tzinfo=UTC)),
        ("2026-11-29T08:00:00.1234567+00:00", datetime(2026, 11, 29, 8, 0, 0, 123456, tzinfo=UTC)),
        ("2026-11-29T08:00:00+00:00", datetime(2026, 11, 29, 8, 0, 0, tzinfo=UTC)),
    ],
    ids=["plus-03-00", "minus-05-30", "zulu", "plus-00-00", "no-fraction"],
)
def test_dotnet_datetimeoffset_with_seven_fractional_digits_keeps_instant_and_offset(
    wire: str, expected: datetime
) -> None:
    value = json.dumps(dotnet_favorite(OccurredAt=wire))

    occurred_at = FavoriteEnvelope.model_validate_json(value).payload.occurred_at

    assert occurred_at == expected
    assert occurred_at.utcoffset() == expected.utcoffset()


def test_datetime_without_offset_is_rejected() -> None:
    value = json.dumps(dotnet_favorite(OccurredAt="2026-11-29T08:00:00.1234567"))

    with pytest.raises(ValidationError):
        FavoriteEnvelope.model_validate_json(value)


def test_payload_note_is_dropped_on_parse_and_never_dumped() -> None:
    secret_note = "call me at +7 999 123-45-67"
    value = json.dumps(dotnet_favorite(Note=secret_note))

    envelope = FavoriteEnvelope.model_validate_json(value)

    assert not hasattr(envelope.payload, "note")
    assert not hasattr(envelope.payload, "Note")
    assert envelope.payload.model_extra in (None, {})
    assert secret_note not in envelope.model_dump_json(by_alias=True)
    assert secret_note not in repr(envelope)


def test_unknown_envelope_and_payload_fields_from_a_newer_minor_version_are_ignored() -> None:
    wire = dotnet_favorite(ListingPrice=12_500_000, Tags=["sea-view"])
    wire["TenantId"] = "tenant-1"
    wire["Metadata"] = {"Producer": "favorites"}

    envelope = FavoriteEnvelope.model_validate_json(json.dumps(wire))

    assert envelope == FavoriteEnvelope.model_validate_json(json.dumps(dotnet_favorite()))


ENVELOPE_REQUIRED = ["MessageId", "CreatedAt", "Version", "AggregateId", "AggregateType", "Payload"]
PAYLOAD_REQUIRED = ["FavoriteId", "PropertyObjectId", "OccurredAt"]


@pytest.mark.parametrize("field", ENVELOPE_REQUIRED)
def test_envelope_missing_a_required_field_is_rejected(field: str) -> None:
    wire = dotnet_favorite()
    del wire[field]

    with pytest.raises(ValidationError) as error:
        FavoriteEnvelope.model_validate_json(json.dumps(wire))

    assert any(err["type"] == "missing" and err["loc"] == (field,) for err in error.value.errors())


@pytest.mark.parametrize("field", PAYLOAD_REQUIRED)
def test_favorite_payload_missing_a_required_field_is_rejected(field: str) -> None:
    wire = dotnet_favorite()
    del wire["Payload"][field]

    with pytest.raises(ValidationError) as error:
        FavoriteEnvelope.model_validate_json(json.dumps(wire))

    assert any(
        err["type"] == "missing" and err["loc"] == ("Payload", field)
        for err in error.value.errors()
    )


def test_missing_correlation_id_and_owner_ids_default_to_null() -> None:
    wire = dotnet_favorite()
    del wire["CorrelationId"]
    del wire["Payload"]["UserId"]

    envelope = FavoriteEnvelope.model_validate_json(json.dumps(wire))

    assert envelope.correlation_id is None
    assert envelope.payload.user_id is None


@pytest.mark.parametrize("model", CONTRACT_MODELS, ids=lambda model: model.__name__)
def test_every_contracts_json_schema_bounds_the_correlation_id(model: type[BaseModel]) -> None:
    schema = json.loads(render_schema(model))

    branches = schema["properties"]["CorrelationId"]["anyOf"]

    assert {"type": "string", "maxLength": MAX_CORRELATION_ID_LENGTH} in branches
    assert {"type": "null"} in branches


@pytest.mark.parametrize(
    ("length", "accepted"),
    [(MAX_CORRELATION_ID_LENGTH, True), (MAX_CORRELATION_ID_LENGTH + 1, False)],
)
def test_a_correlation_id_is_accepted_up_to_its_bound_in_code_points(
    length: int, accepted: bool
) -> None:
    wire = dotnet_favorite()
    wire["CorrelationId"] = "\U0001f600" * length  # 4 UTF-8 bytes each: counted as one

    if accepted:
        envelope = FavoriteEnvelope.model_validate_json(json.dumps(wire))
        assert envelope.correlation_id == wire["CorrelationId"]
    else:
        with pytest.raises(ValidationError) as error:
            FavoriteEnvelope.model_validate_json(json.dumps(wire))
        assert [err["type"] for err in error.value.errors()] == ["string_too_long"]


@pytest.mark.parametrize(
    ("model", "payload"),
    [
        (
            SessionLinkedEnvelope,
            {"SessionId": FAVORITE_ID, "AnonymousId": ANONYMOUS_ID, "UserId": MESSAGE_ID},
        ),
        (
            ActionTrackedEnvelope,
            {
                "ActionType": "AddToFavorites",
                "SessionId": FAVORITE_ID,
                "AnonymousId": ANONYMOUS_ID,
                "UserId": None,
                "PropertyObjectId": PROPERTY_OBJECT_ID,
                "FavoriteId": FAVORITE_ID,
            },
        ),
    ],
    ids=["session-linked-without-LinkedAt", "action-tracked-without-OccurredAt"],
)
def test_outbound_contract_missing_its_timestamp_is_rejected(
    model: type[BaseModel], payload: dict[str, Any]
) -> None:
    wire = dotnet_favorite()
    wire["Payload"] = payload

    with pytest.raises(ValidationError):
        model.model_validate_json(json.dumps(wire))


def test_action_tracked_payload_requires_user_id_to_be_present_even_when_null() -> None:
    payload = {
        "ActionType": "RemoveFromFavorites",
        "SessionId": FAVORITE_ID,
        "AnonymousId": ANONYMOUS_ID,
        "OccurredAt": "2026-11-29T08:00:00Z",
        "PropertyObjectId": PROPERTY_OBJECT_ID,
        "FavoriteId": FAVORITE_ID,
    }

    with pytest.raises(ValidationError):
        ActionTrackedPayload.model_validate_json(json.dumps(payload))
