-- Record a batch of actions in one statement: idempotency marks, action_events rows and
-- action-tracked outbox rows. A message whose mark or source_message_id already exists changes
-- nothing (ON CONFLICT DO NOTHING; a racing writer waits, then skips). Returns the ids of the
-- action_events rows actually inserted.
-- The outbox rows are thin (migration 0008): they name their action_events row and keep the
-- CorrelationId, OccurredAt's offset and CreatedAt; the publisher renders the event from them.
WITH input AS (
    SELECT *
      FROM unnest(
               %(idempotency_keys)b::text[], %(ids)b::uuid[], %(action_types)b::text[],
               %(session_ids)b::uuid[], %(anonymous_ids)b::uuid[], %(user_ids)b::uuid[],
               %(occurred_ats)b::timestamptz[], %(property_object_ids)b::uuid[],
               %(favorite_ids)b::uuid[], %(source_message_ids)b::uuid[],
               %(outbox_ids)b::uuid[], %(outbox_topics)b::text[], %(outbox_headers)b::text[],
               %(correlation_ids)b::bytea[], %(occurred_offsets)b::integer[],
               %(outbox_created_ats)b::timestamptz[]
           ) AS t (idempotency_key, id, action_type, session_id, anonymous_id, user_id,
                   occurred_at, property_object_id, favorite_id, source_message_id,
                   outbox_id, outbox_topic, outbox_headers, correlation_id, occurred_offset,
                   outbox_created_at)
),
marked AS (
    INSERT INTO user_activity.consumer_idempotency_marks (key)
    SELECT idempotency_key FROM input
    ON CONFLICT (key, processed_on) DO NOTHING
    RETURNING key
),
recorded AS (
    INSERT INTO user_activity.action_events
           (id, action_type, session_id, anonymous_id, user_id, occurred_at,
            property_object_id, favorite_id, source_message_id)
    SELECT i.id, i.action_type, i.session_id, i.anonymous_id, i.user_id, i.occurred_at,
           i.property_object_id, i.favorite_id, i.source_message_id
      FROM input i
      JOIN marked m ON m.key = i.idempotency_key
    ON CONFLICT (source_message_id) WHERE source_message_id IS NOT NULL DO NOTHING
    RETURNING id
),
announced AS (
    INSERT INTO user_activity.outbox
           (id, topic, headers, created_at, action_event_id, correlation_id, occurred_offset)
    SELECT i.outbox_id, i.outbox_topic, i.outbox_headers::jsonb, i.outbox_created_at, i.id,
           i.correlation_id, i.occurred_offset
      FROM input i
      JOIN recorded r ON r.id = i.id
    RETURNING id
)
SELECT r.id FROM recorded r
