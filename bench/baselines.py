"""What the job is compared with: a naive consumer, the bare write path and a Quix Streams peer.

- :func:`run_naive`: one consumer, the job's own decode and ``FavoritesStore.record_batch`` with
  one message, one transaction per message, the action-tracked produced after the commit; no
  in-memory dedup. Time-bounded: the rate is extrapolated to the backlog.
- :func:`run_ceiling`: ``record_batch`` fed the backlog decoded up front (outside the timing), in
  batches of 1000 on one connection, as the sink calls it; no Kafka, no Bytewax.
- :func:`run_peer`: :mod:`bench.peer_app` in its own venv (``.venv-peer``, made on first use),
  until every expected row is in ``action_events`` and every output on its topic.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any
from urllib.parse import unquote, urlsplit

import psycopg
from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition

from bench.services import (
    CpuSampler,
    OutputCounter,
    Services,
    counts,
    cpu_seconds,
    cpu_us_per_event,
    rss_mb,
    wal_position,
)
from bench.workload import Backlog
from dataflows.favorite_actions.decode import FavoriteMessage, decode_favorite
from dataflows.favorite_actions.store import FavoritesStore
from devenv.harness.jobs import ROOT
from runtime.settings import Settings
from schemas.favorites import ActionType
from schemas.kafka_record import SourceRecord
from sinks.db import SESSION_OPTIONS  # the job's session settings (jit off)

QUIXSTREAMS = "quixstreams[postgresql]==3.28.1"


def _action_types(settings: Settings) -> dict[str, ActionType]:
    return {settings.topic_favorite_added: ActionType.ADD_TO_FAVORITES,
            settings.topic_favorite_removed: ActionType.REMOVE_FROM_FAVORITES}


def run_naive(settings: Settings, db_url: str, seconds: float, backlog_size: int) -> dict[str, Any]:
    """Consume the backlog one message at a time for at most ``seconds``; the measured rate."""
    action_types = _action_types(settings)
    consumer = Consumer({**settings.kafka_client_config(), "enable.auto.commit": True,
                         "group.id": f"bench-naive-{time.time_ns()}"})
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING)
                     for topic in action_types for p in range(settings.topic_partitions)])
    producer = Producer({**settings.kafka_client_config(), "acks": "all",
                         "enable.idempotence": True, "linger.ms": 5})
    delivered = [0]

    def on_delivery(err: Any, _msg: Any) -> None:
        delivered[0] += err is None

    store = FavoritesStore(settings.topic_action_tracked)
    found = dict.fromkeys(("processed", "recorded", "skipped", "no_session", "duplicate"), 0)
    conn = psycopg.connect(db_url, autocommit=True, options=SESSION_OPTIONS)
    try:
        start = time.monotonic()
        while found["processed"] < backlog_size and time.monotonic() < start + seconds:
            msg = consumer.poll(0.5)
            if msg is None or msg.error() is not None:
                continue
            found["processed"] += 1
            headers = tuple((str(h[0]), h[1]) for h in msg.headers() or []
                            if isinstance(h[1], bytes))
            decoded = decode_favorite(SourceRecord(
                msg.topic() or "", msg.partition() or 0, msg.offset() or 0, msg.key(),
                msg.value(), headers, time.monotonic()), action_types)
            if not isinstance(decoded, FavoriteMessage):
                found["skipped"] += 1
                continue
            outcome = store.record_batch(conn, [decoded])
            found["no_session"] += len(outcome.no_session)
            found["duplicate"] += len(outcome.duplicates)
            for action in outcome.recorded:
                found["recorded"] += 1
                out = action.outbox
                producer.produce(out.topic, out.value, out.key,
                                 headers=[(k, v.encode()) for k, v in out.headers.items()],
                                 on_delivery=on_delivery)
            producer.poll(0)
        elapsed = time.monotonic() - start
        producer.flush(30)
    finally:
        conn.close()
        consumer.close()
    rate = found["processed"] / elapsed if elapsed > 0 else 0.0
    return {**found, "action_tracked_delivered": delivered[0], "seconds": round(elapsed, 2),
            "events_per_s": round(rate, 1), "extrapolated": found["processed"] < backlog_size,
            "extrapolated_backlog_seconds": round(backlog_size / rate, 1) if rate else None}


def run_ceiling(backlog: Backlog, settings: Settings, db_url: str, services: Services, *,
                batch_size: int = 1000, max_seconds: float = 120.0) -> dict[str, Any]:
    """Feed the backlog's valid messages to ``record_batch``; the rate over what was fed."""
    action_types = _action_types(settings)
    t0, c0 = time.monotonic(), time.process_time()
    decoded = [decode_favorite(SourceRecord(r.topic, 0, offset, r.key, r.value, r.headers,
                                            time.monotonic()), action_types)
               for offset, r in enumerate(backlog.records)]
    messages = [m for m in decoded if isinstance(m, FavoriteMessage)]
    wall, cpu = time.monotonic() - t0, time.process_time() - c0
    store = FavoritesStore(settings.topic_action_tracked)
    recorded = duplicates = no_session = fed = 0
    with psycopg.connect(db_url, autocommit=True, options=SESSION_OPTIONS) as conn:
        wal0 = wal_position(db_url)[0]
        sampler = CpuSampler(services)
        start = time.monotonic()
        for i in range(0, len(messages), batch_size):
            outcome = store.record_batch(conn, messages[i:i + batch_size])
            fed += len(messages[i:i + batch_size])
            recorded += len(outcome.recorded)
            duplicates += len(outcome.duplicates)
            no_session += len(outcome.no_session)
            if time.monotonic() - start > max_seconds:
                break
        elapsed = time.monotonic() - start
        resources = sampler.stop()
        wal = wal_position(db_url)[0] - wal0
    return {"messages_fed": fed, "recorded": recorded, "duplicates": duplicates,
            "no_session": no_session, "batch_size": batch_size, "seconds": round(elapsed, 2),
            "events_per_s": round(fed / elapsed, 1) if elapsed else None,
            "recorded_per_s": round(recorded / elapsed, 1) if elapsed else None,
            "wal_bytes_per_recorded_event": round(wal / recorded) if recorded else None,
            "resources": resources,
            "decode_outside_timing": {
                "decode_favorite_per_s_wall": round(len(decoded) / wall, 1) if wall else None,
                "decode_favorite_per_cpu_s": round(len(decoded) / cpu, 1) if cpu else None}}


def run_peer(services: Services, input_settings: Settings, backlog: Backlog, db_url: str, *,
             prefill_rows: int, timeout: float, dedup_ttl_s: float) -> dict[str, Any]:
    """Run the Quix Streams app on the backlog until every row and output is there."""
    venv = ROOT / ".venv-peer"
    python, marker = venv / "bin" / "python", venv / f".installed-{QUIXSTREAMS}"
    if not marker.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", QUIXSTREAMS], check=True,
                       stdout=subprocess.DEVNULL)
        marker.touch()
    url, settings = urlsplit(db_url), services.settings("peer", db_url)
    env = {**os.environ, "PEER_BOOTSTRAP": services.bootstrap,
           "PEER_GROUP": f"bench-peer-{services.run_id}",
           "PEER_STATE_DIR": str(services.run_dir / "peer-state"),
           "PEER_ADDED_TOPIC": input_settings.topic_favorite_added,
           "PEER_REMOVED_TOPIC": input_settings.topic_favorite_removed,
           "PEER_OUTPUT_TOPIC": settings.topic_action_tracked,
           "PEER_DEDUP_TTL_SECONDS": str(dedup_ttl_s), "PEER_PG_HOST": url.hostname or "127.0.0.1",
           "PEER_PG_PORT": str(url.port or 5432), "PEER_PG_DBNAME": unquote(url.path.lstrip("/")),
           "PEER_PG_USER": unquote(url.username or "postgres"),
           "PEER_PG_PASSWORD": unquote(url.password or "")}
    expected = backlog.expected_recorded
    counter = OutputCounter(services.bootstrap, settings.topic_action_tracked)
    log_path = services.run_dir / "peer.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen([str(python), str(ROOT / "bench" / "peer_app.py")], env=env,
                                stdout=log, stderr=subprocess.STDOUT, cwd=services.run_dir)
    started = time.monotonic()
    sampler = CpuSampler(services, lambda: cpu_seconds(proc.pid), lambda: rss_mb(proc.pid))
    rows, failure = 0, None
    while (rows := counts(db_url)["action_events"] - prefill_rows) < expected or (
            counter.count < expected):
        if proc.poll() is not None:
            failure = f"the peer exited ({proc.returncode}) with {rows}/{expected} rows"
            break
        if time.monotonic() - started > timeout:
            failure = f"timeout after {timeout:.0f}s: {rows}/{expected} rows"
            break
        time.sleep(0.2)
    wall = time.monotonic() - started
    resources = sampler.stop()
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
    counter.close()
    total = len(backlog.records)
    result: dict[str, Any] = {
        "app": QUIXSTREAMS, "messages": total, "expected_recorded": expected,
        "rows_committed": rows, "outputs_on_topic": counter.count, "wall_s": round(wall, 2),
        "events_per_s": round(total / wall, 1) if not failure else None,
        "cpu_us_per_event": cpu_us_per_event(resources, total), "resources": resources,
        "ok": failure is None and rows == expected}
    if not result["ok"]:
        result["failure"] = failure or f"{rows} rows, {expected} expected"
        result["log_tail"] = log_path.read_text(errors="replace")[-3000:]
    return result
