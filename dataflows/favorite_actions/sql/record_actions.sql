-- Record a batch of actions in one statement: each owner's session, then the idempotency marks,
-- the action_events rows and the action-tracked outbox rows. A message whose mark or
-- source_message_id already exists changes nothing (ON CONFLICT DO NOTHING; a racing writer
-- waits, then skips). The session is the one that covered the action (owner_session.sql),
-- resolved in the statement's own snapshot, so the sink does not wait for a separate query
-- before it sends the insert. The row's UserId: the payload's for a user's own action; for a
-- guest action the session's user when the session was linked at or before the action, else
-- null (issue 41).
-- A message whose owner has no session gets no mark and no row: with wait_seconds > 0 it
-- waits in waiting_actions that many seconds (recorded once a session appears:
-- record_waiting_actions.sql), else it is skipped.
-- The outbox rows are thin (migration 0008): they name their action_events row and keep the
-- CorrelationId, OccurredAt's offset and CreatedAt; the publisher renders the event from them.
-- Returns one row per message that has a session (its 1-based position, the session's id and
-- AnonymousId, the row's UserId, whether its action_events row is new) and one per message that
-- waits (its position, three NULLs, whether it is new to waiting_actions); each with the
-- transaction's id (the outbox rows' txid, which the sink offers to the publisher).
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
           CASE WHEN i.owner_anonymous_id IS NULL THEN i.owner_user_id
                WHEN s.linked <= i.occurred_at THEN s.user_id END AS user_id
      FROM input i
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
    SELECT r.outbox_id, r.outbox_topic, r.outbox_headers::jsonb, r.outbox_created_at, r.id,
           r.correlation_id, r.occurred_offset
      FROM resolved r
      JOIN recorded e ON e.id = r.id
    RETURNING id
),
unresolved AS (
    SELECT i.*, now() + make_interval(secs => w.seconds) AS wait_until
      FROM input i, (SELECT (%(wait_seconds)b::integer[])[1] AS seconds) w
     WHERE w.seconds > 0
       AND NOT EXISTS (SELECT 1 FROM resolved r WHERE r.position = i.position)
),
waiting AS (
    INSERT INTO user_activity.waiting_actions
           (idempotency_key, id, action_type, owner_anonymous_id, owner_user_id, occurred_at,
            occurred_offset, property_object_id, favorite_id, source_message_id, outbox_id,
            outbox_topic, outbox_headers, correlation_id, wait_until)
    SELECT u.idempotency_key, u.id, u.action_type, u.owner_anonymous_id, u.owner_user_id,
           u.occurred_at, u.occurred_offset, u.property_object_id, u.favorite_id,
           u.source_message_id, u.outbox_id, u.outbox_topic, u.outbox_headers::jsonb,
           u.correlation_id, u.wait_until
      FROM unresolved u
    ON CONFLICT (idempotency_key) DO NOTHING
    RETURNING idempotency_key
)
SELECT r.position, r.session_id, r.anonymous_id, r.user_id, e.id IS NOT NULL AS inserted,
       pg_current_xact_id()::text::bigint AS txid
  FROM resolved r
  LEFT JOIN recorded e ON e.id = r.id
UNION ALL
SELECT u.position, NULL, NULL, NULL, w.idempotency_key IS NOT NULL,
       pg_current_xact_id()::text::bigint
  FROM unresolved u
  LEFT JOIN waiting w ON w.idempotency_key = u.idempotency_key
