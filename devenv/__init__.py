"""Local development services: a real Kafka broker and a throwaway PostgreSQL cluster."""
