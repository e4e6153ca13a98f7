-- One sweep of waiting_actions (issue 41): up to limit actions due for a retry, oldest first
-- (rows another sweep holds are skipped). An action whose owner now has a session is recorded
-- as record_actions.sql records it (mark, action_events row, thin outbox row with CreatedAt
-- now()) and leaves the table; one past its wait_until without a session leaves it, skipped; the
-- others are retried later (after as long as they have waited, 1 to 5 s). Returns one row per
-- action swept: its idempotency key, MessageId, FavoriteId, PropertyObjectId and ActionType,
-- the session it was recorded in (NULL: none), whether its row is new (false: recorded before)
-- and whether it was given up.
WITH due AS (
    SELECT w.*
      FROM user_activity.waiting_actions w
     WHERE w.retry_at <= now()
     ORDER BY w.retry_at
     LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED
),
resolved AS (
    SELECT i.*, s.id AS session_id, s.anonymous_id,
           CASE WHEN i.owner_anonymous_id IS NULL THEN i.owner_user_id
                WHEN s.linked <= i.occurred_at THEN s.user_id END AS user_id
      FROM due i
     CROSS JOIN LATERAL (
--@owner_session
           ) s
),
marked AS (
    INSERT INTO user_activity.consumer_idempotency_marks (key)
    SELECT idempotency_key FROM resolved
    ON CONFLICT (key, processed_on) DO NOTHING
    RETURNING key
),
recorded AS (
    INSERT INTO user_activity.action_events
           (id, action_type, session_id, anonymous_id, user_id, occurred_at,
            property_object_id, favorite_id, source_message_id)
    SELECT r.id, r.action_type, r.session_id, r.anonymous_id, r.user_id, r.occurred_at,
           r.property_object_id, r.favorite_id, r.source_message_id
      FROM resolved r
      JOIN marked m ON m.key = r.idempotency_key
    ON CONFLICT (source_message_id) WHERE source_message_id IS NOT NULL DO NOTHING
    RETURNING id
),
announced AS (
    INSERT INTO user_activity.outbox
           (id, topic, headers, created_at, action_event_id, correlation_id, occurred_offset)
    SELECT r.outbox_id, r.outbox_topic, r.outbox_headers, now(), r.id, r.correlation_id,
           r.occurred_offset
      FROM resolved r
      JOIN recorded e ON e.id = r.id
    RETURNING id
),
settled AS (
    DELETE FROM user_activity.waiting_actions w
     USING due d
     WHERE w.idempotency_key = d.idempotency_key
       AND (d.wait_until <= now()
            OR EXISTS (SELECT 1 FROM resolved r WHERE r.idempotency_key = d.idempotency_key))
    RETURNING w.idempotency_key
),
retried AS (
    UPDATE user_activity.waiting_actions w
       SET retry_at = now() + least(greatest(now() - d.waiting_since, interval '1 second'),
                                    interval '5 seconds')
      FROM due d
     WHERE w.idempotency_key = d.idempotency_key
       AND d.wait_until > now()
       AND NOT EXISTS (SELECT 1 FROM resolved r WHERE r.idempotency_key = d.idempotency_key)
    RETURNING w.idempotency_key
)
SELECT d.idempotency_key, d.source_message_id, d.favorite_id, d.property_object_id,
       d.action_type, r.session_id, e.id IS NOT NULL AS inserted,
       r.session_id IS NULL AND d.wait_until <= now() AS given_up
  FROM due d
  LEFT JOIN resolved r ON r.idempotency_key = d.idempotency_key
  LEFT JOIN recorded e ON e.id = r.id
