-- A watermark ahead of this server's transaction ids belongs to another cluster: the database was
-- copied logically (pg_dump and restore, a logical-replication cut-over), the ids started again,
-- and every new row would look published. Reset to the snapshot that sees no transaction, so
-- every row in the table is sent again (duplicates, no loss). A row of one cluster never has a
-- txid past that cluster's current xmax, so this never fires for the cluster's own watermark.
WITH old AS (
    SELECT delivered::text AS delivered, target::text AS target
      FROM user_activity.outbox_watermark
     WHERE id = 1
       AND greatest(pg_snapshot_xmax(delivered), pg_snapshot_xmax(coalesce(target, delivered)))
           > pg_snapshot_xmax(pg_current_snapshot())
       FOR UPDATE
)
UPDATE user_activity.outbox_watermark w
   SET delivered = '1:1:'::pg_snapshot, target = NULL, after_txid = NULL, after_id = NULL,
       generation = generation + 1, updated_at = now()
  FROM old
 WHERE w.id = 1
RETURNING old.delivered, old.target, pg_current_snapshot()::text
