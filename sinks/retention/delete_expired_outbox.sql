-- Expired, published outbox rows that landed in the DEFAULT partition, a chunk.
DELETE FROM user_activity.outbox_default
 WHERE ctid = ANY (ARRAY(
        SELECT o.ctid FROM user_activity.outbox_default o, user_activity.outbox_watermark w
         WHERE o.created_at < %s AND pg_visible_in_snapshot(o.txid, w.delivered) LIMIT %s))
