"""Process CPU per event of the real favorites flow in one process (issue 16's measurement).

``python bench/job_cpu.py DATABASE_URL EVENTS [ROUNDS]`` (``PYTHONPATH=.``; a migrated database):
the real ``build_flow`` on Bytewax's ``TestingSource`` (prepared Kafka records from
``bench.workload``, batches of 1,000) into the real ``ActionHistorySink`` on that PostgreSQL,
the DLQ into a ``TestingSink``, the outbox off; JSON logs to a file. Prints the process CPU
(``getrusage``, all threads) per event of each ``run_main``. ``NODEDUP=1`` replaces the dedup
step by a pass-through (what the step costs). Run it from two worktrees, interleaved, for an A/B.
Removed after use; see docs/performance.md, "Job CPU per event".
"""

from __future__ import annotations

import gc
import os
import random
import resource
import sys
import time
from typing import Any


def main() -> None:
    """Run the rounds and print CPU µs per event."""
    url, n = sys.argv[1], int(sys.argv[2])
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    fd = os.open("/tmp/job_cpu.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)  # noqa: S108
    os.dup2(fd, 2)
    from runtime.logs import configure_logging

    configure_logging("INFO")
    import psycopg
    from bytewax.testing import TestingSink, TestingSource, run_main

    import dataflows.favorite_actions.flow as flow_module
    from bench.workload import EnvelopeFactory, make_backlog, make_sessions
    from dataflows.favorite_actions.sink import ActionHistorySink
    from devenv.harness.sessions import seed_sessions
    from runtime.gc_tuning import tune_gc
    from runtime.settings import Settings
    from schemas.kafka_record import SourceRecord

    if os.environ.get("NODEDUP"):
        flow_module.deduplicated = lambda step_id, keyed, ttl, cb: keyed  # type: ignore[assignment]
    rng = random.Random(11)
    sessions = make_sessions(20_000, rng)
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM user_activity.sessions").fetchone()
        if row is not None and row[0] == 0:
            seed_sessions(conn, sessions)
    settings = Settings(kafka_bootstrap_servers="127.0.0.1:1", database_url=url,
                        topic_favorite_added="fa", topic_favorite_removed="fr",
                        topic_action_tracked="at", outbox_enabled=False, http_port=0)
    factory = EnvelopeFactory(sessions, rng, "fa", "fr")
    tune_gc(settings.gc_young_threshold, settings.gc_full_collect_interval_seconds)
    per_event: list[float] = []
    for round_ in range(rounds):
        backlog = make_backlog(factory, n, rng)
        records = [SourceRecord(r.topic, i % 6, i, r.key, r.value, r.headers, time.monotonic())
                   for i, r in enumerate(backlog.records)]
        letters: list[Any] = []
        flow = flow_module.build_flow(
            settings, source=TestingSource(records, batch_size=1000),
            sinks=flow_module.FavoritesSinks(ActionHistorySink(settings), TestingSink(letters)))
        gc.collect()
        before = resource.getrusage(resource.RUSAGE_SELF)
        run_main(flow)
        after = resource.getrusage(resource.RUSAGE_SELF)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        per_event.append(cpu / n * 1e6)
        print(f"round {round_}: {per_event[-1]:.1f} µs of CPU per event", flush=True)
    print(f"best {min(per_event):.1f} median {sorted(per_event)[len(per_event) // 2]:.1f}")


if __name__ == "__main__":
    main()
