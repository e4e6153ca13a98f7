-- A sign-in at or before the device's last applied one never starts a session (issue 14's rule,
-- made airtight for replays). Forward-only; no row is rewritten.
--
-- A sign-in's idempotency mark is its only dedup, and marks go with their daily partition after
-- USER_ACTIVITY_RETENTION_DAYS. A sign-in replayed later (a backfill) is then decided again: on a
-- device whose session had ended meanwhile it started a new Active session and published
-- session-started, a second effect of one source message. Now such a sign-in, at or before the
-- device's last applied one, is `superseded` when that one was its own user's (no change, no
-- event, no row), and a late conflict when it was another user's:
--
-- reason 'would-start': the device has no Active session; starting one for this sign-in would make
-- its user the device's current one after a later sign-in of someone else.

ALTER TABLE user_activity.sign_in_conflicts
    DROP CONSTRAINT chk_sign_in_conflicts_reason,
    ADD CONSTRAINT chk_sign_in_conflicts_reason
        CHECK (reason IN ('would-relink', 'predates-session', 'would-start'));
