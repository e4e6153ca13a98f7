-- The partitions of a partitioned table (by its regclass name).
SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
 WHERE i.inhparent = %s::regclass ORDER BY c.relname
