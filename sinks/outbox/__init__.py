"""The outbox: every event we emit is a row committed with the change it announces, then sent.

The publisher (:mod:`.publisher`), the watermark (:mod:`.window`), parked and held rows
(:mod:`.parking`), the stall watchdog (:mod:`.watchdog`); SQL in ``sql/*.sql``. No thread here.
"""

from sinks.outbox.parking import parked_rows, requeue_parked
from sinks.outbox.publisher import LEASE_KEY, OutboxPublisher
from sinks.outbox.watchdog import OutboxWatchdog
from sinks.outbox.window import LeaseLostError

__all__ = ["LEASE_KEY", "LeaseLostError", "OutboxPublisher", "OutboxWatchdog", "parked_rows",
           "requeue_parked"]
