"""The outbox: every event we emit is a row committed with the change it announces, then sent.

:class:`OutboxPublisher` sends the committed rows (:mod:`.publisher`); which are sent is a
snapshot watermark (:mod:`.window`); rows refused for good are parked, rows of a refused topic
held back (:mod:`.parking`); :class:`OutboxWatchdog` reports a stall (:mod:`.watchdog`). The SQL
is in ``sql/*.sql``. Nothing here starts a thread: the composition root runs
:meth:`OutboxPublisher.run` and calls :meth:`OutboxWatchdog.measure`.
"""

from sinks.outbox.parking import parked_rows, requeue_parked
from sinks.outbox.publisher import LEASE_KEY, OutboxPublisher
from sinks.outbox.watchdog import OutboxWatchdog
from sinks.outbox.window import LeaseLostError

__all__ = ["LEASE_KEY", "LeaseLostError", "OutboxPublisher", "OutboxWatchdog", "parked_rows",
           "requeue_parked"]
