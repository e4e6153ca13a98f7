"""The session-linking flow's spans: what each sampled sign-in did (:mod:`runtime.tracing`).

Called where an outcome becomes known; unsampled sign-ins cost one attribute check each.
"""

from __future__ import annotations

from collections.abc import Sequence

from dataflows.session_linking.decode import InvalidSignIn, SignInMessage
from dataflows.session_linking.linking import LinkOutcome, LinkResult
from runtime import tracing
from runtime.tracing import DatabaseWork, Handled


def _handled(result: LinkResult) -> Handled | None:
    message = result.message
    trace = message.trace
    if trace is None:
        return None
    attributes = {"user_activity.anonymous_id": str(message.anonymous_id)}
    if result.session_id is not None:
        attributes["user_activity.session_id"] = str(result.session_id)
    late = result.outcome is LinkOutcome.LATE_CONFLICT
    error = None if not late else "late" if result.conflict is None else result.conflict.value
    return Handled(trace, message.record, result.outcome.value, str(message.message_id), error,
                   attributes)


def trace_batch(results: Sequence[LinkResult], started_ns: int | None, ended_ns: int | None
                ) -> None:
    """The spans of a committed batch's sampled sign-ins and its database span."""
    if not tracing.enabled():
        return
    handled = [item for item in map(_handled, results) if item is not None]
    if not handled:
        return
    database = None
    if started_ns is not None and ended_ns is not None:
        database = DatabaseWork("UPDATE user_activity.sessions", started_ns, ended_ns, {
            "db.system.name": "postgresql", "db.system": "postgresql",
            "db.operation.name": "UPDATE", "db.collection.name": "user_activity.sessions",
            "db.query.summary": "link_session_* (one transaction)",
            "db.operation.batch.size": len(results)})
    tracing.finish_messages(handled, started_ns, ended_ns, database)


def trace_duplicate(message: SignInMessage) -> None:
    """A sign-in the dedup window dropped as already seen."""
    if message.trace is not None:
        tracing.finish_messages([Handled(message.trace, message.record,
                                         LinkOutcome.DUPLICATE.value, str(message.message_id))])


def trace_invalid(invalid: InvalidSignIn) -> None:
    """A sign-in with an empty GUID."""
    tracing.finish_alone(invalid.record, LinkOutcome.INVALID.value,
                         message_id=str(invalid.envelope.message_id), error="an empty GUID")

