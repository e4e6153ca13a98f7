-- Rows held back per topic (issue 43): a topic the broker refuses for a reason of its own (not
-- authorized, the topic missing) holds back only its own rows. Forward-only.
--
-- The publisher moves such a row here in the transaction that moves the watermark past it, and
-- every later row of that topic too while the topic has rows here, so a topic's rows keep their
-- order. They are sent per topic in `seq` order, retried with back-off, and deleted once the
-- broker acknowledged them. A parked row that an operator requeues is copied here (its
-- outbox_parked row gets requeued_at, then published_at once sent).
CREATE TABLE user_activity.outbox_held (
    seq        bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    id         uuid        NOT NULL UNIQUE,  -- the event's MessageId
    topic      text        NOT NULL,
    key        bytea       NULL,
    value      bytea       NOT NULL,         -- rendered (a thin action-tracked row's too)
    headers    jsonb       NOT NULL DEFAULT '{}'::jsonb,
    created_at timestamptz NOT NULL,
    held_at    timestamptz NOT NULL DEFAULT now(),
    last_error text        NOT NULL
);
CREATE INDEX ix_outbox_held_topic ON user_activity.outbox_held (topic, seq);

-- Rows requeued and not yet published are now sent from here.
INSERT INTO user_activity.outbox_held (id, topic, key, value, headers, created_at, held_at,
                                       last_error)
SELECT id, topic, key, value, headers, created_at, requeued_at, last_error
  FROM user_activity.outbox_parked WHERE requeued_at IS NOT NULL ORDER BY requeued_at;

-- Committed rows not yet published: after the watermark, or held (requeued ones included).
CREATE OR REPLACE VIEW user_activity.outbox_unpublished AS
SELECT o.id, o.topic, o.created_at, o.txid
  FROM user_activity.outbox o, user_activity.outbox_watermark w
 WHERE (o.txid >= pg_snapshot_xmax(w.delivered)
        OR o.txid = ANY (ARRAY(SELECT pg_snapshot_xip(w.delivered))))
   AND NOT pg_visible_in_snapshot(o.txid, w.delivered)
UNION ALL
SELECT h.id, h.topic, h.created_at, NULL
  FROM user_activity.outbox_held h;
