-- Held rows the broker acknowledged: gone from the side table; a requeued parked one published.
WITH sent AS (DELETE FROM user_activity.outbox_held WHERE id = ANY(%(ids)s) RETURNING id)
UPDATE user_activity.outbox_parked p SET published_at = now(), requeued_at = NULL
  FROM sent WHERE p.id = sent.id AND p.requeued_at IS NOT NULL
