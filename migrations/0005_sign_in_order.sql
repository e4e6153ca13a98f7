-- Sign-ins decided by SignedInAt, not by arrival (issue 14). Forward-only.
--
-- sessions.last_signed_in_at: the SignedInAt of the latest sign-in applied to the session (the
-- one that linked or started it, or confirmed it for the same user). A device's last applied
-- sign-in is the latest of its sessions'. Only a linked session has one.
ALTER TABLE user_activity.sessions
    ADD COLUMN last_signed_in_at timestamptz NULL,
    ADD CONSTRAINT chk_sessions_sign_in_needs_user
        CHECK (last_signed_in_at IS NULL OR user_id IS NOT NULL);

-- A sign-in that arrived later than the allowed lateness and would change who owns the
-- device's session: LinkOnce (INV-SES-002) forbids re-linking, so it is not applied; it is
-- recorded here for an operator (one row per sign-in, never applied silently).
CREATE TABLE user_activity.sign_in_conflicts (
    message_id               uuid        PRIMARY KEY,  -- the late sign-in's MessageId
    anonymous_id             uuid        NOT NULL,
    session_id               uuid        NULL,         -- the device's Active session, if any
    session_user_id          uuid        NULL,         -- its user (NULL: a guest session)
    sign_in_user_id          uuid        NOT NULL,     -- who signed in late
    signed_in_at             timestamptz NOT NULL,
    device_last_signed_in_at timestamptz NOT NULL,     -- the later sign-in already applied
    reason                   text        NOT NULL,
    detected_at              timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT chk_sign_in_conflicts_late CHECK (signed_in_at < device_last_signed_in_at),
    CONSTRAINT chk_sign_in_conflicts_reason
        CHECK (reason IN ('would-relink', 'predates-session'))
);
CREATE INDEX ix_sign_in_conflicts_detected ON user_activity.sign_in_conflicts (detected_at);
