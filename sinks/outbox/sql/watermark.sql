-- The watermark as stored, and the current snapshot (the target of a new window).
SELECT delivered::text, target::text, after_txid::text, after_id, generation,
       pg_current_snapshot()::text
  FROM user_activity.outbox_watermark WHERE id = 1
