-- The owner's session for an action at i.occurred_at (INV-ACT-003, in event time; issue 41), the
-- body of a LATERAL subquery over a row i (owner_anonymous_id, owner_user_id, occurred_at). Never
-- creates one. The first that exists, each an index scan that stops at its first entry:
--   1. the session that covered the action: for a device, its Active session if it started by
--      then, else its latest session started by then if it ended after; for a user, the latest
--      by last_activity_at of its Active sessions that were its own by then (started, and linked
--      to it, at or before the action), else its latest session started by then, its own by
--      then and ended after;
--   2. the seed's rule: the Active session (a user's latest by last_activity_at), else the latest
--      session by last_activity_at.
-- Returns id, anonymous_id, user_id and linked (when the session became its user's, in the
-- producers' clock: the SignedInAt of the sign-in that linked it; linked_at for older links).
    (SELECT c.id, c.anonymous_id, c.user_id, coalesce(c.linked_signed_in_at, c.linked_at) AS linked
       FROM user_activity.sessions c
      WHERE i.owner_anonymous_id IS NOT NULL AND c.anonymous_id = i.owner_anonymous_id
        AND c.status = 'Active' AND c.started_at <= i.occurred_at)
    UNION ALL
    (SELECT d.id, d.anonymous_id, d.user_id, d.linked
       FROM (SELECT c.id, c.anonymous_id, c.user_id, c.ended_at,
                    coalesce(c.linked_signed_in_at, c.linked_at) AS linked
               FROM user_activity.sessions c
              WHERE i.owner_anonymous_id IS NOT NULL AND c.anonymous_id = i.owner_anonymous_id
                AND c.started_at <= i.occurred_at
              ORDER BY c.started_at DESC, c.id DESC
              LIMIT 1) d
      WHERE d.ended_at > i.occurred_at)
    UNION ALL
    (SELECT c.id, c.anonymous_id, c.user_id, coalesce(c.linked_signed_in_at, c.linked_at)
       FROM user_activity.sessions c
      WHERE i.owner_anonymous_id IS NULL AND c.user_id = i.owner_user_id AND c.status = 'Active'
        AND greatest(c.started_at, coalesce(c.linked_signed_in_at, c.linked_at)) <= i.occurred_at
      ORDER BY c.last_activity_at DESC, c.id DESC
      LIMIT 1)
    UNION ALL
    (SELECT d.id, d.anonymous_id, d.user_id, d.linked
       FROM (SELECT c.id, c.anonymous_id, c.user_id, c.ended_at,
                    coalesce(c.linked_signed_in_at, c.linked_at) AS linked
               FROM user_activity.sessions c
              WHERE i.owner_anonymous_id IS NULL AND c.user_id = i.owner_user_id
                AND c.started_at <= i.occurred_at
              ORDER BY c.started_at DESC, c.id DESC
              LIMIT 1) d
      WHERE d.ended_at > i.occurred_at AND d.linked <= i.occurred_at)
    UNION ALL
    (SELECT c.id, c.anonymous_id, c.user_id, coalesce(c.linked_signed_in_at, c.linked_at)
       FROM user_activity.sessions c
      WHERE i.owner_anonymous_id IS NOT NULL AND c.anonymous_id = i.owner_anonymous_id
        AND c.status = 'Active')
    UNION ALL
    (SELECT c.id, c.anonymous_id, c.user_id, coalesce(c.linked_signed_in_at, c.linked_at)
       FROM user_activity.sessions c
      WHERE i.owner_anonymous_id IS NULL AND c.user_id = i.owner_user_id AND c.status = 'Active'
      ORDER BY c.last_activity_at DESC, c.id DESC
      LIMIT 1)
    UNION ALL
    (SELECT c.id, c.anonymous_id, c.user_id, coalesce(c.linked_signed_in_at, c.linked_at)
       FROM user_activity.sessions c
      WHERE i.owner_anonymous_id IS NOT NULL AND c.anonymous_id = i.owner_anonymous_id
      ORDER BY c.last_activity_at DESC, c.id DESC
      LIMIT 1)
    UNION ALL
    (SELECT c.id, c.anonymous_id, c.user_id, coalesce(c.linked_signed_in_at, c.linked_at)
       FROM user_activity.sessions c
      WHERE i.owner_anonymous_id IS NULL AND c.user_id = i.owner_user_id
      ORDER BY c.last_activity_at DESC, c.id DESC
      LIMIT 1)
    LIMIT 1
