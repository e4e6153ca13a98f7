-- The watermark cache as stored (a progress Kafka committed) and its generation.
SELECT delivered::text, target::text, after_txid::text, after_id, generation
  FROM user_activity.outbox_watermark WHERE id = 1
