"""The session-linking dry-run sink for replay: what each sign-in would do, nothing written.

Marks and Active sessions are read in READ ONLY transactions; each sign-in is decided by
:func:`~dataflows.session_linking.linking.decide` on a copy kept as the run would change it,
and tallied. Not modelled: ``superseded`` and ``late-conflict``.
"""

from __future__ import annotations

from uuid import UUID

from bytewax.outputs import DynamicSink, StatelessSinkPartition
from typing_extensions import override

from dataflows.session_linking.decode import SignInMessage
from dataflows.session_linking.linking import ActiveSession, LinkOutcome, decide
from runtime.settings import Settings
from sinks.db import Database
from sinks.dry_run import Tally

_MARKED = "SELECT key FROM user_activity.consumer_idempotency_marks WHERE key = ANY(%s)"
_ACTIVE = ("SELECT anonymous_id, id, user_id FROM user_activity.sessions"
           " WHERE anonymous_id = ANY(%s) AND status = 'Active'")
_NEW_SESSION = UUID(int=0)  # the session a sign-in would start


class DryRunLinkSink(DynamicSink[tuple[str, SignInMessage]]):
    """Tallies what each sign-in would do, read-only."""

    def __init__(self, settings: Settings, tally: Tally) -> None:
        self._settings = settings
        self._tally = tally

    @override
    def build(self, step_id: str, worker_index: int, worker_count: int) -> _DryRunLinks:
        return _DryRunLinks(Database(self._settings, "user-activity-dry-run"), self._tally)


class _DryRunLinks(StatelessSinkPartition[tuple[str, SignInMessage]]):
    """Keeps what the run would have changed so far (marks, Active sessions) across batches."""

    def __init__(self, db: Database, tally: Tally) -> None:
        self._db = db
        self._tally = tally
        self._marked: set[str] = set()
        self._active: dict[UUID, ActiveSession | None] = {}
        self._keys_read: set[str] = set()

    @override
    def write_batch(self, items: list[tuple[str, SignInMessage]]) -> None:
        messages = [message for _key, message in items]
        new_keys = [m.idempotency_key for m in messages if m.idempotency_key not in self._keys_read]
        new_devices = list({m.anonymous_id for m in messages} - set(self._active))
        conn = self._db.connection()
        with conn.transaction():
            conn.execute("SET TRANSACTION READ ONLY")
            self._marked.update(row[0] for row in conn.execute(_MARKED, (new_keys,)).fetchall())
            found = {row[0]: ActiveSession(row[1], row[2])
                     for row in conn.execute(_ACTIVE, (new_devices,)).fetchall()}
        self._keys_read.update(new_keys)
        self._active.update((device, found.get(device)) for device in new_devices)
        marked, active = self._marked, self._active
        for message in messages:
            if message.idempotency_key in marked:
                self._tally.add(LinkOutcome.DUPLICATE.value)
                continue
            marked.add(message.idempotency_key)
            session = active.get(message.anonymous_id)
            outcome = decide(session, message.user_id)
            if outcome is LinkOutcome.LINKED and session is not None:
                active[message.anonymous_id] = ActiveSession(session.session_id, message.user_id)
            elif outcome in (LinkOutcome.RELINKED, LinkOutcome.STARTED):
                active[message.anonymous_id] = ActiveSession(_NEW_SESSION, message.user_id)
            self._tally.add(outcome.value)

    @override
    def close(self) -> None:
        self._db.close()
