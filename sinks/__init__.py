"""I/O adapters that write: the transactional PostgreSQL sinks, the outbox publisher, the DLQ."""
