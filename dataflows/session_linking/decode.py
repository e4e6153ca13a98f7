"""Decode and validate a user-signed-in record (ASSUMED contract, :mod:`schemas.sessions`). Pure.

Every record yields exactly one of: a :class:`SignInMessage` to link, an :class:`InvalidSignIn`
(an empty GUID: acknowledged, logged, no change, no DLQ — SPEC §5) or a
:class:`~schemas.dlq_letter.DeadLetter` (poison). Never raises. A SignedInAt further ahead of
the job's clock than the allowed skew is taken as the moment the job read the sign-in, so one
wrong clock cannot make every later sign-in of the device look late.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

import orjson

from dataflows.envelopes import EMPTY_GUID, parse_envelope
from runtime.tracing import sample
from schemas.dlq import DlqReason
from schemas.dlq_letter import DeadLetter
from schemas.envelope import CONTRACT_VERSION
from schemas.kafka_record import SourceRecord
from schemas.outbox import MessageTrace
from schemas.sessions import UserSignedInEnvelope

IDEMPOTENCY_PREFIX = "user-activity-signed-in"


@dataclass(frozen=True, slots=True)
class SignInMessage:
    """A decoded, valid user-signed-in event, with the record it came from."""

    record: SourceRecord
    envelope: UserSignedInEnvelope
    trace: MessageTrace | None = None  # set when sampled for tracing
    adjusted_at: datetime | None = None  # the event time used for a SignedInAt from the future

    @property
    def message_id(self) -> UUID:
        """The source MessageId."""
        return self.envelope.message_id

    @property
    def anonymous_id(self) -> UUID:
        """The device that signed in: the key of the flow."""
        return self.envelope.payload.anonymous_id

    @property
    def user_id(self) -> UUID:
        """The user who signed in."""
        return self.envelope.payload.user_id

    @property
    def signed_in_at(self) -> datetime:
        """The event time: SignedInAt, or :attr:`adjusted_at` when it lay too far ahead."""
        adjusted = getattr(self, "adjusted_at", None)  # (absent from an older snapshot's state)
        return self.envelope.payload.signed_in_at if adjusted is None else adjusted

    @property
    def idempotency_key(self) -> str:
        """``user-activity-signed-in:{MessageId}``."""
        return f"{IDEMPOTENCY_PREFIX}:{self.envelope.message_id}"

    @property
    def dedup_id(self) -> bytes:
        """The MessageId's 16 bytes, for the in-memory dedup window."""
        return self.envelope.message_id.bytes

    @property
    def version_mismatch(self) -> bool:
        """True when the envelope's Version is not the one we speak (warn and proceed)."""
        return self.envelope.version != CONTRACT_VERSION


@dataclass(frozen=True, slots=True)
class InvalidSignIn:
    """A sign-in whose MessageId, UserId or AnonymousId is the empty GUID: skipped."""

    record: SourceRecord
    envelope: UserSignedInEnvelope


DecodedSignIn = SignInMessage | InvalidSignIn | DeadLetter


def sign_in_fields(sign_in: SignInMessage | InvalidSignIn) -> dict[str, Any]:
    """The log fields of a sign-in: ids and where it came from (no IP, no user agent)."""
    envelope, payload = sign_in.envelope, sign_in.envelope.payload
    return {"MessageId": str(envelope.message_id), "AnonymousId": str(payload.anonymous_id),
            "UserId": str(payload.user_id), "source": sign_in.record.where()}


def decode_sign_in(record: SourceRecord, now: datetime | None = None,
                   max_skew: timedelta = timedelta(0)) -> DecodedSignIn:
    """Decode ``record`` from the user-signed-in topic, read at ``now`` (None: never adjusted).

    Poison is a dead letter (:func:`dataflows.envelopes.parse_envelope`, else
    ``processing-error``). A SignedInAt later than ``now + max_skew`` is adjusted to ``now``.
    Tracing's sampling decision is taken here.
    """
    try:
        envelope = parse_envelope(record, UserSignedInEnvelope, ("UserId", "AnonymousId"))
        if isinstance(envelope, DeadLetter):
            return envelope
        payload = envelope.payload
        if EMPTY_GUID in (envelope.message_id, payload.user_id, payload.anonymous_id):
            return InvalidSignIn(record, envelope)
        adjusted = now if now is not None and payload.signed_in_at > now + max_skew else None
        return SignInMessage(record, envelope, sample(record), adjusted)
    except Exception as exc:  # noqa: BLE001 - a pure step must turn anything into a dead letter
        return DeadLetter.now(record, DlqReason.PROCESSING_ERROR, type(exc).__name__)


def signed_in_time(value: bytes | None, now: float | None = None,
                   max_skew: float = float("inf")) -> float | None:
    """A sign-in value's SignedInAt (epoch seconds; None: unreadable), adjusted as decoded."""
    if value is None:
        return None
    try:
        moment = datetime.fromisoformat(orjson.loads(value)["Payload"]["SignedInAt"]).timestamp()
    except Exception:  # noqa: BLE001 - anything unreadable has no event time
        return None
    return now if now is not None and moment > now + max_skew else moment
