-- Parked rows waiting for an operator, oldest first.
SELECT id, topic, attempts, last_error, parked_at, octet_length(value)
  FROM user_activity.outbox_parked
 WHERE requeued_at IS NULL AND published_at IS NULL
 ORDER BY parked_at LIMIT %s
