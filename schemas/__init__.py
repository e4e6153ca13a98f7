"""Contracts of every message the service reads or writes, as pydantic models.

Pure data: nothing here imports Kafka, PostgreSQL or Bytewax. Field names on the wire are
PascalCase (the producers are .NET services); unknown fields are ignored (minor versions are
additive-only).
"""
