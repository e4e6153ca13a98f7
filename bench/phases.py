"""The measured phases of a benchmark run against the real job (each returns a JSON-able dict)."""

from __future__ import annotations

import contextlib
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
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
import psycopg

from bench.measure import CommitProbe, CpuSampler, Job, OutputCounter, cpu_us_per_event, read_topic
from bench.report import paired_ratios
from bench.services import Services
from bench.wal import describe_composition
from bench.workload import (
    Backlog,
    EnvelopeFactory,
    OutRecord,
    make_backlog,
    produce_all,
    uuid4_from,
)
from bench.workload import producer as make_producer
from devenv.harness.jobs import ROOT
from devenv.harness.metrics import metric_sum
from devenv.harness.ports import free_port
from devenv.harness.sessions import Session
from devenv.otlp_receiver import OtlpReceiver
from runtime.settings import Settings

Log = Callable[[str], None]
RECORDED = "user_activity_favorites_recorded_total"
SKIPPED = "user_activity_favorites_skipped_total"
LATENCY_BIN_MS = 5


def _round(value: float | None, digits: int = 1) -> float | None:
    return None if value is None else round(value, digits)


def _since(t: float | None, t0: float) -> float | None:
    return None if t is None else round(t - t0, 2)


def job_backlog(
    services: Services, input_settings: Settings, backlog: Backlog, db_url: str, *,
    name: str, workers: int, prefill_rows: int, timeout: float, log: Log,
    profile_dir: Path | None = None, source_dir: Path | None = None,
    extra_env: dict[str, str] | None = None, processes: int = 1,
) -> dict[str, Any]:
    """Run the bounded job (``tail=False``) on the backlog until it is all processed.

    Done = every action-tracked message on the output topic (each is published after its row's
    commit; the row count is checked after); the rate is over the wall time from the spawn.
    ``processes`` > 1 runs a Bytewax cluster of that many processes (``-i``/``-a``, ``workers``
    each); CPU and RSS are their sums, metrics are the first process's.
    """
    settings = services.settings(name, db_url,
                                 topic_favorite_added=input_settings.topic_favorite_added,
                                 topic_favorite_removed=input_settings.topic_favorite_removed)
    expected, total = backlog.expected_recorded, len(backlog.records)
    counter = OutputCounter(services.bootstrap, settings.topic_action_tracked)
    wal0, lsn0 = services.wal_position(db_url)
    gc_dir = services.run_dir / "gcprobe"
    gc_dir.mkdir(exist_ok=True)
    probe_env = {"PYTHONPATH": str(ROOT / "bench" / "gcprobe"), "GCPROBE_DIR": str(gc_dir)}
    addresses = ";".join(f"127.0.0.1:{free_port()}" for _ in range(processes))
    jobs = [
        Job(settings, services.run_dir / (f"{name}.log" if processes == 1 else f"{name}-{i}.log"),
            workers=workers, tail=False, source_dir=source_dir,
            extra_env={**probe_env, **(extra_env or {})},
            cluster=(i, addresses) if processes > 1 else None)
        for i in range(processes)
    ]
    job = jobs[0]
    sampler = (CpuSampler(services, job) if processes == 1 else CpuSampler(
        services, cpu=lambda: sum(j.cpu_seconds() or 0.0 for j in jobs),
        rss=lambda: sum(j.rss_mb() or 0.0 for j in jobs)))
    t_http = t_rows = None
    last: dict[str, float] | None = None
    spies: list[subprocess.Popen[bytes]] = []
    failure, next_scrape = None, 0.0
    while counter.count < expected:
        now = time.monotonic()
        # /metrics costs the job CPU: every 0.1 s until it answers (start-up), then every 2 s.
        if now >= next_scrape:
            last = job.scrape(timeout=1.0) or last
            if last is not None and t_http is None:
                t_http = now
                spies = _start_py_spy(job.pid or 0, profile_dir, name) if profile_dir else []
            next_scrape = now + (2.0 if t_http is not None else 0.1)
            if t_rows is None and metric_sum(last, RECORDED) >= expected:
                t_rows = now
        for j in jobs:
            j.hwm_mb()
        gone = [j for j in jobs if not j.running and j.exited_at is not None
                and now - j.exited_at > 15]
        if gone:
            failure = f"job exited ({gone[0].returncode}) with {counter.count}/{expected} out"
            break
        if now - job.started > timeout:
            failure = f"timeout after {timeout:.0f}s: {counter.count}/{expected} out"
            break
        time.sleep(0.1)
    codes = [j.wait(60) for j in jobs]
    codes = [j.stop() if c is None else c for j, c in zip(jobs, codes, strict=True)]
    code = next((c for c in codes if c), codes[0])
    cpu = sampler.stop()
    counter.close()
    for spy in spies:
        try:
            spy.wait(60)
        except subprocess.TimeoutExpired:
            spy.send_signal(signal.SIGINT)
            spy.wait(30)
    rows = services.counts(db_url)["action_events"] - prefill_rows
    wal_end, lsn_end = services.wal_position(db_url)
    wal = wal_end - wal0
    out_total, out_distinct = read_topic(
        services.bootstrap, settings.topic_action_tracked,
        lambda e: str(e["Payload"]["FavoriteId"]), expect=expected, timeout=30)
    composition = services.wal_composition(db_url, lsn0, lsn_end, rows)  # outside the timing
    t_done = counter.last_at if failure is None else None
    wall = None if t_done is None else t_done - job.started
    first = counter.first_at
    result: dict[str, Any] = {
        "workers": workers, "processes": processes, "messages": total,
        "expected_recorded": expected,
        "rows_committed": rows,
        "outbox_unpublished_after": services.counts(db_url)["outbox_unpublished"],
        "action_tracked_on_topic": out_total, "action_tracked_distinct": out_distinct,
        **{f"skipped_{r.replace('-', '_')}": metric_sum(last, SKIPPED, reason=r)
           for r in ("duplicate", "invalid-owner", "no-session")},
        # rows a window read back instead of the fast path (the last scrape: up to 2 s early)
        "outbox_read_back": metric_sum(last, "user_activity_outbox_read_back_total"),
        # committed favorites transactions (one write-duration observation each)
        "sink_batches": metric_sum(last, "user_activity_favorites_write_duration_ms_count"),
        "exit_code": code,
        "startup_s": _since(t_http, job.started),
        "first_output_s": _since(first, job.started),
        "rows_done_seen_s": _since(t_rows, job.started),  # 2 s resolution
        "outputs_done_s": _since(counter.last_at, job.started),
        "wall_s": _round(wall, 2),
        "events_per_s": round(total / wall, 1) if wall else None,
        "events_per_s_after_first_output": (
            round(total / (t_done - first), 1) if t_done and first and t_done > first else None),
        "wal_bytes_per_recorded_event": round(wal / rows) if rows > 0 else None,
        "wal_by_kind": composition,
        "job_peak_rss_mb": sum(j.hwm_mb() or 0.0 for j in jobs),  # VmHWM, read every 0.1 s
        "gc": _gc_probe(gc_dir, job.pid or 0),
        "cpu_us_per_event": cpu_us_per_event(cpu, total),
        "resources": cpu,
        "ok": failure is None and rows == expected and out_distinct == expected,
    }
    if not result["ok"]:
        result["failure"] = failure or "counts differ from expected"
        result["log_tail"] = job.log_tail(20, info=True)
    log(f"  {name}: {result['events_per_s']} ev/s, wall {result['wall_s']}s, rows {rows}/"
        f"{expected}, out {out_distinct}/{expected}, CPU µs/event {result['cpu_us_per_event']}")
    log(f"  {name}: WAL B/event {result['wal_bytes_per_recorded_event']}: "
        f"{describe_composition(composition)}")
    return result


def _gc_probe(directory: Path, pid: int) -> dict[str, Any] | None:
    """What ``bench/gcprobe`` wrote for the job ``pid`` at its exit (None if it did not exit)."""
    try:
        return dict(json.loads((directory / f"{pid}.json").read_text()))
    except (OSError, ValueError):
        return None


def _start_py_spy(pid: int, profile_dir: Path, name: str) -> list[subprocess.Popen[bytes]]:
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    profile_dir.mkdir(parents=True, exist_ok=True)
    idle = ["--idle"] if os.environ.get("BENCH_PYSPY_IDLE") else []  # also waiting threads
    return [subprocess.Popen(
        [py_spy, "record", "--pid", str(pid), "--rate", "100", "--nonblocking", *idle,
         "--threads", "--format", fmt, "-o", str(profile_dir / f"{name}.{suffix}")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    ) for fmt, suffix in (("flamegraph", "svg"), ("raw", "txt"))]


def compare_jobs(
    services: Services, input_settings: Settings, backlog: Backlog, *, ref: str, rounds: int,
    prefill_rows: int, timeout: float, log: Log, ref_env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The ``-w 1`` job of this tree against a reference, interleaved.

    The reference is the job at commit ``ref`` (this tree when empty) with ``ref_env`` added
    to its environment. ``rounds`` x (this tree, reference), alternating which goes first, each
    on its own copy of the template database: on a noisy machine only an interleaved A/B
    separates a 10 % change from the noise. Reports each run, the ratio of medians and each
    round's ratio with their geometric mean (:func:`bench.report.paired_ratios`).
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
        cpu_us: dict[str, list[float]] = {"head": [], "ref": []}
        first_output: dict[str, list[float]] = {"head": [], "ref": []}
        for round_no in range(rounds):
            order = [("head", None), ("ref", checkout)]
            for label, source in order if round_no % 2 == 0 else order[::-1]:
                name = f"ab_{label}_{round_no}"
                db = services.create_database(name, template="tpl")
                run = job_backlog(services, input_settings, backlog, db, name=name, workers=1,
                                  prefill_rows=prefill_rows, timeout=timeout, log=log,
                                  source_dir=source, extra_env=ref_env if label == "ref" else None)
                services.drop_database(name)
                if not run["ok"]:
                    return {**reference, "failure": f"{name}: {run.get('failure')}"}
                rates[label].append(run["events_per_s"])
                if run.get("first_output_s") is not None:  # spawn -> first action-tracked
                    first_output[label].append(run["first_output_s"])
                job_cpu = (run.get("resources") or {}).get("job_cpu_s")
                if job_cpu:
                    cpu_us[label].append(round(1e6 * job_cpu / run["messages"], 1))
        head, base = statistics.median(rates["head"]), statistics.median(rates["ref"])
        result = {**reference, "rounds": rounds, "events_per_s": rates, "median_head": head,
                  "median_ref": base, "ratio_head_to_ref": round(head / base, 3),
                  "ratio_ref_to_head": round(base / head, 3),
                  "paired_head_to_ref": paired_ratios(rates["head"], rates["ref"]),
                  "first_output_s": first_output}
        if cpu_us["head"] and cpu_us["ref"]:
            # the job's CPU per event: less disturbed by a busy machine than its throughput
            cpu_head, cpu_ref = statistics.median(cpu_us["head"]), statistics.median(cpu_us["ref"])
            result.update({"job_cpu_us_per_event": cpu_us,
                           "cpu_ratio_ref_to_head": round(cpu_ref / cpu_head, 3)})
            if len(cpu_us["head"]) == len(cpu_us["ref"]) == rounds:
                result["cpu_paired_head_to_ref"] = paired_ratios(cpu_us["head"], cpu_us["ref"])
        return result
    finally:
        if checkout is not None:
            subprocess.run(["git", "worktree", "remove", "--force", str(checkout)], cwd=ROOT,
                           check=False, capture_output=True)


OTLP_RECEIVER = "receiver"
"""``OTEL_EXPORTER_OTLP_ENDPOINT=receiver`` in ``--compare-env``: a local receiver's address."""


@contextlib.contextmanager
def otlp_receiver_for(env: dict[str, str]) -> Iterator[OtlpReceiver | None]:
    """An OTLP/HTTP receiver that accepts and discards, when ``env`` asks for one.

    ``OTEL_EXPORTER_OTLP_ENDPOINT=receiver`` is replaced (in ``env``) by the address of a
    receiver started on loopback for the duration (:mod:`devenv.otlp_receiver`, ``keep=False``:
    answered without decoding, so the job's tracing cost is measured, not a collector's).
    """
    if env.get("OTEL_EXPORTER_OTLP_ENDPOINT") != OTLP_RECEIVER:
        yield None
        return
    with OtlpReceiver(keep=False) as receiver:
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = receiver.endpoint
        yield receiver


def _percentile(ordered: Sequence[float], q: float) -> float | None:
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def steady_state(
    services: Services, sessions: Sequence[Session], db_url: str, *, rate: float,
    seconds: float, rng: random.Random, log: Log,
) -> dict[str, Any]:
    """Produce at ``rate``/s for ``seconds`` while the job tails; CreatedAt -> arrival latency.

    1 % duplicates, 0.5 % invalid owners, 0.5 % without a session; the latency of every valid
    message, as percentiles and a histogram (``LATENCY_BIN_MS`` bins), and split in three
    stages (``stages_ms``, percentiles of each): ``to_write`` CreatedAt -> the recording
    transaction's start (the row's ``recorded_at``: Kafka in, decode, dedup, Bytewax);
    ``write_to_publish`` -> the action-tracked record's timestamp (commit, offer, the
    publisher's queue); ``publish_to_arrival`` -> received (producer linger, broker, fetch).
    All three clocks are this machine's.
    """
    settings = services.settings("steady", db_url)
    counter = OutputCounter(services.bootstrap, settings.topic_action_tracked,
                            track_favorites=True)
    job = Job(settings, services.run_dir / "steady.log", tail=True)
    factory = EnvelopeFactory(sessions, rng, settings.topic_favorite_added,
                              settings.topic_favorite_removed)
    prod = make_producer(services.bootstrap, **{"linger.ms": 5})
    sent_at: dict[str, float] = {}
    kinds = dict.fromkeys(("duplicate", "invalid-owner", "no-session", "valid"), 0)
    try:
        warm = 200
        for r in (factory.record("valid") for _ in range(warm)):
            prod.produce(r.topic, r.value, r.key, headers=list(r.headers))
        prod.flush(30)
        deadline = time.monotonic() + 120
        while counter.count < warm and time.monotonic() < deadline and job.running:
            time.sleep(0.1)
        if counter.count < warm:
            return {"ok": False, "failure": f"warm-up: {counter.count}/{warm} out",
                    "log_tail": job.log_tail(20, info=True)}
        ready_s, warm_count = time.monotonic() - job.started, counter.count
        sampler = CpuSampler(services, job)
        probe = CommitProbe(db_url)
        recent: deque[OutRecord] = deque(maxlen=1000)
        sent, start = 0, time.monotonic()
        while (elapsed := time.monotonic() - start) < seconds:
            while sent < min(int(elapsed * rate) + 1, int(seconds * rate)):
                draw = rng.random()
                kind = ("duplicate" if draw < 0.01 and recent else "invalid-owner"
                        if draw < 0.015 else "no-session" if draw < 0.02 else "valid")
                if kind == "duplicate":
                    r = rng.choice(recent)
                else:
                    now_wall = time.time()
                    r = factory.record(kind, created_at=datetime.fromtimestamp(now_wall, UTC))
                    if kind == "valid":
                        sent_at[r.favorite_id] = now_wall
                        recent.append(r)
                prod.produce(r.topic, r.value, r.key, headers=list(r.headers))
                kinds[kind] += 1
                sent += 1
            prod.poll(0)
            time.sleep(0.002)
        produce_s = time.monotonic() - start
        prod.flush(30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(f in counter.arrivals for f in sent_at):
            time.sleep(0.2)
        cpu = sampler.stop()
        probe.stop()
    finally:
        counter.close()
        job.stop()
    latencies = sorted(1000 * (counter.arrivals[f] - t) for f, t in sent_at.items()
                       if f in counter.arrivals)
    stages = _latency_stages(db_url, sent_at, counter)
    commits = _commit_stalls(probe, sent_at, counter)
    histogram = [0] * (int((latencies[-1] if latencies else 0) // LATENCY_BIN_MS) + 1)
    for ms in latencies:
        histogram[int(ms // LATENCY_BIN_MS)] += 1
    result = {
        "target_rate": rate, "seconds": seconds, "produced": sent,
        "produced_rate": round(sent / produce_s, 1), "kinds": kinds,
        "expected_outputs": len(sent_at), "received_outputs": len(latencies),
        "outputs_total_on_topic": counter.count - warm_count, "job_ready_s": round(ready_s, 2),
        **{f"p{q}_ms": _round(_percentile(latencies, q / 100)) for q in (50, 95, 99)},
        "max_ms": _round(latencies[-1] if latencies else None),
        "min_ms": _round(latencies[0] if latencies else None),
        "latency_histogram": {"bin_ms": LATENCY_BIN_MS, "counts": histogram},
        "stages_ms": stages,
        "commit_probe": commits,
        "resources": cpu,
        "ok": len(latencies) == len(sent_at) > 0,
    }
    log(f"  steady: {result['produced_rate']}/s, p50 {result['p50_ms']} ms, p95 "
        f"{result['p95_ms']} ms, p99 {result['p99_ms']} ms, got {len(latencies)}/{len(sent_at)}")
    log("  steady stages p50/p95/p99 ms: " + ", ".join(
        f"{name} {q['p50']}/{q['p95']}/{q['p99']}" for name, q in stages.items()))
    log(f"  steady commit probe: p50 {commits['p50_ms']} ms, p99 {commits['p99_ms']} ms, max "
        f"{commits['max_ms']} ms, {commits['stalls']} stalls >= {STALL_MS} ms; of the messages"
        f" over {TAIL_MS} ms, {commits['tail_in_stall_pct']} % were in flight during one")
    return result


STALL_MS = 100.0
"""A commit of the probe this slow is a storage stall (a WAL flush is ~1-10 ms here)."""
TAIL_MS = 150.0
"""The steady latency bound: the messages above it are the tail to explain."""


def _commit_stalls(probe: CommitProbe, sent_at: dict[str, float],
                   counter: OutputCounter) -> dict[str, Any]:
    """The probe's commit times, and how much of the latency tail overlapped a stall.

    A message is in the tail when CreatedAt -> arrival exceeded :data:`TAIL_MS`; it overlapped
    a stall when a probe commit of at least :data:`STALL_MS` ran during its flight.
    """
    took = sorted(1000 * (b - a) for a, b in probe.samples)
    stalls = probe.stalls(STALL_MS)
    tail = [(t, counter.arrivals[f]) for f, t in sent_at.items()
            if f in counter.arrivals and 1000 * (counter.arrivals[f] - t) > TAIL_MS]
    overlapped = sum(1 for start, end in tail if any(a < end and b > start for a, b in stalls))
    return {
        "interval_s": probe.interval, "probes": len(took),
        **{f"p{q}_ms": _round(_percentile(took, q / 100)) for q in (50, 99)},
        "max_ms": _round(took[-1] if took else None), "stalls": len(stalls),
        "stalled_s": _round(sum(b - a for a, b in stalls), 2),
        "tail_messages": len(tail),
        "tail_in_stall_pct": _round(100 * overlapped / len(tail)) if tail else None,
    }


def _latency_stages(db_url: str, sent_at: dict[str, float],
                    counter: OutputCounter) -> dict[str, dict[str, float | None]]:
    """Percentiles of each stage of the steady latency (see :func:`steady_state`)."""
    with psycopg.connect(db_url) as conn:
        written: dict[str, float] = dict(conn.execute(
            "SELECT favorite_id::text, extract(epoch FROM recorded_at)::float8"
            "  FROM user_activity.action_events WHERE favorite_id = ANY(%s::uuid[])",
            (list(sent_at),)).fetchall())
    spans: dict[str, list[float]] = {
        "to_write": [], "write_to_publish": [], "publish_to_arrival": []}
    for favorite, created in sent_at.items():
        arrived, published = counter.arrivals.get(favorite), counter.published.get(favorite)
        recorded = written.get(favorite)
        if arrived is None or published is None or recorded is None:
            continue
        spans["to_write"].append(1000 * (recorded - created))
        spans["write_to_publish"].append(1000 * (published - recorded))
        spans["publish_to_arrival"].append(1000 * (arrived - published))
    return {name: {f"p{q}": _round(_percentile(sorted(values), q / 100)) for q in (50, 95, 99)}
            for name, values in spans.items()}


def dedup_and_restart(
    services: Services, sessions: Sequence[Session], db_url: str, *, ids: int, owners: int,
    restart_backlog: int, rng: random.Random, log: Log, settle: bool = True,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """RSS of the job holding ``ids`` MessageIds in its dedup window, then restart after SIGKILL.

    The job runs with recovery (``-r DIR -s 5``). ``ids`` distinct valid messages over ``owners``
    devices without a session: each passes the dedup window (which keeps it) and no row is
    written. Then SIGKILL, ``restart_backlog`` ordinary messages produced while the job is down,
    and a restart on the same recovery store: the time to the last expected action-tracked.
    """
    settings = services.settings("recovery", db_url)
    recovery_dir = services.run_dir / "recovery"
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
    log(f"  dedup: produced {ids:,} messages over {owners:,} owners in {produce_s:.1f}s")
    job = Job(settings, services.run_dir / "recovery-1.log", tail=True, recovery_dir=recovery_dir)
    sampler = CpuSampler(services, job)
    t_done, last = None, None
    while time.monotonic() - job.started < max(300.0, ids / 500) and job.running:
        last = job.scrape(timeout=2.0) or last
        if metric_sum(last, SKIPPED, reason="no-session") >= ids:
            t_done = time.monotonic()
            break
        time.sleep(0.5 if last is None or ids < 100_000 else 2.0)  # scraping costs the job CPU
    dedup: dict[str, Any] = {"ids": ids, "owners": owners, "produce_s": round(produce_s, 1),
                             "resources": sampler.stop()}
    if t_done is None:
        dedup.update(ok=False, failure="not all ids processed", log_tail=job.log_tail(20),
                     processed=metric_sum(last, SKIPPED, reason="no-session"))
        job.kill()
        return dedup, {"ok": False, "failure": "dedup phase failed"}
    rss_done = job.rss_mb()
    if settle:
        time.sleep(6.5)  # one more snapshot (every 5 s) of the full window
    dedup.update(
        ok=True, process_s=round(t_done - job.started, 1),
        events_per_s=round(ids / (t_done - job.started), 1),
        rss_mb_when_done=rss_done, rss_mb=job.rss_mb(), hwm_mb=job.hwm_mb(),
        rss_note=("VmRSS after processing a backlog burst: includes librdkafka prefetch queues and"
                  " allocator retention, not only the dedup state; see restart"
                  ".rss_mb_after_restore for the restored state with a small backlog"),
        recovery_store_mb=round(
            sum(p.stat().st_size for p in recovery_dir.rglob("*") if p.is_file()) / 2**20, 1),
    )
    log(f"  dedup: {ids:,} ids in {dedup['process_s']}s, RSS {dedup['rss_mb']} MB "
        f"(peak {dedup['hwm_mb']} MB), recovery store {dedup['recovery_store_mb']} MB")
    job.kill()
    backlog = make_backlog(factory, restart_backlog, rng)
    counter = OutputCounter(services.bootstrap, settings.topic_action_tracked)
    produce_all(services.bootstrap, backlog.records)
    expected = backlog.expected_recorded
    job2 = Job(settings, services.run_dir / "recovery-2.log", tail=True, recovery_dir=recovery_dir)
    t_http = None
    deadline = job2.started + max(120.0, restart_backlog / 200)
    while time.monotonic() < deadline and job2.running and counter.count < expected:
        if t_http is None and job2.scrape(timeout=0.5) is not None:
            t_http = time.monotonic()
        time.sleep(0.1)
    caught = counter.last_at if counter.count >= expected else None
    restart: dict[str, Any] = {
        "backlog": backlog.summary(), "startup_s": _since(t_http, job2.started),
        "first_output_s": _since(counter.first_at, job2.started),
        "caught_up_s": _since(caught, job2.started), "outputs": counter.count,
        "rss_mb_after_restore": job2.rss_mb(), "ok": caught is not None,
    }
    if caught is None:
        restart.update(failure=f"{counter.count}/{expected} out", log_tail=job2.log_tail(20))
    counter.close()
    job2.stop()
    log(f"  restart: caught up on {restart_backlog:,} in {restart['caught_up_s']}s "
        f"(startup {restart['startup_s']}s, first output {restart['first_output_s']}s)")
    return dedup, restart
