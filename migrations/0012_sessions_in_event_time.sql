-- transactional: false
-- Sessions in event time, and favorites that wait for their owner's session (issue 41).
-- Forward-only; safe to run again (every statement checks what exists).
--
-- sessions.linked_signed_in_at: the SignedInAt of the sign-in that linked the session (or started
-- it already linked). A guest action carries the session's user only when the session was linked
-- at or before it, compared in the producers' clock domain (OccurredAt against SignedInAt), never
-- the server's linked_at against a producer's timestamp. NULL for a session linked before this
-- migration or by another writer: linked_at stands in.
ALTER TABLE user_activity.sessions ADD COLUMN IF NOT EXISTS linked_signed_in_at timestamptz NULL;

-- A like anchors to the owner's session that covered its OccurredAt (started_at <= t < ended_at):
-- the latest session of a device or user that started at or before t, one index entry.
CREATE INDEX CONCURRENTLY IF NOT EXISTS ix_sessions_anonymous_started
    ON user_activity.sessions (anonymous_id, started_at DESC, id DESC);
CREATE INDEX CONCURRENTLY IF NOT EXISTS ix_sessions_user_started
    ON user_activity.sessions (user_id, started_at DESC, id DESC) WHERE user_id IS NOT NULL;

-- A favorite whose owner had no session yet, written in the batch's transaction instead of being
-- skipped: it is recorded once a session of its owner appears (a sign-in being applied), or
-- skipped as no-session at wait_until. Everything its row and outbox row need is kept.
CREATE TABLE IF NOT EXISTS user_activity.waiting_actions (
    idempotency_key    text        PRIMARY KEY,
    id                 uuid        NOT NULL,   -- the action_events id it will have
    action_type        text        NOT NULL,
    owner_anonymous_id uuid        NULL,
    owner_user_id      uuid        NULL,
    occurred_at        timestamptz NOT NULL,
    occurred_offset    integer     NOT NULL,
    property_object_id uuid        NOT NULL,
    favorite_id        uuid        NOT NULL,
    source_message_id  uuid        NOT NULL,
    outbox_id          uuid        NOT NULL,
    outbox_topic       text        NOT NULL,
    outbox_headers     jsonb       NOT NULL DEFAULT '{}'::jsonb,
    correlation_id     bytea       NULL,
    waiting_since      timestamptz NOT NULL DEFAULT now(),
    retry_at           timestamptz NOT NULL DEFAULT now(),
    wait_until         timestamptz NOT NULL,
    CONSTRAINT chk_waiting_actions_owner
        CHECK ((owner_anonymous_id IS NULL) <> (owner_user_id IS NULL))
);
CREATE INDEX IF NOT EXISTS ix_waiting_actions_retry ON user_activity.waiting_actions (retry_at);
CREATE INDEX IF NOT EXISTS ix_waiting_actions_until ON user_activity.waiting_actions (wait_until);

COMMENT ON COLUMN user_activity.action_events.user_id IS
    'The user the action belongs to: the payload''s UserId for a user''s own action; for a '
    'guest action, the session''s user when the session was linked at or before the action '
    '(coalesce(linked_signed_in_at, linked_at) <= occurred_at), else NULL. A guest action stays '
    'NULL after a later link and reaches the user''s history through the session.';
