-- The consumer idempotency mark of one sign-in ('user-activity-signed-in:{MessageId}'), written
-- in the linking transaction. Returns a row only when the mark is new. A racing writer of the same
-- mark waits for the first transaction to end, then gets no row: the sign-in was processed once.
INSERT INTO user_activity.consumer_idempotency_marks (key)
VALUES (%(key)s)
ON CONFLICT (key) DO NOTHING
RETURNING key
