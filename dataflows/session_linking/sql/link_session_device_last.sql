-- The SignedInAt of the device's last applied sign-in (NULL: none yet), when it has no Active
-- session to lock.
SELECT max(last_signed_in_at) FROM user_activity.sessions WHERE anonymous_id = %(anonymous_id)s
