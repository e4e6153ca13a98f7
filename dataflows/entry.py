"""The lazy module attributes every flow package exposes to ``python -m bytewax.run``.

``flow`` is the job's entry point, so the process services start here, never in ``build_flow``
(which stays free of side effects, so tests run the real flow on Bytewax's testing source and
sink): the settings (a bad one is one line and exit code 2), JSON logging, the health/metrics
server, the malloc trimmer, tracing (``OTEL_*``, :mod:`runtime.tracing`), garbage-collector
tuning, SIGTERM / Ctrl-C as a clean stop of the whole cluster, and the recovery volume's watch
(:mod:`runtime.recovery_volume`: a start on a full volume is one line and exit code 74), and
the recovery store's check and lock (:mod:`runtime.recovery_store`: a missing, foreign or shared
store is one line and exit code 78; a tailing job without one, one WARNING), and the wall
clock's watch (:mod:`runtime.clock_watch`: a step back of more than 30 s is exit code 75).
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any


def flow_attribute(flow_module: str, name: str) -> Any:
    """``build_flow`` from ``flow_module``, or ``flow`` built from the environment.

    Called from a package's ``__getattr__``: importing the package (or its pure step modules)
    has no side effects; the flow, its settings and JSON logging exist only once asked for.
    """
    module = importlib.import_module(flow_module)
    if name == "build_flow":
        return module.build_flow
    if name == "flow":
        from runtime import recovery_store, recovery_volume
        from runtime.clock_watch import ClockWatch
        from runtime.cluster_stop import ClusterStop
        from runtime.configuration import load_settings
        from runtime.gc_tuning import tune_gc
        from runtime.health import serve_http
        from runtime.logs import configure_logging
        from runtime.memory import start_trimmer
        from runtime.shutdown import install_signal_handlers
        from runtime.tracing import configure_from_env

        settings = load_settings()
        configure_logging(settings.log_level)
        # Before Bytewax opens its SQLite store: on a full volume it panicked (exit code 1).
        options = recovery_store.run_options(sys.argv, os.environ)
        if options.recovery_dir is not None:
            recovery_volume.require_room(options.recovery_dir, settings.recovery_min_free_bytes)
            recovery_volume.watch(options.recovery_dir, settings.recovery_min_free_bytes)
        # Before Bytewax opens it: a missing, foreign or shared store (recovery_store's list).
        if not recovery_store.check_at_start(options, _flow_id(flow_module), tail=settings.tail):
            raise SystemExit(recovery_store.RECOVERY_REFUSED)
        # Before /readyz answers: a SIGTERM from then on is a clean stop (the inputs end at
        # their first poll), never the default kill (exit -15) of a process still starting.
        handled = install_signal_handlers(settings.stop_grace_seconds)
        try:
            serve_http(settings.http_host, settings.http_port)
        except OSError as exc:  # a port in use, a host it cannot bind: one line, not a traceback
            print(f"user-activity: cannot serve /metrics, /livez and /readyz on"
                  f" {settings.http_host}:{settings.http_port} (USER_ACTIVITY_HTTP_HOST,"
                  f" USER_ACTIVITY_HTTP_PORT): {exc}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None
        start_trimmer(settings.malloc_trim_interval_seconds)
        ClockWatch().start()  # a long step back of the wall clock: exit 75, to start again
        configure_from_env(_consumer_group(settings, flow_module))
        flow = module.build_flow(settings)
        tune_gc(settings.gc_young_threshold, settings.gc_full_collect_interval_seconds)
        if handled:  # a stop requested meanwhile is announced at its first check
            ClusterStop(settings.database_dsn(), flow.flow_id,
                        tcp_options=settings.database_tcp_options()).start()
        return flow
    raise AttributeError(name)


def _flow_id(flow_module: str) -> str:
    """The flow's Bytewax id, the prefix of its step ids in a recovery store.

    Its package: ``dataflows.favorite_actions.flow`` -> ``favorite_actions``.
    """
    return flow_module.split(".")[1]


def _consumer_group(settings: Any, flow_module: str) -> str:
    """The consumer group the flow's lag is reported under (a span attribute)."""
    if "session_linking" in flow_module:
        return str(settings.consumer_group_session_linking)
    return str(settings.consumer_group_favorites)
