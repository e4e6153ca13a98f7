-- Expired marks that landed in the DEFAULT partition (a day that had no partition), a chunk.
DELETE FROM user_activity.consumer_idempotency_marks_default
 WHERE ctid = ANY (ARRAY(SELECT ctid FROM user_activity.consumer_idempotency_marks_default
                          WHERE processed_on < %s LIMIT %s))
