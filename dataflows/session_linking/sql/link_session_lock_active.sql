-- The device's Active session, row-locked until the transaction ends (at most one row:
-- ux_sessions_active_anonymous), with when it started, and the SignedInAt of the device's last
-- applied sign-in (the latest of all its sessions'). A concurrent change of the row makes this
-- wait; the row is then re-checked against the committed version (READ COMMITTED), so the
-- caller decides on the latest state, never on a stale read. FOR NO KEY UPDATE, not FOR UPDATE:
-- inserts of action_events that reference the session (FOR KEY SHARE) are not blocked.
SELECT s.id, s.user_id, s.started_at,
       (SELECT max(d.last_signed_in_at) FROM user_activity.sessions d
         WHERE d.anonymous_id = %(anonymous_id)s) AS device_last_signed_in_at
  FROM user_activity.sessions s
 WHERE s.anonymous_id = %(anonymous_id)s
   AND s.status = 'Active'
   FOR NO KEY UPDATE OF s
