-- Parked outbox rows (issue 12): a row the broker refuses for good (the record itself: too large,
-- invalid) is kept aside instead of blocking the rows behind it. Forward-only.
--
-- attempts:   produce attempts that ended in a per-record refusal (0 for a row never refused)
-- last_error: the librdkafka error name of the last refusal
-- parked_at:  when the publisher set the row aside; NULL = the publisher sends it. An operator
--             re-queues it (python -m runtime outbox requeue) by setting it back to NULL.

ALTER TABLE user_activity.outbox
    ADD COLUMN attempts   integer     NOT NULL DEFAULT 0,
    ADD COLUMN last_error text        NULL,
    ADD COLUMN parked_at  timestamptz NULL,
    ADD CONSTRAINT chk_outbox_attempts CHECK (attempts >= 0),
    ADD CONSTRAINT chk_outbox_parked CHECK (
        parked_at IS NULL OR (published_at IS NULL AND last_error IS NOT NULL AND attempts > 0)
    );

-- The sweep reads unpublished rows that are not parked, oldest first; so does the stall watchdog.
DROP INDEX user_activity.ix_outbox_unpublished;
CREATE INDEX ix_outbox_unpublished
    ON user_activity.outbox (created_at, id) WHERE published_at IS NULL AND parked_at IS NULL;
CREATE INDEX ix_outbox_parked
    ON user_activity.outbox (parked_at) WHERE parked_at IS NOT NULL;
