"""The msgspec fast path accepts only what the pydantic contract accepts, with the same values."""

from __future__ import annotations

import json
from typing import Any
from uuid import UUID

import orjson
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from dataflows.favorite_actions import wire
from dataflows.favorite_actions.wire import FavoriteWire, decode_fast, from_model
from schemas.envelope import MAX_CORRELATION_ID_LENGTH
from schemas.favorites import FavoriteEnvelope

FIELDS = ("message_id", "created_at", "version", "aggregate_id", "aggregate_type",
          "correlation_id")
PAYLOAD_FIELDS = ("favorite_id", "property_object_id", "occurred_at", "user_id", "anonymous_id")


def _valid() -> dict[str, Any]:
    return {
        "MessageId": "0b6d4b6e-8f0a-4c55-9a39-3c1f0f6a7e11",
        "CreatedAt": "2024-05-01T12:00:00.1234567+03:00",
        "Version": 1,
        "AggregateId": "e3b0c442-98fc-1c14-9afb-f4c8996fb924",
        "AggregateType": "Favorite",
        "CorrelationId": "corr-1",
        "Payload": {
            "FavoriteId": "e3b0c442-98fc-1c14-9afb-f4c8996fb924",
            "PropertyObjectId": "9a0e1d4c-2b3f-4e5a-8c6d-7e8f9a0b1c2d",
            "UserId": None,
            "AnonymousId": "5f1e2d3c-4b5a-4968-8776-655443322110",
            "OccurredAt": "2024-05-01T11:59:59.9999999Z",
        },
    }


digits = st.integers
timestamps = st.one_of(
    st.builds(
        lambda y, mo, d, sep, h, mi, s, frac, tz: (
            f"{y:04d}-{mo:02d}-{d:02d}{sep}{h:02d}:{mi:02d}:{s:02d}{frac}{tz}"
        ),
        digits(0, 9999), digits(0, 13), digits(0, 32), st.sampled_from(["T", "t", " ", "_"]),
        digits(0, 25), digits(0, 60), digits(0, 61),
        st.one_of(st.just(""), st.text("0123456789", min_size=0, max_size=12).map("."
                                                                                .__add__)),
        st.one_of(
            st.sampled_from(["Z", "z", "", "+03:00", "-00:00", "+0300", "+03", "+24:00", "+23:59",
                             "-12:30", "+99:99", "+03:00:30"]),
            st.builds("{}{:02d}:{:02d}".format, st.sampled_from("+-"), digits(0, 25),
                      digits(0, 99)),
        ),
    ),
    st.text(max_size=40),
)
uuid_texts = st.one_of(
    st.uuids().map(str),
    st.uuids().map(lambda u: str(u).upper()),
    st.uuids().map(lambda u: u.hex),
    st.uuids().map(lambda u: "{" + str(u) + "}"),
    st.uuids().map(lambda u: "urn:uuid:" + str(u)),
    st.just("00000000-0000-0000-0000-000000000000"),
    st.text(max_size=40),
)
json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False),
    st.text(max_size=10), timestamps, uuid_texts,
)
# CorrelationId around its bound (256 code points): one, two and four UTF-8 bytes per character,
# characters JSON escapes, and far beyond it.
_near_bound = st.integers(MAX_CORRELATION_ID_LENGTH - 2, MAX_CORRELATION_ID_LENGTH + 2)
correlation_ids = st.one_of(
    st.none(),
    st.text(max_size=10),
    st.builds(lambda c, n: c * n,
              st.sampled_from(["a", "é", "\u2028", "\U0001f600", "\x00", '"', "\\"]),
              _near_bound),
    st.builds(lambda head, n: (head + "x" * n)[:n], st.text(max_size=8), _near_bound),
    st.integers(MAX_CORRELATION_ID_LENGTH + 3, 4 * MAX_CORRELATION_ID_LENGTH).map("y".__mul__),
    json_scalars,
)
WIRE_KEYS = ["MessageId", "CreatedAt", "Version", "AggregateId", "AggregateType",
             "CorrelationId", "Payload"]
PAYLOAD_KEYS = ["FavoriteId", "PropertyObjectId", "UserId", "AnonymousId", "OccurredAt"]
VALUES_BY_KEY = {
    "MessageId": uuid_texts, "AggregateId": st.one_of(uuid_texts, json_scalars),
    "CreatedAt": timestamps, "OccurredAt": timestamps,
    "FavoriteId": uuid_texts, "PropertyObjectId": uuid_texts,
    "UserId": st.one_of(st.none(), uuid_texts), "AnonymousId": st.one_of(st.none(), uuid_texts),
    "Version": st.one_of(st.integers(-3, 3), json_scalars),
    "CorrelationId": correlation_ids,
}


@st.composite
def envelopes(draw: st.DrawFn) -> dict[str, Any]:
    """A valid envelope with some fields replaced, removed, renamed or added."""
    value = _valid()
    for _ in range(draw(st.integers(0, 4))):
        in_payload = draw(st.booleans())
        target = value.get("Payload") if in_payload else value
        if not isinstance(target, dict):
            continue
        key = draw(st.sampled_from(PAYLOAD_KEYS if in_payload else WIRE_KEYS))
        action = draw(st.sampled_from(["replace", "drop", "snake", "extra", "scalar"]))
        if action == "replace":
            target[key] = draw(VALUES_BY_KEY.get(key, json_scalars))
        elif action == "drop":
            target.pop(key, None)
        elif action == "snake" and key in target:
            snake = "".join("_" + c.lower() if c.isupper() else c for c in key).lstrip("_")
            target[snake] = target.pop(key)
        elif action == "extra":
            target[draw(st.text(max_size=12))] = draw(json_scalars)
        else:
            target[key] = draw(json_scalars)
    return value


def _encoded(value: dict[str, Any]) -> bytes:
    return json.dumps(value, ensure_ascii=False).encode()  # stdlib: any int size


def _pydantic(raw: bytes) -> FavoriteEnvelope | None:
    try:
        return FavoriteEnvelope.model_validate_json(raw)
    except ValidationError:
        return None


def _same(fast: FavoriteWire, model: FavoriteEnvelope) -> None:
    slow = from_model(model)
    for name in FIELDS:
        assert getattr(fast, name) == getattr(slow, name), name
    for name in PAYLOAD_FIELDS:
        assert getattr(fast.payload, name) == getattr(slow.payload, name), name
    for a, b in ((fast.created_at, slow.created_at),
                 (fast.payload.occurred_at, slow.payload.occurred_at)):
        assert a.utcoffset() == b.utcoffset()
        assert orjson.dumps(a) == orjson.dumps(b)  # the text the outbox and logs carry


@settings(max_examples=1500, deadline=None)
@given(value=envelopes())
@example(value=_valid())
def test_fast_path_accepts_only_what_the_contract_accepts_with_the_same_values(
    value: dict[str, Any],
) -> None:
    raw = _encoded(value)

    fast = decode_fast(raw)
    model = _pydantic(raw)

    if fast is not None:
        assert model is not None, "msgspec accepted what the contract rejects"
        _same(fast, model)


@settings(max_examples=500, deadline=None)
@given(text=timestamps)
@example(text="2024-05-01T12:00:00+03:60")  # fromisoformat: +04:00; the contract refuses it
def test_timestamps_accepted_fast_equal_the_contracts(text: str) -> None:
    value = _valid()
    value["CreatedAt"] = text
    value["Payload"]["OccurredAt"] = text
    raw = _encoded(value)

    fast = decode_fast(raw)
    model = _pydantic(raw)

    if fast is not None:
        assert model is not None
        _same(fast, model)


@settings(max_examples=400, deadline=None)
@given(correlation_id=correlation_ids)
def test_correlation_ids_accepted_fast_are_accepted_by_the_contract_with_the_same_value(
    correlation_id: Any,
) -> None:
    value = _valid()
    value["CorrelationId"] = correlation_id
    raw = _encoded(value)

    fast = decode_fast(raw)
    model = _pydantic(raw)

    if fast is not None:
        assert model is not None, "msgspec accepted what the contract rejects"
        _same(fast, model)
    if isinstance(correlation_id, str) and len(correlation_id) > MAX_CORRELATION_ID_LENGTH:
        assert fast is None and model is None


@pytest.mark.parametrize("char", ["a", "é", "\U0001f600", "\x00"])
def test_a_correlation_id_at_its_bound_takes_the_fast_path_and_one_over_fails_both(
    char: str,
) -> None:
    at_bound, over = _valid(), _valid()
    at_bound["CorrelationId"] = char * MAX_CORRELATION_ID_LENGTH
    over["CorrelationId"] = char * (MAX_CORRELATION_ID_LENGTH + 1)

    fast = decode_fast(_encoded(at_bound))

    assert fast is not None and fast.correlation_id == char * MAX_CORRELATION_ID_LENGTH
    assert _pydantic(_encoded(at_bound)) is not None
    assert decode_fast(_encoded(over)) is None
    assert _pydantic(_encoded(over)) is None


@pytest.mark.parametrize(
    "text",
    [
        "2024-05-01T12:00:00.1234567+03:00",  # .NET DateTimeOffset "O": seven digits, truncated
        "2024-05-01T12:00:00.9999999Z",
        "2024-05-01T12:00:00Z",
        "2024-05-01T12:00:00.123456-05:30",
    ],
)
def test_the_usual_forms_take_the_fast_path(text: str) -> None:
    value = _valid()
    value["CreatedAt"] = value["Payload"]["OccurredAt"] = text
    raw = _encoded(value)

    fast = decode_fast(raw)
    model = _pydantic(raw)

    assert fast is not None
    assert model is not None
    _same(fast, model)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("CreatedAt", "2024-05-01T12:00Z"),  # the contract accepts it; pydantic decodes it
        ("CreatedAt", "2024-05-01 12:00:00Z"),
        ("MessageId", "{0b6d4b6e-8f0a-4c55-9a39-3c1f0f6a7e11}"),
        ("Version", True),
        ("Version", 1.0),
        ("Version", "1"),
        ("CreatedAt", "2024-02-30T12:00:00Z"),
        ("CreatedAt", "2024-05-01T12:00:00+03:60"),  # refused by the contract
    ],
)
def test_what_the_fast_path_cannot_prove_goes_to_the_contract(key: str, value: Any) -> None:
    envelope = _valid()
    envelope[key] = value

    assert decode_fast(_encoded(envelope)) is None


@pytest.mark.parametrize(("key", "value"), [("correlation_id", "x"), ("version", 2)])
def test_a_field_under_its_python_name_is_an_unknown_field_on_both_paths(
    key: str, value: Any
) -> None:
    envelope = _valid()
    envelope[key] = value  # the wire names are PascalCase only: this key is ignored

    fast = decode_fast(_encoded(envelope))
    model = FavoriteEnvelope.model_validate_json(_encoded(envelope))

    assert fast is not None
    _same(fast, model)
    assert (fast.correlation_id, fast.version) == ("corr-1", 1)


def test_from_model_keeps_every_field() -> None:
    model = FavoriteEnvelope.model_validate_json(orjson.dumps(_valid()))

    wire = from_model(model)

    assert wire.message_id == UUID("0b6d4b6e-8f0a-4c55-9a39-3c1f0f6a7e11")
    assert wire.payload.anonymous_id == model.payload.anonymous_id
    assert wire.payload.occurred_at == model.payload.occurred_at
    assert wire.correlation_id == "corr-1"


def _with_unknown_field(value: dict[str, Any], text: str, *, in_payload: bool) -> bytes:
    """``value`` encoded with an unknown field ``X`` whose JSON text is ``text``."""
    encoded = _encoded(value)
    if in_payload:
        return encoded.replace(b'"Payload": {', b'"Payload": {"X": ' + text.encode() + b", ", 1)
    return b'{"X": ' + text.encode() + b", " + encoded[1:]


def _nested(depth: int, kind: str) -> str:
    return "[" * depth + "]" * depth if kind == "[]" else '{"a": ' * depth + "1" + "}" * depth


@settings(max_examples=300, deadline=None)
@given(depth=st.integers(150, 1_200), kind=st.sampled_from(["[]", "{}"]),
       in_payload=st.booleans(), correlation_id=correlation_ids)
@example(depth=200, kind="[]", in_payload=False, correlation_id="corr-1")  # 202 levels in all
@example(depth=1_000, kind="{}", in_payload=True, correlation_id=None)  # msgspec: RecursionError
def test_an_unknown_field_nested_deeper_than_the_contract_reads_is_left_to_the_contract(
    depth: int, kind: str, in_payload: bool, correlation_id: Any,
) -> None:
    value = _valid()
    value["CorrelationId"] = correlation_id
    raw = _with_unknown_field(value, _nested(depth, kind), in_payload=in_payload)

    fast = decode_fast(raw)
    model = _pydantic(raw)

    if fast is not None:
        assert model is not None, "msgspec accepted what the contract rejects"
        _same(fast, model)


@pytest.mark.parametrize("digits", [4_300, 4_301, 20_000])
@pytest.mark.parametrize("form", ["{}", "-{}", "{}.5", "{}e-3"])
def test_an_unknown_number_of_more_digits_than_the_contract_reads_is_left_to_the_contract(
    digits: int, form: str,
) -> None:
    raw = _with_unknown_field(_valid(), form.format("9" * digits), in_payload=True)

    fast = decode_fast(raw)
    model = _pydantic(raw)

    if fast is not None:
        assert model is not None, "msgspec accepted what the contract rejects"
        _same(fast, model)


def test_the_shortest_envelope_the_fast_path_decodes_is_as_long_as_its_depth_gate_assumes() -> None:
    # The depth check is skipped below _SHORTEST_TOO_DEEP bytes: sound only if no envelope the
    # fast path decodes is shorter than _SHORTEST_ENVELOPE (every shorter spelling of a field
    # is refused: a GUID in fewer than 32 hex digits, a time in fewer than 20 characters).
    guid, time = "0" * 31 + "1", "2026-11-29T11:00:00Z"
    shortest = orjson.dumps({
        "MessageId": guid, "CreatedAt": time, "Version": 0, "AggregateId": "",
        "AggregateType": "", "Payload": {"FavoriteId": guid, "PropertyObjectId": guid,
                                         "OccurredAt": time},
    })

    assert decode_fast(shortest) is not None
    assert len(shortest) == wire._SHORTEST_ENVELOPE
    assert decode_fast(shortest.replace(guid.encode(), guid[1:].encode(), 1)) is None
    assert decode_fast(shortest.replace(time.encode(), time[:16].encode() + b"Z", 1)) is None
