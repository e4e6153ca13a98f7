"""What Bytewax 0.21.1 makes us work around, in one room a later engine can delete.

Bytewax has had no release since 0.21.1 (its company wound down in 2025). Each module here
covers one gap of that engine, named in its first line: a recovery store it cannot check
(:mod:`.recovery`), a cluster it ends cleanly only when every input ended (:mod:`.cluster_stop`),
timers kept in wall time (:mod:`.clock`), sink partitions it cannot resume when their count
changes (:mod:`.steps`). The composition root (:mod:`dataflows.entry`) wires them.
"""
