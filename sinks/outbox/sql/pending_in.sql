-- Whether rows visible in a snapshot of the caller's are not behind the watermark yet.
SELECT EXISTS (
    SELECT 1 FROM user_activity.outbox o, user_activity.outbox_watermark w
     WHERE (o.txid >= pg_snapshot_xmax(w.delivered)
            OR o.txid = ANY (ARRAY(SELECT pg_snapshot_xip(w.delivered))))
       AND pg_visible_in_snapshot(o.txid, %s::pg_snapshot)
       AND NOT pg_visible_in_snapshot(o.txid, w.delivered))
