"""The lazy module attributes every flow package exposes to ``python -m bytewax.run``."""

from __future__ import annotations

import importlib
from typing import Any


def flow_attribute(wiring_module: str, name: str) -> Any:
    """``build_flow`` from ``wiring_module``, or ``flow`` built from the environment.

    Building ``flow`` (the job's entry point) also tunes the garbage collector for the
    process (:mod:`runtime.gc_tuning`) and makes SIGTERM and Ctrl-C a clean stop
    (:mod:`runtime.shutdown`) of the whole cluster (:mod:`runtime.cluster_stop`).

    Called from a package's ``__getattr__``: importing the package (or its pure step modules)
    has no side effects; the flow, its settings and JSON logging exist only once asked for.
    """
    wiring = importlib.import_module(wiring_module)
    if name == "build_flow":
        return wiring.build_flow
    if name == "flow":
        from runtime.cluster_stop import ClusterStop
        from runtime.gc_tuning import tune_gc
        from runtime.logs import configure_logging
        from runtime.settings import Settings
        from runtime.shutdown import install_signal_handlers

        settings = Settings()
        configure_logging(settings.log_level)
        flow = wiring.build_flow(settings)
        tune_gc(settings.gc_young_threshold, settings.gc_full_collect_interval_seconds)
        if install_signal_handlers():
            ClusterStop(settings.database_dsn(), flow.flow_id).start()
        return flow
    raise AttributeError(name)
