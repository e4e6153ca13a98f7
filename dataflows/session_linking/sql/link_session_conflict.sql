-- A late sign-in that cannot be applied (see migration 0005): recorded once per sign-in.
INSERT INTO user_activity.sign_in_conflicts
       (message_id, anonymous_id, session_id, session_user_id, sign_in_user_id, signed_in_at,
        device_last_signed_in_at, reason)
VALUES (%(message_id)s, %(anonymous_id)s, %(session_id)s, %(session_user_id)s,
        %(sign_in_user_id)s, %(signed_in_at)s, %(device_last_signed_in_at)s, %(reason)s)
ON CONFLICT (message_id) DO NOTHING
