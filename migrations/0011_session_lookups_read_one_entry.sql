-- transactional: false
-- Session lookups that read a few index entries, however many sessions an owner or device has.
--
-- The favorites statement resolved an owner's session with ORDER BY (status = 'Active') DESC,
-- last_activity_at DESC, id DESC LIMIT 1 over all the owner's sessions, and session linking
-- found a device's last sign-in the same way: a read and a sort of every session of the owner
-- or device, per message. An owner with 200,000 sessions (a test account, a kiosk, a bot)
-- took 34 ms per lookup, so a batch of 1,000 of its events ran past the statement timeout,
-- which is retried as an outage: the stream stalled for good on one owner.
--
-- The lookups now ask for the Active session first, then the latest (UNION ALL ... LIMIT 1),
-- each an index scan that stops at its first entry:
--   - a device's Active session: ux_sessions_active_anonymous (unique);
--   - a user's latest Active session: ix_sessions_user_active_latest (new);
--   - the latest session of a device or user: ix_sessions_anonymous_latest and
--     ix_sessions_user_latest, which add id DESC (the tie-break) to the indexes they replace;
--   - a device's last applied sign-in: ix_sessions_device_last_sign_in (new).
--
-- Not in a transaction: CREATE INDEX CONCURRENTLY keeps sessions writable while it builds (the
-- session-linking flow goes on). A build that fails leaves an invalid index and this migration
-- unrecorded; running migrate again drops it and builds it anew.

DROP INDEX CONCURRENTLY IF EXISTS user_activity.ix_sessions_user_active_latest;
CREATE INDEX CONCURRENTLY ix_sessions_user_active_latest
    ON user_activity.sessions (user_id, last_activity_at DESC, id DESC) WHERE status = 'Active';

DROP INDEX CONCURRENTLY IF EXISTS user_activity.ix_sessions_anonymous_latest;
CREATE INDEX CONCURRENTLY ix_sessions_anonymous_latest
    ON user_activity.sessions (anonymous_id, last_activity_at DESC, id DESC);
DROP INDEX CONCURRENTLY IF EXISTS user_activity.ix_sessions_anonymous_last_activity;

DROP INDEX CONCURRENTLY IF EXISTS user_activity.ix_sessions_user_latest;
CREATE INDEX CONCURRENTLY ix_sessions_user_latest
    ON user_activity.sessions (user_id, last_activity_at DESC, id DESC) WHERE user_id IS NOT NULL;
DROP INDEX CONCURRENTLY IF EXISTS user_activity.ix_sessions_user_last_activity;

DROP INDEX CONCURRENTLY IF EXISTS user_activity.ix_sessions_device_last_sign_in;
CREATE INDEX CONCURRENTLY ix_sessions_device_last_sign_in
    ON user_activity.sessions (anonymous_id, last_signed_in_at DESC, id)
    WHERE last_signed_in_at IS NOT NULL;
