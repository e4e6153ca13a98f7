-- A row the broker refused for good, kept for an operator (parked again: one more attempt).
INSERT INTO user_activity.outbox_parked
       (id, topic, key, value, headers, created_at, attempts, last_error)
VALUES (%s, %s, %s, %s, %s, %s, 1, %s)
ON CONFLICT (id) DO UPDATE
   SET attempts = outbox_parked.attempts + 1, last_error = EXCLUDED.last_error,
       parked_at = now(), requeued_at = NULL, published_at = NULL
