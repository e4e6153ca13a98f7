-- Held rows of one topic up to a seq are published (Kafka committed it): gone from the side
-- table; a requeued parked one marked published. Idempotent.
WITH sent AS (DELETE FROM user_activity.outbox_held
               WHERE topic = %(topic)s AND seq <= %(seq)s RETURNING id)
UPDATE user_activity.outbox_parked p SET published_at = now(), requeued_at = NULL
  FROM sent WHERE p.id = sent.id AND p.requeued_at IS NOT NULL
