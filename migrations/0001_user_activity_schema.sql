-- Schema user_activity (SPEC §3). Forward-only: fix mistakes in a later file, never edit this one.

CREATE SCHEMA IF NOT EXISTS user_activity;

-- Tracked sessions of a device (anonymous_id), linked once to a user (INV-SES-002 LinkOnce).
CREATE TABLE user_activity.sessions (
    id               uuid        PRIMARY KEY,
    anonymous_id     uuid        NOT NULL,
    user_id          uuid        NULL,
    linked_at        timestamptz NULL,
    status           text        NOT NULL,
    started_at       timestamptz NOT NULL,
    last_activity_at timestamptz NOT NULL,
    ended_at         timestamptz NULL,
    CONSTRAINT chk_sessions_link_pair CHECK ((user_id IS NULL) = (linked_at IS NULL)),
    CONSTRAINT chk_sessions_status CHECK (status IN ('Active', 'Ended')),
    CONSTRAINT chk_sessions_ended_at CHECK ((status = 'Ended') = (ended_at IS NOT NULL))
);

-- At most one Active session per device.
CREATE UNIQUE INDEX ux_sessions_active_anonymous
    ON user_activity.sessions (anonymous_id) WHERE status = 'Active';
-- Owner resolution (INV-ACT-003): by device, else by user; latest activity first.
CREATE INDEX ix_sessions_anonymous_last_activity
    ON user_activity.sessions (anonymous_id, last_activity_at DESC);
CREATE INDEX ix_sessions_user_last_activity
    ON user_activity.sessions (user_id, last_activity_at DESC) WHERE user_id IS NOT NULL;

-- The immutable action history (INV-ACT-001).
CREATE TABLE user_activity.action_events (
    id                 uuid        PRIMARY KEY,  -- UUIDv7: time-ordered, cheap on the index
    action_type        text        NOT NULL,
    session_id         uuid        NOT NULL REFERENCES user_activity.sessions (id),
    anonymous_id       uuid        NOT NULL,
    user_id            uuid        NULL,         -- snapshot of the session's user at the action
    occurred_at        timestamptz NOT NULL,     -- from the payload, never the server clock
    property_object_id uuid        NOT NULL,
    favorite_id        uuid        NOT NULL,
    source_message_id  uuid        NULL,
    recorded_at        timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT chk_action_events_type CHECK (action_type IN ('AddToFavorites', 'RemoveFromFavorites'))
);

-- INV-ACT-004: one row per source message.
CREATE UNIQUE INDEX ux_action_events_source_message
    ON user_activity.action_events (source_message_id) WHERE source_message_id IS NOT NULL;
CREATE INDEX ix_action_events_session ON user_activity.action_events (session_id);
CREATE INDEX ix_action_events_user
    ON user_activity.action_events (user_id) WHERE user_id IS NOT NULL;

-- INV-ACT-001: the database itself refuses UPDATE, DELETE and TRUNCATE of action history.
CREATE FUNCTION user_activity.refuse_action_event_change() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'user_activity.action_events is immutable (INV-ACT-001): % refused', TG_OP
        USING ERRCODE = 'restrict_violation';
END;
$$;

CREATE TRIGGER trg_action_events_immutable
    BEFORE UPDATE OR DELETE ON user_activity.action_events
    FOR EACH ROW EXECUTE FUNCTION user_activity.refuse_action_event_change();
CREATE TRIGGER trg_action_events_no_truncate
    BEFORE TRUNCATE ON user_activity.action_events
    FOR EACH STATEMENT EXECUTE FUNCTION user_activity.refuse_action_event_change();

-- Consumer-level idempotency marks: 'user-activity-favorites:{ActionType}:{MessageId}', ...
CREATE TABLE user_activity.consumer_idempotency_marks (
    key          text        PRIMARY KEY,
    processed_at timestamptz NOT NULL DEFAULT now()
);

-- Transactional outbox: one row per event to publish, written with the change it announces.
CREATE TABLE user_activity.outbox (
    id           uuid        PRIMARY KEY,  -- the event's MessageId (stable across re-publication)
    topic        text        NOT NULL,
    key          bytea       NULL,
    value        bytea       NOT NULL,
    headers      jsonb       NOT NULL DEFAULT '{}'::jsonb,
    created_at   timestamptz NOT NULL DEFAULT now(),
    published_at timestamptz NULL
);
CREATE INDEX ix_outbox_unpublished
    ON user_activity.outbox (created_at, id) WHERE published_at IS NULL;
CREATE INDEX ix_outbox_published
    ON user_activity.outbox (published_at) WHERE published_at IS NOT NULL;

-- User history (/profile/events, AC6): actions whose session is now linked to the user, plus
-- those recorded with the user's id. Guest likes appear after linking, with no backfill.
CREATE VIEW user_activity.user_action_history AS
SELECT s.user_id AS history_user_id, e.*
  FROM user_activity.action_events e
  JOIN user_activity.sessions s ON s.id = e.session_id
 WHERE s.user_id IS NOT NULL
UNION
SELECT e.user_id AS history_user_id, e.*
  FROM user_activity.action_events e
 WHERE e.user_id IS NOT NULL;
