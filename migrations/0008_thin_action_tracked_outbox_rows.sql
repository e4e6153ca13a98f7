-- Thin action-tracked outbox rows: the event is rendered from the action it announces (issue 16).
-- Forward-only. Instant on a database holding 0001-0007 data: no row is rewritten or scanned.
--
-- Why: an action-tracked outbox row stored the event's JSON (~570 B) and key (37 B), every field
-- of which is also in the action_events row written in the same transaction: 777 B of WAL per
-- event for the outbox row, 39 % of the job's WAL. A thin row stores only what action_events
-- does not hold:
--
-- * action_event_id: the action_events row it announces (AggregateId, the record key, and the
--   payload's fields). That row is immutable (INV-ACT-001), so the event rendered from it is
--   the same bytes at every publication;
-- * correlation_id: the source envelope's CorrelationId as UTF-8 (NULL when it had none;
--   bytea, since JSON text may carry a NUL character, which a PostgreSQL text cannot);
-- * occurred_offset: the UTC offset, in seconds, of the source's OccurredAt, which
--   action_events.occurred_at (timestamptz) does not keep: the event repeats OccurredAt with the
--   offset it came with (e.g. +03:00);
-- * created_at is the event's CreatedAt: the sink writes it (the batch's clock), not now().
--
-- key and value are NULL in a thin row; the publisher renders them (schemas.action_tracked,
-- the same function the sink renders the fast path's copy with). Rows with a value (the
-- session-linked rows, and every row written before this migration) are published as stored.
-- A row that is refused for good is parked with its rendered value (outbox_parked keeps value
-- NOT NULL).
--
-- No foreign key from action_event_id: its check would lock the action row (see 0007). The
-- outbox row and its action are inserted by one statement, and action_events rows are never
-- deleted.

ALTER TABLE user_activity.outbox
    ADD COLUMN action_event_id uuid NULL,
    ADD COLUMN correlation_id  bytea NULL,
    ADD COLUMN occurred_offset integer NULL,
    ALTER COLUMN value DROP NOT NULL;

-- Either a stored value, or an action to render it from (with the offset of its OccurredAt).
-- NOT VALID: every row already there has a value; new rows are checked.
ALTER TABLE user_activity.outbox
    ADD CONSTRAINT chk_outbox_value_or_action CHECK (
        (value IS NOT NULL AND action_event_id IS NULL)
        OR (value IS NULL AND key IS NULL AND action_event_id IS NOT NULL
            AND occurred_offset IS NOT NULL AND occurred_offset BETWEEN -86399 AND 86399)
    ) NOT VALID;
