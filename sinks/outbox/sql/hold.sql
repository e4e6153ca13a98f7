-- A row of a topic the broker refuses (or one behind it), held back in its topic's order.
INSERT INTO user_activity.outbox_held (id, topic, key, value, headers, created_at, last_error)
VALUES (%s, %s, %s, %s, %s, %s, %s)
ON CONFLICT (id) DO NOTHING
