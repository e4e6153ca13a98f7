-- Held rows parked since (refused for good): no longer held.
DELETE FROM user_activity.outbox_held WHERE id = ANY(%s)
