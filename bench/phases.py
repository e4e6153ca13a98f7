"""The measured phases of a benchmark run (each returns a JSON-able dict)."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
import psycopg

from bench.ceiling import wal_lsn
from bench.jobproc import CpuSampler, JobProcess, OutputCounter, read_topic
from bench.services import Services
from bench.workload import (
    Backlog,
    EnvelopeFactory,
    OutRecord,
    make_backlog,
    produce_all,
    producer,
    uuid4_from,
)
from devenv.harness.jobs import ROOT
from devenv.harness.metrics import metric_sum
from devenv.harness.sessions import Session
from runtime.settings import Settings

Log = Callable[[str], None]
RECORDED = "user_activity_favorites_recorded_total"
SKIPPED = "user_activity_favorites_skipped_total"


def _db_counts(db_url: str) -> dict[str, int]:
    with psycopg.connect(db_url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT (SELECT count(*) FROM user_activity.action_events),"
            " (SELECT count(*) FROM user_activity.outbox),"
            " (SELECT count(*) FROM user_activity.outbox_unpublished)"
        ).fetchone()
    assert row is not None
    return {"action_events": int(row[0]), "outbox": int(row[1]), "outbox_unpublished": int(row[2])}


def _wal(db_url: str) -> int:
    with psycopg.connect(db_url, autocommit=True) as conn:
        return wal_lsn(conn)


def _percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def job_backlog(
    services: Services, input_settings: Settings, backlog: Backlog, db_url: str, *,
    name: str, workers: int, prefill_rows: int, timeout: float, log: Log,
    profile_dir: Path | None = None, source_dir: Path | None = None,
    extra_env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Run the bounded job (``tail=False``) on the backlog until it is all processed.

    Done = every row committed and every action-tracked message on the output topic; the rate
    is over the wall time from spawning the process.
    """
    settings = services.settings(
        name, db_url,
        topic_favorite_added=input_settings.topic_favorite_added,
        topic_favorite_removed=input_settings.topic_favorite_removed,
    )
    expected = backlog.expected_recorded
    total = len(backlog.records)
    counter = OutputCounter(services.bootstrap, settings.topic_action_tracked)
    wal0 = _wal(db_url)
    gc_dir = services.run_dir / "gcprobe"
    gc_dir.mkdir(exist_ok=True)
    probe_env = {"PYTHONPATH": str(ROOT / "bench" / "gcprobe"), "GCPROBE_DIR": str(gc_dir)}
    job = JobProcess(settings, services.run_dir / f"{name}.log", workers=workers, tail=False,
                     source_dir=source_dir, extra_env={**probe_env, **(extra_env or {})})
    sampler = CpuSampler(job, services.postmaster_pid, services.kafka_pid)
    spawned = job.started
    t_http: float | None = None
    t_rows: float | None = None
    last_metrics: dict[str, float] | None = None
    spies: list[subprocess.Popen[bytes]] = []
    failure: str | None = None
    next_scrape = 0.0
    while True:
        now = time.monotonic()
        # /metrics costs the job CPU (rendering every series): scrape every 0.1 s only until it
        # answers (start-up time), then every 2 s. Every output is published after its row's
        # commit, so "all outputs arrived" implies "all rows committed" (verified below).
        if now >= next_scrape:
            metrics = job.scrape(timeout=1.0)
            if metrics is not None:
                last_metrics = metrics
                if t_http is None:
                    t_http = now
                    if profile_dir is not None:
                        spies = _start_py_spy(job.job_pid, profile_dir, name)
            next_scrape = now + (2.0 if t_http is not None else 0.1)
            recorded = metric_sum(last_metrics, RECORDED)
            if t_rows is None and recorded >= expected:
                t_rows = now
        job.hwm_mb()
        if counter.count >= expected:
            break
        if not job.running and job.exited_at is not None and now - job.exited_at > 15:
            failure = f"job exited ({job.returncode}) with {counter.count}/{expected} out"
            break
        if now - spawned > timeout:
            failure = f"timeout after {timeout:.0f}s: {counter.count}/{expected} out"
            break
        time.sleep(0.1)
    t_out = counter.last_at
    code = job.wait(60)
    if code is None:
        code = job.stop()
    cpu = sampler.stop()
    counter.close()
    for spy in spies:
        try:
            spy.wait(60)
        except subprocess.TimeoutExpired:
            spy.send_signal(signal.SIGINT)
            spy.wait(30)
    wal = _wal(db_url) - wal0
    counts = _db_counts(db_url)
    rows = counts["action_events"] - prefill_rows
    out_total, out_distinct = read_topic(
        services.bootstrap, settings.topic_action_tracked,
        lambda e: str(e["Payload"]["FavoriteId"]), expect=expected, timeout=30)
    t_done = t_out if counter.count >= expected else None
    wall = (t_done - spawned) if t_done is not None else None
    first = counter.first_at
    result: dict[str, Any] = {
        "workers": workers,
        "messages": total,
        "expected_recorded": expected,
        "rows_committed": rows,
        "outbox_unpublished_after": counts["outbox_unpublished"],
        "action_tracked_on_topic": out_total,
        "action_tracked_distinct": out_distinct,
        "skipped_duplicate": metric_sum(last_metrics, SKIPPED, reason="duplicate"),
        "skipped_invalid_owner": metric_sum(last_metrics, SKIPPED, reason="invalid-owner"),
        "skipped_no_session": metric_sum(last_metrics, SKIPPED, reason="no-session"),
        "exit_code": code,
        "startup_s": round(t_http - spawned, 2) if t_http else None,
        "first_output_s": round(first - spawned, 2) if first else None,
        "rows_done_seen_s": round(t_rows - spawned, 2) if t_rows else None,  # 2 s resolution
        "outputs_done_s": round(t_out - spawned, 2) if t_out else None,
        "wall_s": round(wall, 2) if wall else None,
        "events_per_s": round(total / wall, 1) if wall else None,
        "events_per_s_after_first_output": (
            round(total / (t_done - first), 1) if t_done and first and t_done > first else None),
        "wal_bytes_per_recorded_event": round(wal / rows) if rows > 0 else None,
        "job_peak_rss_mb": round(job.hwm_mb() or 0.0, 1),  # VmHWM, read every 0.1 s
        "gc": _gc_probe(gc_dir, job.job_pid),
        "resources": cpu,
        "ok": failure is None and rows == expected and out_distinct == expected,
    }
    if failure or not result["ok"]:
        result["failure"] = failure or "counts differ from expected"
        result["log_tail"] = job.log_tail()
    log(f"  {name}: {result['events_per_s']} ev/s, wall {result['wall_s']}s, rows {rows}/"
        f"{expected}, out {out_distinct}/{expected}, job {cpu.get('job_cores')} cores, "
        f"pg {cpu.get('postgres_cores')} cores")
    return result


def _gc_probe(directory: Path, pid: int) -> dict[str, Any] | None:
    """What ``bench/gcprobe`` wrote for the job ``pid`` at its exit (None if it did not exit)."""
    try:
        return dict(json.loads((directory / f"{pid}.json").read_text()))
    except (OSError, ValueError):
        return None


def compare_jobs(
    services: Services, input_settings: Settings, backlog: Backlog, *, ref: str, rounds: int,
    prefill_rows: int, timeout: float, log: Log, ref_env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The ``-w 1`` job of this tree against a reference, interleaved.

    The reference is the job at commit ``ref`` (this tree when empty) with ``ref_env`` added
    to its environment (a setting to A/B). ``rounds`` x (this tree, reference), alternating
    which goes first, each on its own copy of the template database and the same backlog: on
    a noisy machine only an interleaved A/B in one process separates a 10 % change from the
    noise. Reports each run and the ratio of medians.
    """
    checkout = Path(tempfile.mkdtemp(prefix="bench-ref-")) if ref else None
    if checkout is not None:
        subprocess.run(["git", "worktree", "add", "--detach", str(checkout), ref], cwd=ROOT,
                       check=True, capture_output=True)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", ref or "HEAD"], cwd=ROOT,
                                text=True, check=True, capture_output=True).stdout.strip()
        reference = {"ref": commit if ref else "this tree", "ref_env": ref_env or {}}
        rates: dict[str, list[float]] = {"head": [], "ref": []}
        for round_no in range(rounds):
            order = [("head", None), ("ref", checkout)]
            for label, source in order if round_no % 2 == 0 else order[::-1]:
                name = f"ab_{label}_{round_no}"
                db = services.create_database(name, template="tpl")
                run = job_backlog(services, input_settings, backlog, db, name=name, workers=1,
                                  prefill_rows=prefill_rows, timeout=timeout, log=log,
                                  source_dir=source,
                                  extra_env=ref_env if label == "ref" else None)
                services.drop_database(name)
                if not run["ok"]:
                    return {**reference, "failure": f"{name}: {run.get('failure')}"}
                rates[label].append(run["events_per_s"])
        head, base = statistics.median(rates["head"]), statistics.median(rates["ref"])
        return {**reference, "rounds": rounds, "events_per_s": rates, "median_head": head,
                "median_ref": base, "ratio_head_to_ref": round(head / base, 3)}
    finally:
        if checkout is not None:
            subprocess.run(["git", "worktree", "remove", "--force", str(checkout)], cwd=ROOT,
                           check=False, capture_output=True)


def _start_py_spy(pid: int, profile_dir: Path, name: str) -> list[subprocess.Popen[bytes]]:
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    profile_dir.mkdir(parents=True, exist_ok=True)
    spies = []
    for fmt, suffix in (("flamegraph", "svg"), ("raw", "txt")):
        spies.append(subprocess.Popen(
            [py_spy, "record", "--pid", str(pid), "--rate", "100", "--nonblocking",
             # BENCH_PYSPY_IDLE=1: also sample waiting threads (where the worker blocks)
             *(["--idle"] if os.environ.get("BENCH_PYSPY_IDLE") else []),
             "--threads", "--format", fmt, "-o", str(profile_dir / f"{name}.{suffix}")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        ))
    return spies


def steady_state(
    services: Services, sessions: Sequence[Session], db_url: str, *, rate: float,
    seconds: float, rng: random.Random, log: Log,
) -> dict[str, Any]:
    """Produce at ``rate``/s for ``seconds`` while the job tails; CreatedAt -> arrival latency."""
    settings = services.settings("steady", db_url)
    counter = OutputCounter(services.bootstrap, settings.topic_action_tracked,
                            track_favorites=True)
    job = JobProcess(settings, services.run_dir / "steady.log", tail=True)
    factory = EnvelopeFactory(sessions, rng, settings.topic_favorite_added,
                              settings.topic_favorite_removed)
    prod = producer(services.bootstrap, **{"linger.ms": 5})
    sent_at: dict[str, float] = {}
    try:
        warm = 200
        for _ in range(warm):
            r = factory.record("valid")
            prod.produce(r.topic, r.value, r.key, headers=list(r.headers))
        prod.flush(30)
        deadline = time.monotonic() + 120
        while counter.count < warm and time.monotonic() < deadline and job.running:
            time.sleep(0.1)
        if counter.count < warm:
            return {"ok": False, "failure": f"warm-up: {counter.count}/{warm} out",
                    "log_tail": job.log_tail()}
        ready_s = time.monotonic() - job.started
        warm_count = counter.count
        sampler = CpuSampler(job, services.postmaster_pid, services.kafka_pid)
        recent: list[OutRecord] = []
        sent = 0
        kinds = {"duplicate": 0, "invalid-owner": 0, "no-session": 0, "valid": 0}
        start = time.monotonic()
        while True:
            elapsed = time.monotonic() - start
            if elapsed >= seconds:
                break
            due = min(int(elapsed * rate) + 1, int(seconds * rate))
            while sent < due:
                draw = rng.random()
                kind = ("duplicate" if draw < 0.01 and recent else
                        "invalid-owner" if draw < 0.015 else
                        "no-session" if draw < 0.02 else "valid")
                if kind == "duplicate":
                    r = rng.choice(recent)
                else:
                    now_wall = time.time()
                    r = factory.record(kind, created_at=datetime.fromtimestamp(now_wall, UTC))
                    if kind == "valid":
                        sent_at[r.favorite_id] = now_wall
                        recent.append(r)
                        if len(recent) > 1000:
                            recent.pop(0)
                prod.produce(r.topic, r.value, r.key, headers=list(r.headers))
                kinds[kind] += 1
                sent += 1
            prod.poll(0)
            time.sleep(0.002)
        produce_s = time.monotonic() - start
        prod.flush(30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if all(f in counter.arrivals for f in sent_at):
                break
            time.sleep(0.2)
        cpu = sampler.stop()
    finally:
        counter.close()
        job.stop()
    latencies = [1000 * (counter.arrivals[f] - t) for f, t in sent_at.items()
                 if f in counter.arrivals]
    result = {
        "target_rate": rate,
        "seconds": seconds,
        "produced": sent,
        "produced_rate": round(sent / produce_s, 1),
        "kinds": kinds,
        "expected_outputs": len(sent_at),
        "received_outputs": len(latencies),
        "outputs_total_on_topic": counter.count - warm_count,
        "job_ready_s": round(ready_s, 2),
        "p50_ms": _round(_percentile(latencies, 0.50)),
        "p95_ms": _round(_percentile(latencies, 0.95)),
        "p99_ms": _round(_percentile(latencies, 0.99)),
        "max_ms": _round(max(latencies) if latencies else None),
        "min_ms": _round(min(latencies) if latencies else None),
        "resources": cpu,
        "ok": len(latencies) == len(sent_at) and len(sent_at) > 0,
    }
    log(f"  steady: {result['produced_rate']}/s, p50 {result['p50_ms']} ms, p95 "
        f"{result['p95_ms']} ms, p99 {result['p99_ms']} ms, got {len(latencies)}/{len(sent_at)}")
    return result


def _round(value: float | None, digits: int = 1) -> float | None:
    return None if value is None else round(value, digits)


def dedup_fill(
    services: Services, sessions: Sequence[Session], db_url: str, *, prefix: str, ids: int,
    owners: int, rng: random.Random, log: Log, snapshot_interval: float = 5.0,
    settle: bool = True,
) -> tuple[dict[str, Any], JobProcess | None, Settings, Path]:
    """Fill a tailing job's dedup window with ``ids`` MessageIds; its RSS afterwards.

    The job runs with recovery (``-r DIR -s 5``). ``ids`` distinct valid messages over ``owners``
    devices that have no session: every one passes the dedup window (which keeps it) and the
    sink resolves no session for it, so no row is written (the window's content is the same as
    with rows; the phase just does not add a million rows). Returns the still running job.
    """
    settings = services.settings(prefix, db_url)
    recovery_dir = services.run_dir / f"{prefix}-recovery"
    subprocess.run(
        [sys.executable, "-m", "cli", "init-recovery", str(recovery_dir), "--partitions", "1"],
        cwd=ROOT, check=True, capture_output=True,
    )
    devices = [uuid4_from(rng) for _ in range(owners)]
    factory = EnvelopeFactory(sessions, rng, settings.topic_favorite_added,
                              settings.topic_favorite_removed)

    def dedup_records() -> Any:
        for i in range(ids):
            envelope, favorite_id = factory.envelope(None, devices[i % owners])
            yield OutRecord(factory.topic(), favorite_id.encode(), orjson.dumps(envelope), (),
                            favorite_id, "no-session")

    t0 = time.monotonic()
    produce_all(services.bootstrap, dedup_records())
    produce_s = time.monotonic() - t0
    log(f"  {prefix}: produced {ids:,} messages over {owners:,} owners in {produce_s:.1f}s")
    job = JobProcess(settings, services.run_dir / f"{prefix}-1.log", tail=True,
                     recovery_dir=recovery_dir, snapshot_interval=snapshot_interval)
    sampler = CpuSampler(job, services.postmaster_pid, services.kafka_pid)
    timeout = max(300.0, ids / 500)
    t_done: float | None = None
    last: dict[str, float] | None = None
    while time.monotonic() - job.started < timeout and job.running:
        metrics = job.scrape(timeout=2.0)
        if metrics is not None:
            last = metrics
        if metric_sum(last, SKIPPED, reason="no-session") >= ids:
            t_done = time.monotonic()
            break
        time.sleep(0.5 if last is None or ids < 100_000 else 2.0)  # scraping costs the job CPU
    cpu = sampler.stop()
    dedup: dict[str, Any] = {"ids": ids, "owners": owners, "produce_s": round(produce_s, 1),
                             "resources": cpu}
    if t_done is None:
        dedup.update(ok=False, failure="not all ids processed",
                     processed=metric_sum(last, SKIPPED, reason="no-session"),
                     log_tail=job.log_tail())
        job.kill()
        return dedup, None, settings, recovery_dir
    rss_done = job.rss_mb()
    if settle:
        time.sleep(snapshot_interval + 1.5)  # one more snapshot of the full window
    dedup.update(
        ok=True,
        process_s=round(t_done - job.started, 1),
        events_per_s=round(ids / (t_done - job.started), 1),
        rss_mb_when_done=_round(rss_done),
        rss_mb=_round(job.rss_mb()),
        hwm_mb=_round(job.hwm_mb()),
        rss_note=("VmRSS after processing a backlog burst: includes librdkafka prefetch queues and"
                  " allocator retention, not only the dedup state; see restart"
                  ".rss_mb_after_restore for the restored state with a small backlog"),
        recovery_store_mb=round(
            sum(p.stat().st_size for p in recovery_dir.rglob("*") if p.is_file()) / 2**20, 1),
    )
    log(f"  {prefix}: {ids:,} ids in {dedup['process_s']}s, RSS {dedup['rss_mb']} MB "
        f"(peak {dedup['hwm_mb']} MB), recovery store {dedup['recovery_store_mb']} MB")
    return dedup, job, settings, recovery_dir


def dedup_and_restart(
    services: Services, sessions: Sequence[Session], db_url: str, *, ids: int, owners: int,
    restart_backlog: int, rng: random.Random, log: Log, snapshot_interval: float = 5.0,
    settle: bool = True,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """RSS of the job holding ``ids`` MessageIds in its dedup window, then restart after SIGKILL.

    See :func:`dedup_fill`. Then SIGKILL, a backlog of ``restart_backlog`` ordinary messages is
    produced while the job is down, and the job is restarted on the same recovery store: time
    from the restart to the last expected action-tracked message.
    """
    dedup, job, settings, recovery_dir = dedup_fill(
        services, sessions, db_url, prefix="recovery", ids=ids, owners=owners, rng=rng, log=log,
        snapshot_interval=snapshot_interval, settle=settle)
    if job is None:
        return dedup, {"ok": False, "failure": "dedup phase failed"}
    job.kill()
    restart_factory = EnvelopeFactory(sessions, rng, settings.topic_favorite_added,
                                      settings.topic_favorite_removed)
    backlog = make_backlog(restart_factory, restart_backlog, rng)
    counter = OutputCounter(services.bootstrap, settings.topic_action_tracked)
    produce_all(services.bootstrap, backlog.records)
    expected = backlog.expected_recorded
    job2 = JobProcess(settings, services.run_dir / "recovery-2.log", tail=True,
                      recovery_dir=recovery_dir, snapshot_interval=snapshot_interval)
    t_http: float | None = None
    deadline = job2.started + max(120.0, restart_backlog / 200)
    while time.monotonic() < deadline and job2.running and counter.count < expected:
        if t_http is None and job2.scrape(timeout=0.5) is not None:
            t_http = time.monotonic()
        time.sleep(0.1)
    caught = counter.last_at if counter.count >= expected else None
    rss_after = job2.rss_mb()
    restart: dict[str, Any] = {
        "backlog": backlog.summary(),
        "startup_s": _round(t_http - job2.started if t_http else None, 2),
        "first_output_s": _round(counter.first_at - job2.started if counter.first_at else None, 2),
        "caught_up_s": _round(caught - job2.started if caught else None, 2),
        "outputs": counter.count,
        "rss_mb_after_restore": _round(rss_after),
        "ok": caught is not None,
    }
    if caught is None:
        restart["failure"] = f"{counter.count}/{expected} out"
        restart["log_tail"] = job2.log_tail()
    counter.close()
    job2.stop()
    log(f"  restart: caught up on {restart_backlog:,} in {restart['caught_up_s']}s "
        f"(startup {restart['startup_s']}s, first output {restart['first_output_s']}s)")
    return dedup, restart
