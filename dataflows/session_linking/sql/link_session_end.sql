-- End the device's Active session that belongs to another user (before a new one starts), at the
-- sign-in's SignedInAt (event time, never before the session started): the new session starts
-- there. Conditional: no row changes unless it is still Active and still that user's. Returns the
-- end.
UPDATE user_activity.sessions
   SET status = 'Ended',
       ended_at = greatest(started_at, %(signed_in_at)s)
 WHERE id = %(session_id)s
   AND status = 'Active'
   AND user_id = %(user_id)s
RETURNING ended_at
