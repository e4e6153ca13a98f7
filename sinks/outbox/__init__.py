"""The outbox: every event we emit is a row committed with the change it announces, then sent.

The publisher (:mod:`.publisher`) and its pieces: the lease (:mod:`.lease`), the Kafka stream
(:mod:`.stream`) and its progress (:mod:`.progress`), the transactions that carry both
(:mod:`.sending`), the fast path (:mod:`.fast_path`) and the window (:mod:`.window`), the table
and the watermark cache (:mod:`.table`), parked and held rows (:mod:`.parking`); the stall
watchdog (:mod:`.watchdog`); SQL in ``sql/*.sql``. No thread here.
"""

from sinks.outbox.lease import LEASE_KEY
from sinks.outbox.parking import parked_rows, requeue_parked
from sinks.outbox.publisher import OutboxPublisher
from sinks.outbox.table import LeaseLostError
from sinks.outbox.watchdog import OutboxWatchdog

__all__ = ["LEASE_KEY", "LeaseLostError", "OutboxPublisher", "OutboxWatchdog", "parked_rows",
           "requeue_parked"]
