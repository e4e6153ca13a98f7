-- LinkOnce (INV-SES-002): the guest Active session gets its user, linked_at = now() (the seed's
-- server clock). Conditional: no row changes unless the session is still Active and still a
-- guest, so a session is linked at most once whatever runs concurrently. Keeps the sign-in's
-- SignedInAt as the last applied one and as the moment of the link in event time
-- (linked_signed_in_at: a guest action before it keeps a null UserId). Returns the link time.
UPDATE user_activity.sessions
   SET user_id = %(user_id)s,
       linked_at = now(),
       last_signed_in_at = %(signed_in_at)s,
       linked_signed_in_at = %(signed_in_at)s
 WHERE id = %(session_id)s
   AND status = 'Active'
   AND user_id IS NULL
RETURNING linked_at
