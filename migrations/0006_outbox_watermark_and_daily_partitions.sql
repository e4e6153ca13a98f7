-- Outbox publication by transaction snapshot, and bounded storage by daily partitions (issue 16).
-- Forward-only. Converts a database holding 0001-0005 data in place.
--
-- Idempotency marks: partitioned by processed_on (the UTC day of the marking transaction). The
-- primary key is (key, processed_on): a same-day redelivery conflicts and is a no-op; a
-- redelivery on a later day writes a new mark and nothing else (the unique
-- action_events.source_message_id stays the permanent authority). The existing table, if it holds
-- marks, becomes the partition of everything up to today (attached, not copied), dropped as one
-- piece once it is older than the retention.
--
-- Outbox: partitioned by created_at (UTC days). No per-row publication state: each row keeps
-- the id of the transaction that wrote it (txid), and the publisher persists, once per publish
-- cycle, the snapshot up to which every committed row was delivered (outbox_watermark). A row is
-- unpublished while its txid is not visible in that snapshot. Unpublished rows of the old table
-- are copied (the publisher sends them after the migration), published ones are dropped, parked
-- ones move to outbox_parked.
--
-- Partitions are created ahead by user_activity.ensure_daily_partitions (the maintenance step:
-- python -m cli maintain); a DEFAULT partition of each table takes a row whose day has none,
-- so a write never fails for a missing partition.

-- 1. Idempotency marks --------------------------------------------------------------------------
ALTER TABLE user_activity.consumer_idempotency_marks
    RENAME TO consumer_idempotency_marks_upto_migration;
ALTER INDEX user_activity.consumer_idempotency_marks_pkey
    RENAME TO consumer_idempotency_marks_upto_migration_key;

CREATE TABLE user_activity.consumer_idempotency_marks (
    key          text        NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    processed_on date        NOT NULL DEFAULT (now() AT TIME ZONE 'UTC')::date,
    CONSTRAINT consumer_idempotency_marks_pkey PRIMARY KEY (key, processed_on)
) PARTITION BY RANGE (processed_on);

DO $$
DECLARE
    today date := (now() AT TIME ZONE 'UTC')::date;
BEGIN
    IF NOT EXISTS (SELECT 1 FROM user_activity.consumer_idempotency_marks_upto_migration) THEN
        DROP TABLE user_activity.consumer_idempotency_marks_upto_migration;  -- a new database
        RETURN;
    END IF;
    -- Every existing mark counts as made today (a constant default: no table rewrite).
    EXECUTE format('ALTER TABLE user_activity.consumer_idempotency_marks_upto_migration'
                   ' ADD COLUMN processed_on date NOT NULL DEFAULT %L', today);
    ALTER TABLE user_activity.consumer_idempotency_marks_upto_migration
        ALTER COLUMN processed_on DROP DEFAULT;
    ALTER TABLE user_activity.consumer_idempotency_marks_upto_migration
        DROP CONSTRAINT consumer_idempotency_marks_upto_migration_key,
        ADD CONSTRAINT consumer_idempotency_marks_upto_migration_pkey
            PRIMARY KEY (key, processed_on);
    EXECUTE format('ALTER TABLE user_activity.consumer_idempotency_marks ATTACH PARTITION'
                   ' user_activity.consumer_idempotency_marks_upto_migration'
                   ' FOR VALUES FROM (MINVALUE) TO (%L)', today + 1);
    EXECUTE format('ALTER TABLE user_activity.consumer_idempotency_marks_upto_migration'
                   ' RENAME TO %I', 'consumer_idempotency_marks_p' || to_char(today, 'YYYYMMDD'));
END
$$;
CREATE TABLE user_activity.consumer_idempotency_marks_default
    PARTITION OF user_activity.consumer_idempotency_marks DEFAULT;

-- 2. Outbox ------------------------------------------------------------------------------------
ALTER TABLE user_activity.outbox RENAME TO outbox_upto_migration;

CREATE TABLE user_activity.outbox (
    id         uuid        NOT NULL,  -- the event's MessageId (stable across re-publication)
    topic      text        NOT NULL,
    key        bytea       NULL,
    value      bytea       NOT NULL,
    headers    jsonb       NOT NULL DEFAULT '{}'::jsonb,
    created_at timestamptz NOT NULL DEFAULT now(),
    txid       xid8        NOT NULL DEFAULT pg_current_xact_id()  -- the writing transaction
) PARTITION BY RANGE (created_at);
-- The publisher reads windows of transactions in (txid, id) order; the only index.
CREATE INDEX ix_outbox_txid ON user_activity.outbox (txid, id);
CREATE TABLE user_activity.outbox_default PARTITION OF user_activity.outbox DEFAULT;

-- Rows the broker refused for good (issue 12), kept aside with their error; an operator
-- requeues them (requeued_at), the publisher then sends them and sets published_at.
CREATE TABLE user_activity.outbox_parked (
    id           uuid        PRIMARY KEY,
    topic        text        NOT NULL,
    key          bytea       NULL,
    value        bytea       NOT NULL,
    headers      jsonb       NOT NULL DEFAULT '{}'::jsonb,
    created_at   timestamptz NOT NULL,
    attempts     integer     NOT NULL,
    last_error   text        NOT NULL,
    parked_at    timestamptz NOT NULL DEFAULT now(),
    requeued_at  timestamptz NULL,
    published_at timestamptz NULL,
    CONSTRAINT chk_outbox_parked_attempts CHECK (attempts > 0),
    CONSTRAINT chk_outbox_parked_state CHECK (requeued_at IS NULL OR published_at IS NULL)
);
CREATE INDEX ix_outbox_parked_requeued
    ON user_activity.outbox_parked (requeued_at) WHERE requeued_at IS NOT NULL;

-- The publication watermark: one row. Every committed outbox row whose txid is visible in
-- `delivered` was acknowledged by the broker (or parked). `target`/`after_*`: the window in
-- progress (delivered up to and including the row (after_txid, after_id) of the window that
-- ends at `target`), so a restart resumes it instead of sending it again from the start.
CREATE TABLE user_activity.outbox_watermark (
    id         smallint    PRIMARY KEY DEFAULT 1,
    delivered  pg_snapshot NOT NULL,
    target     pg_snapshot NULL,
    after_txid xid8        NULL,
    after_id   uuid        NULL,
    generation bigint      NOT NULL DEFAULT 0,
    updated_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT chk_outbox_watermark_one_row CHECK (id = 1),
    CONSTRAINT chk_outbox_watermark_cursor CHECK ((after_txid IS NULL) = (after_id IS NULL)
                                                 AND (target IS NOT NULL OR after_id IS NULL))
);
-- Nothing delivered yet: the first window is every committed row (the copied ones below).
INSERT INTO user_activity.outbox_watermark (delivered) VALUES ('3:3:');

-- Committed rows not yet published: after the watermark, or parked and requeued. (A parked row
-- is behind the watermark: the publisher parks it and moves past it in one transaction.)
CREATE VIEW user_activity.outbox_unpublished AS
SELECT o.id, o.topic, o.created_at, o.txid
  FROM user_activity.outbox o, user_activity.outbox_watermark w
 WHERE (o.txid >= pg_snapshot_xmax(w.delivered)
        OR o.txid = ANY (ARRAY(SELECT pg_snapshot_xip(w.delivered))))
   AND NOT pg_visible_in_snapshot(o.txid, w.delivered)
UNION ALL
SELECT p.id, p.topic, p.created_at, NULL
  FROM user_activity.outbox_parked p
 WHERE p.requeued_at IS NOT NULL;

-- Daily partitions of both tables for [first_day, last_day] (UTC days), those missing only.
-- A day already covered (the marks partition of the migration day covers all days before it)
-- or one whose rows went to the DEFAULT partition is skipped. Returns how many were created.
CREATE FUNCTION user_activity.ensure_daily_partitions(first_day date, last_day date)
RETURNS integer LANGUAGE plpgsql AS $$
DECLARE
    day     date;
    created integer := 0;
    marks   text;
    outbox  text;
BEGIN
    FOR day IN SELECT generate_series(first_day, last_day, interval '1 day')::date LOOP
        marks := 'consumer_idempotency_marks_p' || to_char(day, 'YYYYMMDD');
        outbox := 'outbox_p' || to_char(day, 'YYYYMMDD');
        IF to_regclass('user_activity.' || marks) IS NULL THEN
            BEGIN
                EXECUTE format('CREATE TABLE user_activity.%I PARTITION OF'
                               ' user_activity.consumer_idempotency_marks'
                               ' FOR VALUES FROM (%L) TO (%L)', marks, day, day + 1);
                created := created + 1;
            EXCEPTION WHEN invalid_object_definition OR check_violation THEN
                NULL;  -- covered by another partition, or rows of that day in DEFAULT
            END;
        END IF;
        IF to_regclass('user_activity.' || outbox) IS NULL THEN
            BEGIN
                EXECUTE format('CREATE TABLE user_activity.%I PARTITION OF user_activity.outbox'
                               ' FOR VALUES FROM (%L) TO (%L)', outbox,
                               day::text || ' 00:00:00+00', (day + 1)::text || ' 00:00:00+00');
                created := created + 1;
            EXCEPTION WHEN invalid_object_definition OR check_violation THEN
                NULL;
            END;
        END IF;
    END LOOP;
    RETURN created;
END
$$;

DO $$
BEGIN
    PERFORM user_activity.ensure_daily_partitions(
        (now() AT TIME ZONE 'UTC')::date - 1, (now() AT TIME ZONE 'UTC')::date + 3);
END
$$;

INSERT INTO user_activity.outbox (id, topic, key, value, headers, created_at)
SELECT id, topic, key, value, headers, created_at
  FROM user_activity.outbox_upto_migration
 WHERE published_at IS NULL AND parked_at IS NULL;
INSERT INTO user_activity.outbox_parked
       (id, topic, key, value, headers, created_at, attempts, last_error, parked_at)
SELECT id, topic, key, value, headers, created_at, attempts, last_error, parked_at
  FROM user_activity.outbox_upto_migration
 WHERE parked_at IS NOT NULL;
DROP TABLE user_activity.outbox_upto_migration;
