"""Sink step ids that carry the partition count (Bytewax panics on a partition it no longer lists).

Our sink snapshots hold no state, so each partition count is a step of its own and a changed
count starts clean.
"""

from __future__ import annotations


def sink_step_id(base: str, partitions: int) -> str:
    """The step id of a partitioned sink: ``{base}_{partitions}_partitions``."""
    return f"{base}_{partitions}_partitions"
