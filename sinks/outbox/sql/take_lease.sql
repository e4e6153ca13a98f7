-- The lease, on a primary only. A snapshot taken on a hot standby lists no transaction in
-- progress (PostgreSQL keeps them as subtransactions there), so a window taken there and recorded
-- after a promotion would pass the rows of transactions still running at the time.
SELECT CASE WHEN NOT pg_is_in_recovery() THEN pg_try_advisory_lock(%s) END
