-- The topics that have rows held back.
SELECT DISTINCT topic FROM user_activity.outbox_held
