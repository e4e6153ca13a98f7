-- The device's last applied sign-in (no row: none yet): its SignedInAt, the latest of all its
-- sessions' last_signed_in_at, and the user of the session holding it; and whether a session of
-- the device holds a sign-in of this user at or after this one (it is then already applied or
-- covered by a later one of the same user). Run after the Active session's row lock, so it sees
-- what committed before it.
SELECT last.last_signed_in_at, last.user_id,
       EXISTS (SELECT 1 FROM user_activity.sessions mine
                WHERE mine.anonymous_id = %(anonymous_id)s AND mine.user_id = %(user_id)s
                  AND mine.last_signed_in_at >= %(signed_in_at)s) AS covered
  FROM (SELECT last_signed_in_at, user_id
          FROM user_activity.sessions
         WHERE anonymous_id = %(anonymous_id)s AND last_signed_in_at IS NOT NULL
         ORDER BY last_signed_in_at DESC, id
         LIMIT 1) last
