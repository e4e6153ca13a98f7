"""What Bytewax 0.21.1 makes us work around, in one room a later engine can delete.

Each module covers one gap of the engine: a recovery store it cannot check (:mod:`.recovery`),
a cluster it ends only when every input ended (:mod:`.cluster_stop`), timers in wall time
(:mod:`.clock`), sink partitions it cannot resume when their count changes (:mod:`.steps`).
"""
