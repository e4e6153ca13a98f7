-- The SignedInAt of the device's last applied sign-in (NULL: none yet): the latest of all its
-- sessions'. Run after the Active session's row lock, so it sees what committed before it.
SELECT max(last_signed_in_at) FROM user_activity.sessions WHERE anonymous_id = %(anonymous_id)s
