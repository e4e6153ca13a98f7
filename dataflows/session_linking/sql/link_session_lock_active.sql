-- The device's Active session, row-locked until the transaction ends (at most one row:
-- ux_sessions_active_anonymous). A concurrent change of the row makes this wait; the row is then
-- re-checked against the committed version (READ COMMITTED), so the caller decides on the latest
-- state, never on a stale read. FOR NO KEY UPDATE, not FOR UPDATE: inserts of action_events that
-- reference the session (FOR KEY SHARE) are not blocked.
SELECT id, user_id
  FROM user_activity.sessions
 WHERE anonymous_id = %(anonymous_id)s
   AND status = 'Active'
   FOR NO KEY UPDATE
