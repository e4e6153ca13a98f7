-- The session events of one linking transaction, as outbox rows (published after the commit by
-- the shared outbox publisher, with their stable MessageIds); returns the transaction's id.
INSERT INTO user_activity.outbox (id, topic, key, value, headers)
SELECT t.id, t.topic, t.key, t.value, t.headers::jsonb
  FROM unnest(
           %(ids)s::uuid[], %(topics)s::text[], %(keys)s::bytea[], %(values)s::bytea[],
           %(headers)s::text[]
       ) AS t (id, topic, key, value, headers)
RETURNING txid::text::bigint
