-- Move the watermark, if no other publisher moved it since this one read it (its generation).
UPDATE user_activity.outbox_watermark
   SET delivered = %(delivered)s::pg_snapshot, target = %(target)s::pg_snapshot,
       after_txid = %(after_txid)s::xid8, after_id = %(after_id)s,
       generation = generation + 1, updated_at = now()
 WHERE id = 1 AND generation = %(generation)s
