-- The daily partitions of both tables for [first, last], those missing (migration 0006).
SELECT user_activity.ensure_daily_partitions(%s, %s)
