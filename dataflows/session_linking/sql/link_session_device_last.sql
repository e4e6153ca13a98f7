-- The device's last applied sign-in (no row: none yet): its SignedInAt, the latest of all its
-- sessions' last_signed_in_at, and the user of the session holding it. Run after the Active
-- session's row lock, so it sees what committed before it.
SELECT last_signed_in_at, user_id
  FROM user_activity.sessions
 WHERE anonymous_id = %(anonymous_id)s AND last_signed_in_at IS NOT NULL
 ORDER BY last_signed_in_at DESC, id
 LIMIT 1
