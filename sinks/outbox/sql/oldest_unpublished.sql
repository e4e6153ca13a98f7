-- The age of the oldest committed row the watermark has not passed, and the generation.
-- Pending: committed after the watermark (the first such transaction's rows stand for the oldest;
-- txids follow transaction start closely). A window under way (a backlog sent page by page:
-- `target` and the cursor `after_*` set) has sent its rows up to the cursor: pending are the rows
-- after the cursor and the transactions in progress at `target`, so the age falls as a backlog
-- drains. Index probes only; rows past the watermark's xmax are read from ONE lower bound, as in
-- page.sql.
WITH m AS (SELECT delivered, coalesce(target, delivered) AS target,
                  coalesce(after_txid, '0'::xid8) AS after_txid,
                  coalesce(after_id, '00000000-0000-0000-0000-000000000000'::uuid) AS after_id,
                  (pg_snapshot_xmax(delivered)::text::numeric - 1)::text::xid8 AS before_xmax,
                  generation
             FROM user_activity.outbox_watermark WHERE id = 1),
     w AS (SELECT m.*,
                  CASE WHEN after_txid > before_xmax THEN after_txid ELSE before_xmax END
                      AS start_txid,
                  CASE WHEN after_txid > before_xmax THEN after_id
                       ELSE 'ffffffff-ffff-ffff-ffff-ffffffffffff'::uuid END AS start_id
             FROM m)
SELECT extract(epoch FROM now() - min(created_at))::float8, (SELECT generation FROM w) FROM (
    SELECT o.created_at FROM user_activity.outbox o
     WHERE o.txid = ANY (ARRAY(SELECT pg_snapshot_xip(target) FROM w))
    UNION ALL
    SELECT o.created_at FROM user_activity.outbox o
     WHERE o.txid = ANY (ARRAY(SELECT pg_snapshot_xip(delivered) FROM w))
       AND (o.txid, o.id) > ((SELECT after_txid FROM w), (SELECT after_id FROM w))
    UNION ALL
    (SELECT o.created_at FROM user_activity.outbox o
      WHERE (o.txid, o.id) > ((SELECT start_txid FROM w), (SELECT start_id FROM w))
      ORDER BY o.txid, o.id LIMIT 1)
) pending
