"""A window's pages (sinks.outbox.table.read_page) on a real PostgreSQL: every row once, in order.

Pages are read in (txid, id) order from one cursor; the order is the transaction ids' own, so a
window across 99 -> 100 (or 9999 -> 10000) neither skips nor repeats a row.
"""

from __future__ import annotations

import uuid
from typing import Any

import psycopg
import pytest

from sinks.outbox.progress import Progress
from sinks.outbox.table import current_snapshot, read_page

pytestmark = pytest.mark.integration


def test_pages_follow_the_transaction_ids_order_across_a_digit_more(
    db: psycopg.Connection[Any],
) -> None:
    txids = [97, 98, 99, 100, 101]  # committed long ago: any snapshot sees them
    ids = {txid: sorted(uuid.uuid4() for _ in range(2)) for txid in txids}
    db.execute("INSERT INTO user_activity.outbox (id, topic, key, value, txid)"
               " SELECT i, 't', NULL, '\\x7b7d', x::text::xid8"
               " FROM unnest(%s::uuid[], %s::text[]) AS r (i, x)",
               ([i for t in txids for i in ids[t]], [str(t) for t in txids for _ in ids[t]]))
    target = current_snapshot(db)
    progress = Progress("96:96:")

    pages = []
    while keys := read_page(db, progress, target, 4):  # the second page: 99 and 100
        pages.append(keys)
        progress = progress.window_until(target, (keys[-1].txid, keys[-1].id))

    read = [(key.txid, key.id) for page in pages for key in page]
    assert read == [(txid, row_id) for txid in txids for row_id in ids[txid]]
    assert all(len(page) == 4 for page in pages[:-1])
