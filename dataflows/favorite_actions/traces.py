"""The favorites flow's spans: each sampled message's outcome (:mod:`runtime.tracing`).

Called where an outcome becomes known; unsampled messages cost one attribute check each.
"""

from __future__ import annotations

from dataflows.favorite_actions.decode import FavoriteMessage, Skipped
from dataflows.favorite_actions.store import BatchOutcome
from runtime import tracing
from runtime.tracing import DatabaseWork, Handled

RECORDED = "recorded"
DUPLICATE = "duplicate"
NO_SESSION = "no-session"


def _handled(message: FavoriteMessage, outcome: str, **attributes: str) -> Handled | None:
    trace = message.trace
    if trace is None:
        return None
    return Handled(trace, message.record, outcome, str(message.message_id), None,
                   {"user_activity.action_type": message.action_type.value, **attributes})


def trace_batch(outcome: BatchOutcome) -> None:
    """The spans of a committed batch's sampled messages and its ``INSERT`` span."""
    if not tracing.enabled():
        return
    started_ns, ended_ns = outcome.written_ns or (None, None)
    handled = [item for item in (
        *(_handled(action.message, RECORDED,
                   **{"user_activity.session_id": str(action.event.session_id)})
          for action in outcome.recorded if action.message.trace is not None),
        *(_handled(message, DUPLICATE) for message in outcome.duplicates),
        *(_handled(message, NO_SESSION) for message in outcome.no_session),
    ) if item is not None]
    if not handled:
        return
    database = None
    if started_ns and ended_ns:
        size = len(outcome.recorded) + len(outcome.duplicates) + len(outcome.no_session)
        database = DatabaseWork("INSERT user_activity.action_events", started_ns, ended_ns, {
            "db.system.name": "postgresql", "db.system": "postgresql",
            "db.operation.name": "INSERT", "db.collection.name": "user_activity.action_events",
            "db.query.summary": "resolve_owner_sessions; record_actions",
            "db.operation.batch.size": size})
    tracing.finish_messages(handled, started_ns or None, ended_ns or None, database)


def trace_duplicate(message: FavoriteMessage) -> None:
    """A message the dedup window dropped as already seen."""
    if (item := _handled(message, DUPLICATE)) is not None:
        tracing.finish_messages([item])


def trace_skipped(skipped: Skipped) -> None:
    """A message skipped at decode (invalid-owner)."""
    tracing.finish_alone(skipped.record, skipped.reason.value,
                         message_id=str(skipped.message.message_id),
                         error="not exactly one of UserId / AnonymousId, or an empty GUID")

