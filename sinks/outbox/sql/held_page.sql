-- The first held rows of one topic, in the order they were held (the outbox's order).
SELECT id, topic, key, value, headers, created_at FROM user_activity.outbox_held
 WHERE topic = %s ORDER BY seq LIMIT %s
