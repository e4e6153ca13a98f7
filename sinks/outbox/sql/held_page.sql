-- The next held rows of one topic after the last one published (`after`, a seq), in the order
-- they were held (the outbox's order).
SELECT seq, id, topic, key, value, headers, created_at FROM user_activity.outbox_held
 WHERE topic = %(topic)s AND seq > %(after)s ORDER BY seq LIMIT %(limit)s
