-- The next page of the window (delivered, target] after the cursor, in (txid, id) order, as
-- (txid, id) pairs: the transactions in progress at `delivered` that `target` sees, then those
-- started after it. The latter are read from ONE lower bound (start_*: the cursor, or the last
-- possible row before delivered's xmax): with two, the btree scan started at the cursor and a
-- window's first page read every index entry of the table, published rows included.
SELECT page.txid::text, page.id FROM (
    (SELECT o.txid, o.id
       FROM user_activity.outbox o
      WHERE o.txid = ANY (ARRAY(SELECT x FROM pg_snapshot_xip(%(delivered)s::pg_snapshot) x
                                 WHERE pg_visible_in_snapshot(x, %(target)s::pg_snapshot)))
        AND (o.txid, o.id) > (%(after_txid)s::xid8, %(after_id)s::uuid)
      ORDER BY o.txid, o.id LIMIT %(limit)s)
    UNION ALL
    (SELECT o.txid, o.id
       FROM user_activity.outbox o
      WHERE (o.txid, o.id) > (%(start_txid)s::xid8, %(start_id)s::uuid)
        AND o.txid < pg_snapshot_xmax(%(target)s::pg_snapshot)
        AND pg_visible_in_snapshot(o.txid, %(target)s::pg_snapshot)
      ORDER BY o.txid, o.id LIMIT %(limit)s)
) page ORDER BY page.txid, page.id LIMIT %(limit)s  -- the xid8, not its text
