-- Resolve each owner's session (INV-ACT-003): by AnonymousId, else by UserId; the Active
-- session first, else the latest by last_activity_at (several Active sessions for one user:
-- the latest). Never creates a session. Returns at most one row per owner index, with the
-- session's linked_at: the row's UserId is the session's user only when linked_at <= the
-- action's OccurredAt, else null (the snapshot as of the action; records.py). Index scans that
-- stop at their first entry, as in record_actions.sql (migration 0011).
SELECT o.owner_index, s.id, s.anonymous_id, s.user_id, s.linked_at
  FROM unnest(%(anonymous_ids)b::uuid[], %(user_ids)b::uuid[])
       WITH ORDINALITY AS o (anonymous_id, user_id, owner_index)
 CROSS JOIN LATERAL (
        (SELECT c.id, c.anonymous_id, c.user_id, c.linked_at
           FROM user_activity.sessions c
          WHERE o.anonymous_id IS NOT NULL AND c.anonymous_id = o.anonymous_id
            AND c.status = 'Active')
        UNION ALL
        (SELECT c.id, c.anonymous_id, c.user_id, c.linked_at
           FROM user_activity.sessions c
          WHERE o.anonymous_id IS NOT NULL AND c.anonymous_id = o.anonymous_id
          ORDER BY c.last_activity_at DESC, c.id DESC
          LIMIT 1)
        LIMIT 1
       ) s
UNION ALL
SELECT o.owner_index, s.id, s.anonymous_id, s.user_id, s.linked_at
  FROM unnest(%(anonymous_ids)b::uuid[], %(user_ids)b::uuid[])
       WITH ORDINALITY AS o (anonymous_id, user_id, owner_index)
 CROSS JOIN LATERAL (
        (SELECT c.id, c.anonymous_id, c.user_id, c.linked_at
           FROM user_activity.sessions c
          WHERE o.anonymous_id IS NULL AND c.user_id = o.user_id AND c.status = 'Active'
          ORDER BY c.last_activity_at DESC, c.id DESC
          LIMIT 1)
        UNION ALL
        (SELECT c.id, c.anonymous_id, c.user_id, c.linked_at
           FROM user_activity.sessions c
          WHERE o.anonymous_id IS NULL AND c.user_id = o.user_id
          ORDER BY c.last_activity_at DESC, c.id DESC
          LIMIT 1)
        LIMIT 1
       ) s
