-- Record a batch of actions in one statement: each owner's session, then the idempotency marks,
-- the action_events rows and the action-tracked outbox rows. A message whose mark or
-- source_message_id already exists changes nothing (ON CONFLICT DO NOTHING; a racing writer
-- waits, then skips); a message whose owner has no session gets no mark and no row.
-- The session (INV-ACT-003), as resolve_owner_sessions.sql resolves it: by AnonymousId, else by
-- UserId; the Active session first, else the latest by last_activity_at. The row's UserId is the
-- session's user only when linked_at <= the action's OccurredAt, else null (records.py).
-- Each lookup is index scans that stop at their first entry (Active first, UNION ALL, LIMIT 1;
-- migration 0011), so its cost does not grow with the owner's number of sessions.
-- Resolved here, in the statement's own snapshot, so that the sink does not wait for a separate
-- query before it sends the insert.
-- The outbox rows are thin (migration 0008): they name their action_events row and keep the
-- CorrelationId, OccurredAt's offset and CreatedAt; the publisher renders the event from them.
-- Returns one row per message that has a session: its 1-based position in the arrays, the
-- session's id and AnonymousId, the row's UserId, and whether its action_events row is new.
WITH input AS (
    SELECT *
      FROM unnest(
               %(idempotency_keys)b::text[], %(ids)b::uuid[], %(action_types)b::text[],
               %(owner_anonymous_ids)b::uuid[], %(owner_user_ids)b::uuid[],
               %(occurred_ats)b::timestamptz[], %(property_object_ids)b::uuid[],
               %(favorite_ids)b::uuid[], %(source_message_ids)b::uuid[],
               %(outbox_ids)b::uuid[], %(outbox_topics)b::text[], %(outbox_headers)b::text[],
               %(correlation_ids)b::bytea[], %(occurred_offsets)b::integer[],
               %(outbox_created_ats)b::timestamptz[]
           ) WITH ORDINALITY
           AS t (idempotency_key, id, action_type, owner_anonymous_id, owner_user_id,
                 occurred_at, property_object_id, favorite_id, source_message_id,
                 outbox_id, outbox_topic, outbox_headers, correlation_id, occurred_offset,
                 outbox_created_at, position)
),
resolved AS (
    SELECT i.*, s.id AS session_id, s.anonymous_id,
           CASE WHEN s.linked_at <= i.occurred_at THEN s.user_id END AS user_id
      FROM input i
     CROSS JOIN LATERAL (
            (SELECT c.id, c.anonymous_id, c.user_id, c.linked_at
               FROM user_activity.sessions c
              WHERE i.owner_anonymous_id IS NOT NULL AND c.anonymous_id = i.owner_anonymous_id
                AND c.status = 'Active')
            UNION ALL
            (SELECT c.id, c.anonymous_id, c.user_id, c.linked_at
               FROM user_activity.sessions c
              WHERE i.owner_anonymous_id IS NOT NULL AND c.anonymous_id = i.owner_anonymous_id
              ORDER BY c.last_activity_at DESC, c.id DESC
              LIMIT 1)
            LIMIT 1
           ) s
    UNION ALL
    SELECT i.*, s.id AS session_id, s.anonymous_id,
           CASE WHEN s.linked_at <= i.occurred_at THEN s.user_id END AS user_id
      FROM input i
     CROSS JOIN LATERAL (
            (SELECT c.id, c.anonymous_id, c.user_id, c.linked_at
               FROM user_activity.sessions c
              WHERE i.owner_anonymous_id IS NULL AND c.user_id = i.owner_user_id
                AND c.status = 'Active'
              ORDER BY c.last_activity_at DESC, c.id DESC
              LIMIT 1)
            UNION ALL
            (SELECT c.id, c.anonymous_id, c.user_id, c.linked_at
               FROM user_activity.sessions c
              WHERE i.owner_anonymous_id IS NULL AND c.user_id = i.owner_user_id
              ORDER BY c.last_activity_at DESC, c.id DESC
              LIMIT 1)
            LIMIT 1
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
    SELECT r.outbox_id, r.outbox_topic, r.outbox_headers::jsonb, r.outbox_created_at, r.id,
           r.correlation_id, r.occurred_offset
      FROM resolved r
      JOIN recorded e ON e.id = r.id
    RETURNING id
)
SELECT r.position, r.session_id, r.anonymous_id, r.user_id, e.id IS NOT NULL AS inserted
  FROM resolved r
  LEFT JOIN recorded e ON e.id = r.id
