"""The Bytewax sink of the session-linking flow: a batch of sign-ins -> one transaction.

Commits, outages and poison as :mod:`sinks.transactional` says; outcomes logged per sign-in.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from dataflows.session_linking.decode import SignInMessage, sign_in_fields
from dataflows.session_linking.linking import LOG_EVENTS, LinkOutcome, SessionTopics
from dataflows.session_linking.store import LinkedBatch, SessionLinksStore
from dataflows.session_linking.traces import trace_batch
from runtime.logs import log_event
from runtime.metrics import (
    SESSION_LINKING_DLQ,
    SESSION_LINKING_DURATION_MS,
    SESSION_LINKING_OUTCOMES,
    SESSION_LINKING_RETRIES,
)
from runtime.process import Process
from runtime.settings import Settings
from schemas.outbox import OutboxRow
from sinks.db import Connection
from sinks.transactional import PartitionedSink, Publishing, TransactionalPartition
from sources.progress import INPUT_PROGRESS

logger = logging.getLogger(__name__)


class _SessionLinkPartition(TransactionalPartition[SignInMessage, LinkedBatch]):
    def __init__(self, settings: Settings, process: Process, publisher: Publishing | None,
                 part: str) -> None:
        super().__init__(settings, process, publisher, name=f"user-activity-session-linking-{part}",
                         dlq_topic=settings.topic_session_linking_dlq,
                         dlq_counter=SESSION_LINKING_DLQ, retries_counter=SESSION_LINKING_RETRIES,
                         logger=logger, flow="session-linking", lag=INPUT_PROGRESS)
        self._store = SessionLinksStore(SessionTopics(
            linked=settings.topic_session_linked, started=settings.topic_session_started,
            ended=settings.topic_session_ended), live_within=timedelta(
                seconds=settings.session_linking_max_clock_skew_seconds
                + settings.session_linking_lateness_seconds),
            lifecycle=settings.publish_session_lifecycle)
        self._written: dict[int, tuple[int, int]] = {}  # id(results) -> write start, commit (ns)

    def write(self, conn: Connection, batch: Sequence[SignInMessage]) -> LinkedBatch:
        """One transaction: marks, session changes, outbox rows (:class:`SessionLinksStore`)."""
        started_ns = time.time_ns()
        linked = self._store.link_batch(conn, batch)
        self._written[id(linked)] = (started_ns, time.time_ns())
        return linked

    def fields(self, message: SignInMessage) -> dict[str, Any]:
        """Ids of the sign-in and where it came from."""
        return sign_in_fields(message)

    def committed_outbox(self, result: LinkedBatch) -> tuple[int, list[OutboxRow]]:
        """The session events of the batch, and its transaction."""
        return result.txid, [row for link in result.results for row in link.outbox]

    def report(self, linked: LinkedBatch) -> None:
        """Metrics, one log line per sign-in and the spans of the sampled ones."""
        started_ns, ended_ns = self._written.pop(id(linked), (0, 0))
        trace_batch(linked.results, started_ns or None, ended_ns or None)
        now_mono = time.monotonic()
        for result in linked.results:
            message = result.message
            SESSION_LINKING_OUTCOMES.labels(outcome=result.outcome.value).inc()
            SESSION_LINKING_DURATION_MS.observe((now_mono - message.record.received_at) * 1000)
            event = LOG_EVENTS[result.outcome]
            late = result.outcome is LinkOutcome.LATE_CONFLICT
            ended = result.ended_session_id
            log_event(logger, event, logging.WARNING if late else logging.INFO, outcome=event,
                      SessionId=None if result.session_id is None else str(result.session_id),
                      EndedSessionId=None if ended is None else str(ended),
                      reason=None if result.conflict is None else result.conflict.value,
                      SignedInAt=message.signed_in_at.isoformat()
                      if late or result.outcome is LinkOutcome.SUPERSEDED else None,
                      **sign_in_fields(message))


class SessionLinkSink(PartitionedSink[SignInMessage]):
    """Links ``(device shard, SignInMessage)`` items (:class:`_SessionLinkPartition`)."""

    partition = _SessionLinkPartition
