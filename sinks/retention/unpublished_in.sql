-- Whether outbox partition {partition} holds a row the publisher has not passed. A watermark
-- ahead of the server's transaction ids (copied from another cluster: the publisher resets it
-- when it takes the lease) passes nothing, so no partition goes before its rows are sent again.
SELECT EXISTS (
    SELECT 1 FROM user_activity.{partition} o, user_activity.outbox_watermark w
     WHERE (o.txid >= pg_snapshot_xmax(w.delivered)
            OR o.txid = ANY (ARRAY(SELECT pg_snapshot_xip(w.delivered))))
       AND NOT pg_visible_in_snapshot(o.txid, w.delivered))
    OR EXISTS (
    SELECT 1 FROM user_activity.{partition} o, user_activity.outbox_watermark w
     WHERE pg_snapshot_xmax(w.delivered) > pg_snapshot_xmax(pg_current_snapshot()))
