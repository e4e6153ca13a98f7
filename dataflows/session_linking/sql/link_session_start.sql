-- Start a new Active session for the device, already linked to the user (session-started). It
-- starts at the sign-in's SignedInAt (event time: a like is anchored to the session that covered
-- it, issue 41); linked_at and last_activity_at are the server clock.
-- If another writer created an Active session for the device meanwhile, nothing is inserted
-- (the unique index ux_sessions_active_anonymous decides; the conflict waits for that writer)
-- and no row is returned: the caller re-reads the device's Active session and decides again.
INSERT INTO user_activity.sessions
       (id, anonymous_id, user_id, linked_at, status, started_at, last_activity_at,
        last_signed_in_at, linked_signed_in_at)
VALUES (%(session_id)s, %(anonymous_id)s, %(user_id)s, now(), 'Active', %(signed_in_at)s, now(),
        %(signed_in_at)s, %(signed_in_at)s)
ON CONFLICT (anonymous_id) WHERE status = 'Active' DO NOTHING
RETURNING started_at
