"""The composition root: ``python -m bytewax.run dataflows.<flow>:flow`` starts a job here.

Asking a flow package for ``flow`` reads the settings (a bad one: exit 2), checks the recovery
store (exit 74 or 78), makes the job's one :class:`~runtime.process.Process` and starts every
process service. Threads besides Bytewax's: ``http``, ``outbox-publisher``, ``housekeeping``,
``stop-deadline`` and, with ``OTEL_*`` set, the span exporter's. At exit the publisher drains;
the run ends with exit 75 when a restart was asked for or a stop left work undone.
"""

from __future__ import annotations

import atexit
import importlib
import os
import sys
import threading
from types import ModuleType
from typing import Any

from bytewax.dataflow import Dataflow


def flow_attribute(flow_module: str, name: str) -> Any:
    """``build_flow`` from ``flow_module``, or the job's ``flow`` (:func:`start_job`)."""
    if name not in ("build_flow", "flow"):
        raise AttributeError(name)
    module = importlib.import_module(flow_module)
    if name == "build_flow":
        return module.build_flow
    return start_job(module, flow_module.split(".")[1])


def start_job(module: ModuleType, flow_id: str) -> Dataflow:
    """Start the process services of the job running ``module``'s flow; return the flow."""
    from runtime import memory, tracing
    from runtime.bytewax_0_21 import recovery
    from runtime.bytewax_0_21.clock import ClockCheck
    from runtime.bytewax_0_21.cluster_stop import ClusterStop
    from runtime.configuration import load_settings
    from runtime.health import Health, serve_http
    from runtime.housekeeping import Housekeeping
    from runtime.logs import configure_logging
    from runtime.process import Process
    from runtime.shutdown import Shutdown, abandon, install_signal_handlers
    from sinks.outbox import OutboxPublisher, OutboxWatchdog
    from sinks.outbox.stability import STABLE_OFFSETS_INTERVAL, StableOffsets
    from sinks.retention import maintenance_task

    settings = load_settings()
    configure_logging(settings.log_level)
    options = recovery.run_options(sys.argv, os.environ)
    if options.recovery_dir is not None:
        recovery.require_room(options.recovery_dir, settings.recovery_min_free_bytes)
        recovery.watch(options.recovery_dir, settings.recovery_min_free_bytes)
    if not recovery.check_at_start(options, flow_id, tail=settings.tail):
        raise SystemExit(recovery.RECOVERY_REFUSED)
    process = Process(Health(), Shutdown(), options.recovery_dir)
    process.stopping.grace = settings.stop_grace_seconds
    handled = install_signal_handlers(process.stopping)  # before /readyz answers
    try:
        serve_http(settings.http_host, settings.http_port, process.health)
    except OSError as exc:  # a port in use, a host it cannot bind: one line, not a traceback
        print(f"user-activity: cannot serve /metrics, /livez and /readyz on"
              f" {settings.http_host}:{settings.http_port} (USER_ACTIVITY_HTTP_HOST,"
              f" USER_ACTIVITY_HTTP_PORT): {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    tracing.configure_from_env(settings.consumer_group_favorites if flow_id == "favorite_actions"
                               else settings.consumer_group_session_linking)
    publisher = OutboxPublisher(settings, process=process) if settings.outbox_enabled else None

    housekeeping = Housekeeping()
    housekeeping.every(1.0, "wall-clock", ClockCheck(abandon).check)
    if handled:
        stop = ClusterStop(settings.database_dsn(), flow_id, process.stopping,
                           tcp_options=settings.database_tcp_options())
        housekeeping.every(1.0, "cluster-stop", stop.check)
    housekeeping.every(settings.malloc_trim_interval_seconds, "malloc-trim", memory.trim_heap)
    housekeeping.every(settings.gc_full_collect_interval_seconds, "gc", memory.collect_full)
    if publisher is not None:
        watchdog = OutboxWatchdog(settings, process=process)
        housekeeping.every(watchdog.interval, "outbox-watchdog", watchdog.measure)
        stable = StableOffsets(settings.kafka_client_config(),
                               [*settings.outbox_topics(), settings.topic_outbox_progress])
        housekeeping.every(STABLE_OFFSETS_INTERVAL, "outbox-stable-offsets", stable.measure)
        housekeeping.every(min(60.0, settings.maintenance_interval_seconds), "maintenance",
                           maintenance_task(settings))  # not at all when the interval is 0

    flow: Dataflow = module.build_flow(settings, process=process, publisher=publisher)
    memory.tune_gc(settings.gc_young_threshold)
    publishing = threading.Event()  # set: the publisher's loop returns
    loop = threading.Thread(target=publisher.run, args=(publishing,), name="outbox-publisher",
                            daemon=True) if publisher is not None else None
    if loop is not None:
        loop.start()
    housekeeping.start()

    def finish() -> None:
        housekeeping.stop(process.stopping.time_left(5.0))
        if publisher is not None and loop is not None:
            publishing.set()
            loop.join(process.stopping.time_left(30.0))
            publisher.close()  # the last drain (unless the loop still runs), then the lease
        tracing.shutdown(process.stopping.time_left(tracing.SHUTDOWN_FLUSH_SECONDS))
        process.stopping.finish()

    atexit.register(finish)
    return flow

