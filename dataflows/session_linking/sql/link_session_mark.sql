-- The consumer idempotency mark of one sign-in ('user-activity-signed-in:{MessageId}'), written
-- in the linking transaction. Returns a row only when the mark is new. A racing writer of the same
-- mark waits for the first transaction to end, then gets no row: the sign-in was processed once.
-- The marks are partitioned by day (migration 0006) and the mark is a sign-in's only dedup, so a
-- mark of an earlier day (within the retention) counts too.
INSERT INTO user_activity.consumer_idempotency_marks (key)
SELECT %(key)s::text
 WHERE NOT EXISTS (SELECT 1 FROM user_activity.consumer_idempotency_marks WHERE key = %(key)s::text)
ON CONFLICT (key, processed_on) DO NOTHING
RETURNING key
