-- The whole rows of a window's (txid, id) pairs; a thin row (migration 0008: no value) with the
-- action it announces, OccurredAt read as the local time at its stored offset. set_aside: the
-- row is parked or held already (a window never sends it again).
SELECT o.txid::text, o.id, o.topic, o.key, o.value, o.headers, o.created_at,
       EXISTS (SELECT 1 FROM user_activity.outbox_parked p WHERE p.id = o.id)
       OR EXISTS (SELECT 1 FROM user_activity.outbox_held h WHERE h.id = o.id),
       o.action_event_id, o.correlation_id, o.occurred_offset, e.id, e.action_type,
       e.session_id, e.anonymous_id, e.user_id,
       e.occurred_at AT TIME ZONE make_interval(secs => o.occurred_offset),
       e.property_object_id, e.favorite_id
  FROM unnest(%(txids)s::xid8[], %(ids)s::uuid[]) AS w (txid, id)
  JOIN user_activity.outbox o ON o.txid = w.txid AND o.id = w.id
  LEFT JOIN user_activity.action_events e ON e.id = o.action_event_id
 ORDER BY o.txid, o.id
