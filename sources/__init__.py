"""I/O adapters that read: the Kafka input of the dataflows."""
