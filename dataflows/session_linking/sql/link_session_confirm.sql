-- A sign-in of the session's own user: nothing changes but the session's last applied SignedInAt
-- (kept the latest).
UPDATE user_activity.sessions
   SET last_signed_in_at = greatest(last_signed_in_at, %(signed_in_at)s)
 WHERE id = %(session_id)s
