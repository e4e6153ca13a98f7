-- Ends this process's former session (given up: its connection broke or timed out) if it still
-- holds the lease, waiting up to 5 s for it to end. True: it held the lease and has ended.
SELECT pg_terminate_backend(l.pid, 5000)
  FROM pg_locks l
  JOIN pg_stat_activity a ON a.pid = l.pid
 WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
   AND l.classid = (%(key)s::bigint >> 32)::oid
   AND l.objid = (%(key)s::bigint & 4294967295)::oid
   AND l.pid = %(pid)s AND a.backend_start = %(started)s
