-- The whole rows of a window's (txid, id) pairs; a thin row (migration 0008: no value) with the
-- action it announces, OccurredAt read as the local time at its stored offset.
SELECT o.txid, o.id, o.topic, o.key, o.value, o.headers, o.created_at,
       o.action_event_id, o.correlation_id, o.occurred_offset, e.id, e.action_type,
       e.session_id, e.anonymous_id, e.user_id,
       e.occurred_at AT TIME ZONE make_interval(secs => o.occurred_offset),
       e.property_object_id, e.favorite_id
  FROM unnest(%(txids)s::xid8[], %(ids)s::uuid[]) AS w (txid, id)
  JOIN user_activity.outbox o ON o.txid = w.txid AND o.id = w.id
  LEFT JOIN user_activity.action_events e ON e.id = o.action_event_id
 ORDER BY o.txid, o.id
