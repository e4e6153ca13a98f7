-- Give parked rows back to the publisher (all of them when ids is NULL): each is held for its
-- topic, sent in turn and marked published. A row already requeued or published is left alone.
WITH requeued AS (
    UPDATE user_activity.outbox_parked SET requeued_at = now()
     WHERE requeued_at IS NULL AND published_at IS NULL
       AND (%(ids)s::uuid[] IS NULL OR id = ANY(%(ids)s::uuid[]))
    RETURNING id, topic, key, value, headers, created_at, last_error, parked_at
)
INSERT INTO user_activity.outbox_held (id, topic, key, value, headers, created_at, last_error)
SELECT id, topic, key, value, headers, created_at, last_error FROM requeued ORDER BY parked_at
ON CONFLICT (id) DO NOTHING
