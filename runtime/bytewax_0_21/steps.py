"""Sink step ids that carry the partition count (Bytewax panics on a partition it no longer lists).

Bytewax keeps a snapshot per sink partition and, on resume, panics on one its step no longer
lists ("Key StateKey("1") is not in this worker's routing map"). Our sink snapshots hold no
state (a barrier only), so each partition count is a step of its own and a changed count
starts clean.
"""

from __future__ import annotations


def sink_step_id(base: str, partitions: int) -> str:
    """The step id of a partitioned sink: ``{base}_{partitions}_partitions``."""
    return f"{base}_{partitions}_partitions"
