-- A stop asked of one process of a Bytewax cluster reaches all of them (issue 12). Forward-only.
--
-- A Bytewax cluster ends cleanly only when every input of every process ends: a pod that gets
-- SIGTERM alone would wait for its peers until it is SIGKILLed, and its peers would then crash.
-- So the process that gets the signal records it here, and every process of the flow that
-- started before requested_at stops too (runtime/cluster_stop.py); processes started later
-- (the restarted pods) are not affected. One row per flow: the latest request.
CREATE TABLE user_activity.stream_stops (
    flow         text        PRIMARY KEY,
    requested_at timestamptz NOT NULL,
    requested_by text        NOT NULL
);
