-- Parked rows requeued and published longer ago than the retention.
DELETE FROM user_activity.outbox_parked WHERE published_at < %s
