-- Dry run: which of these messages are already recorded (by idempotency mark or by
-- source_message_id)? Read-only.
SELECT i.idempotency_key
  FROM unnest(%(idempotency_keys)s::text[], %(source_message_ids)s::uuid[])
       AS i (idempotency_key, source_message_id)
 WHERE EXISTS (SELECT 1 FROM user_activity.consumer_idempotency_marks m
                WHERE m.key = i.idempotency_key)
    OR EXISTS (SELECT 1 FROM user_activity.action_events e
                WHERE e.source_message_id = i.source_message_id)
