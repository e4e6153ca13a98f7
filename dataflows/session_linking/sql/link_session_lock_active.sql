-- The device's Active session, row-locked until the transaction ends (at most one row:
-- ux_sessions_active_anonymous), with when it started. A concurrent change of the row makes
-- this wait; the row is then re-checked against the committed version (READ COMMITTED), so the
-- caller decides on the latest state, never on a stale read. FOR NO KEY UPDATE, not FOR UPDATE:
-- inserts of action_events that reference the session (FOR KEY SHARE) are not blocked. (The
-- device's last applied SignedInAt is read by its own statement after this one: a subselect
-- here would keep the snapshot taken before the wait for the lock.)
SELECT id, user_id, started_at
  FROM user_activity.sessions
 WHERE anonymous_id = %(anonymous_id)s
   AND status = 'Active'
   FOR NO KEY UPDATE
