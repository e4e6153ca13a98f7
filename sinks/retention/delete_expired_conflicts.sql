-- Late-conflict records older than the retention (one per late sign-in), a chunk.
DELETE FROM user_activity.sign_in_conflicts
 WHERE message_id = ANY (ARRAY(SELECT message_id FROM user_activity.sign_in_conflicts
                                WHERE detected_at < %s LIMIT %s))
