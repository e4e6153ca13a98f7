"""Favorite and sign-in envelopes, shaped as the .NET producers write them."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

OCCURRED_AT = "2026-11-29T08:00:00.1234567+03:00"
"""A .NET ``DateTimeOffset`` as it is serialised: seven fraction digits and an offset."""
_MOSCOW = timezone(timedelta(hours=3))


def dotnet_time(moment: datetime) -> str:
    """``moment`` as a .NET ``DateTimeOffset`` writes it: seven fraction digits, at +03:00."""
    local = moment.astimezone(_MOSCOW)
    return local.strftime("%Y-%m-%dT%H:%M:%S.%f") + "0+03:00"


def new_id() -> uuid.UUID:
    """A random (version 4) id."""
    return uuid.uuid4()


def favorite_envelope(*, message_id: uuid.UUID | None = None, favorite_id: uuid.UUID | None = None,
                      property_object_id: uuid.UUID | None = None, user_id: uuid.UUID | None = None,
                      anonymous_id: uuid.UUID | None = None, occurred_at: str = OCCURRED_AT,
                      created_at: datetime | None = None, version: int = 1,
                      correlation_id: str | None = "corr-1",
                      extra_payload: dict[str, Any] | None = None) -> dict[str, Any]:
    """A favorite-added/removed envelope as a .NET producer writes it (FavoriteId upper case)."""
    favorite_id = favorite_id or new_id()
    payload: dict[str, Any] = {
        "FavoriteId": str(favorite_id).upper(),
        "PropertyObjectId": str(property_object_id or new_id()),
        "UserId": None if user_id is None else str(user_id),
        "AnonymousId": None if anonymous_id is None else str(anonymous_id),
        "OccurredAt": occurred_at, **(extra_payload or {})}
    return {
        "MessageId": str(message_id or new_id()),
        "CreatedAt": (created_at or datetime.now(UTC)).isoformat(), "Version": version,
        "AggregateId": str(favorite_id), "AggregateType": "Favorite",
        "CorrelationId": correlation_id, "Payload": payload}


def sign_in_envelope(*, user_id: uuid.UUID, anonymous_id: uuid.UUID,
                     message_id: uuid.UUID | None = None, signed_in_at: str | None = None,
                     created_at: datetime | None = None,
                     correlation_id: str | None = "corr-sign-in") -> dict[str, Any]:
    """A user-signed-in envelope (ASSUMED contract), keyed by UserId like identity produces it."""
    return {
        "MessageId": str(message_id or new_id()),
        "CreatedAt": (created_at or datetime.now(UTC)).isoformat(),
        "Version": 1,
        "AggregateId": str(user_id),
        "AggregateType": "User",
        "CorrelationId": correlation_id,
        "Payload": {
            "UserId": str(user_id), "AnonymousId": str(anonymous_id).upper(),
            "SignedInAt": signed_in_at or dotnet_time(datetime.now(UTC))},
    }
