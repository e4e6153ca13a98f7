"""The phases that run the real job (``python -m bytewax.run dataflows.favorite_actions:flow``).

- :func:`job_backlog`: the bounded job on the backlog until every action-tracked is on the topic;
  events/s over the wall time from the spawn, CPU µs per event of the job, PostgreSQL and Kafka,
  WAL per recorded event, peak RSS; :func:`compare_jobs` interleaves it with another commit's.
- :func:`steady_state`: a rate produced while the job tails; CreatedAt -> arrival latency.
- :func:`dedup_and_restart`: RSS with N MessageIds in the dedup window, then SIGKILL, a backlog
  produced while down, and the time from the restart to caught up.
"""

from __future__ import annotations

import contextlib
import random
import statistics
import subprocess
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson

from bench.report import paired_ratios
from bench.services import (
    CpuSampler,
    Job,
    OutputCounter,
    Services,
    counts,
    cpu_us_per_event,
    read_topic,
    wal_by_kind,
    wal_position,
)
from bench.workload import Backlog, EnvelopeFactory, OutRecord, make_backlog, produce_all, producer
from bench.workload import uuid4_from as _uuid4
from devenv.harness.jobs import ROOT
from devenv.harness.metrics import metric_sum
from devenv.harness.ports import free_port
from devenv.harness.sessions import Session
from devenv.otlp_receiver import OtlpReceiver
from runtime.settings import Settings

Log = Callable[[str], None]
RECORDED = "user_activity_favorites_recorded_total"
SKIPPED = "user_activity_favorites_skipped_total"


def _since(t: float | None, t0: float) -> float | None:
    return None if t is None else round(t - t0, 2)


def job_backlog(services: Services, input_settings: Settings, backlog: Backlog, db_url: str, *,
                name: str, workers: int, prefill_rows: int, timeout: float, log: Log,
                source_dir: Path | None = None, extra_env: dict[str, str] | None = None,
                processes: int = 1) -> dict[str, Any]:
    """Run the bounded job (``tail=False``) on the backlog until it is all processed.

    Done = every action-tracked on the output topic (each is published after its row's commit;
    the rows are counted after). ``source_dir``: the job of another checkout. ``processes`` > 1:
    a Bytewax cluster of that many processes (``-i``/``-a``) of ``workers`` each, timed from the
    first spawn; their CPU, peak RSS and metrics are summed, the run fails when any one exits
    early.
    """
    settings = services.settings(name, db_url,
                                 topic_favorite_added=input_settings.topic_favorite_added,
                                 topic_favorite_removed=input_settings.topic_favorite_removed)
    expected, total = backlog.expected_recorded, len(backlog.records)
    counter = OutputCounter(services.bootstrap, settings.topic_action_tracked)
    wal0, lsn0 = wal_position(db_url)
    cluster = processes > 1
    addresses = ";".join(f"127.0.0.1:{free_port()}" for _ in range(processes))
    jobs = [Job(settings, services.run_dir / (f"{name}-{i}.log" if cluster else f"{name}.log"),
                workers=workers, tail=False, source_dir=source_dir, extra_env=extra_env,
                cluster=(i, addresses) if cluster else None) for i in range(processes)]
    job = jobs[0]
    sampler = CpuSampler.of(services, *jobs)
    t_http = t_rows = last = None
    failure, next_scrape = None, 0.0
    while counter.count < expected:
        now = time.monotonic()
        if now >= next_scrape:  # /metrics costs the job CPU: every 0.1 s until it answers, then 2 s
            last = _scrape_all(jobs) or last
            t_http = t_http or (now if last is not None else None)
            next_scrape = now + (2.0 if t_http is not None else 0.1)
            if t_rows is None and metric_sum(last, RECORDED) >= expected:
                t_rows = now
        for one in jobs:
            one.hwm_mb()
        if gone := [j for j in jobs if not j.running and j.exited_at is not None
                    and now - j.exited_at > 15]:
            failure = f"job exited ({gone[0].returncode}) with {counter.count}/{expected} out"
            break
        if now - job.started > timeout:
            failure = f"timeout after {timeout:.0f}s: {counter.count}/{expected} out"
            break
        time.sleep(0.1)
    codes = [one.wait(60) for one in jobs]
    codes = [one.stop() if c is None else c for one, c in zip(jobs, codes, strict=True)]
    code = next((c for c in codes if c), codes[0])  # the first failing process's
    cpu = sampler.stop()
    counter.close()
    found = counts(db_url)
    rows = found["action_events"] - prefill_rows
    wal_end, lsn_end = wal_position(db_url)
    out_total, out_distinct = read_topic(
        services.bootstrap, settings.topic_action_tracked,
        lambda e: str(e["Payload"]["FavoriteId"]), expect=expected, timeout=30)
    t_done, first = (counter.last_at if failure is None else None), counter.first_at
    wall = None if t_done is None else t_done - job.started
    result: dict[str, Any] = {
        "workers": workers, "processes": processes, "messages": total,
        "expected_recorded": expected,
        "rows_committed": rows, "outbox_unpublished_after": found["outbox_unpublished"],
        "action_tracked_on_topic": out_total, "action_tracked_distinct": out_distinct,
        **{f"skipped_{r.replace('-', '_')}": metric_sum(last, SKIPPED, reason=r)
           for r in ("duplicate", "invalid-owner", "no-session")},
        "sink_batches": metric_sum(last, "user_activity_favorites_write_duration_ms_count"),
        "exit_code": code, "startup_s": _since(t_http, job.started),
        "first_output_s": _since(first, job.started),
        "rows_done_seen_s": _since(t_rows, job.started),  # 2 s resolution
        "outputs_done_s": _since(counter.last_at, job.started),
        "wall_s": None if wall is None else round(wall, 2),
        "events_per_s": round(total / wall, 1) if wall else None,
        "events_per_s_after_first_output": (
            round(total / (t_done - first), 1) if t_done and first and t_done > first else None),
        "wal_bytes_per_recorded_event": round((wal_end - wal0) / rows) if rows > 0 else None,
        "wal_by_kind": wal_by_kind(db_url, lsn0, lsn_end, rows),  # outside the timing
        "job_peak_rss_mb": round(sum(one.hwm_mb() or 0.0 for one in jobs), 1),  # VmHWM, 0.1 s
        "cpu_us_per_event": cpu_us_per_event(cpu, total), "resources": cpu,
        "ok": failure is None and rows == expected and out_distinct == expected,
    }
    if not result["ok"]:
        result["failure"] = failure or "counts differ from expected"
        result["log_tail"] = "\n".join(one.log_tail(20, info=True) for one in jobs)
    log(f"  {name}: {result['events_per_s']} ev/s, wall {result['wall_s']}s, rows {rows}/"
        f"{expected}, out {out_distinct}/{expected}, CPU µs/event {result['cpu_us_per_event']},"
        f" WAL B/event {result['wal_bytes_per_recorded_event']} {result['wal_by_kind']}")
    return result


def _scrape_all(jobs: Sequence[Job]) -> dict[str, float] | None:
    """The samples of every process of the job, summed by series; None unless all answer."""
    merged: dict[str, float] = {}
    for job in jobs:
        if (found := job.scrape(timeout=1.0)) is None:
            return None
        for series, value in found.items():
            merged[series] = merged.get(series, 0.0) + value
    return merged


def compare_jobs(services: Services, input_settings: Settings, backlog: Backlog, *, ref: str,
                 rounds: int, prefill_rows: int, timeout: float, log: Log,
                 ref_env: dict[str, str]) -> dict[str, Any]:
    """The ``-w 1`` job of this tree against commit ``ref`` (this tree when empty) + ``ref_env``.

    ``rounds`` x (this tree, reference), alternating which goes first, each on its own copy of
    the template database: on a noisy machine only an interleaved A/B separates a 10 % change
    from the noise. Each run, the medians' ratio, each round's ratio and their geometric mean.
    """
    checkout = Path(tempfile.mkdtemp(prefix="bench-ref-")) if ref else None
    if checkout is not None:
        subprocess.run(["git", "worktree", "add", "--detach", str(checkout), ref], cwd=ROOT,
                       check=True, capture_output=True)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", ref or "HEAD"], cwd=ROOT,
                                text=True, check=True, capture_output=True).stdout.strip()
        reference = {"ref": commit if ref else "this tree", "ref_env": ref_env}
        rates: dict[str, list[float]] = {"head": [], "ref": []}
        cpu_us: dict[str, list[float]] = {"head": [], "ref": []}
        pg_us: dict[str, list[float]] = {"head": [], "ref": []}
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
                if run["first_output_s"] is not None:
                    first_output[label].append(run["first_output_s"])
                if job_cpu := run["resources"].get("job_cpu_s"):
                    cpu_us[label].append(round(1e6 * job_cpu / run["messages"], 1))
                if pg_cpu := run["resources"].get("postgres_cpu_s"):
                    pg_us[label].append(round(1e6 * pg_cpu / run["messages"], 1))
        head, base = statistics.median(rates["head"]), statistics.median(rates["ref"])
        result = {**reference, "rounds": rounds, "events_per_s": rates, "median_head": head,
                  "median_ref": base, "ratio_head_to_ref": round(head / base, 3),
                  "ratio_ref_to_head": round(base / head, 3),
                  "paired_head_to_ref": paired_ratios(rates["head"], rates["ref"]),
                  "first_output_s": first_output}
        if len(cpu_us["head"]) == len(cpu_us["ref"]) == rounds:  # less disturbed than events/s
            result |= {"job_cpu_us_per_event": cpu_us, "cpu_ratio_ref_to_head": round(
                statistics.median(cpu_us["ref"]) / statistics.median(cpu_us["head"]), 3),
                "cpu_paired_head_to_ref": paired_ratios(cpu_us["head"], cpu_us["ref"])}
        if len(pg_us["head"]) == len(pg_us["ref"]) == rounds == len(cpu_us["head"]):
            both = {label: [j + p for j, p in zip(cpu_us[label], pg_us[label], strict=True)]
                    for label in ("head", "ref")}
            result |= {"postgres_cpu_us_per_event": pg_us,
                       "postgres_cpu_paired_head_to_ref": paired_ratios(pg_us["head"],
                                                                        pg_us["ref"]),
                       "job_and_postgres_cpu_paired_head_to_ref": paired_ratios(both["head"],
                                                                                both["ref"])}
        return result
    finally:
        if checkout is not None:
            subprocess.run(["git", "worktree", "remove", "--force", str(checkout)], cwd=ROOT,
                           check=False, capture_output=True)


@contextlib.contextmanager
def otlp_receiver_for(env: dict[str, str]) -> Iterator[OtlpReceiver | None]:
    """``OTEL_EXPORTER_OTLP_ENDPOINT=receiver`` in ``env``: a local receiver's address instead.

    The receiver answers without decoding (``keep=False``): the job's tracing cost is measured,
    not a collector's.
    """
    if env.get("OTEL_EXPORTER_OTLP_ENDPOINT") != "receiver":
        yield None
        return
    with OtlpReceiver(keep=False) as receiver:
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = receiver.endpoint
        yield receiver


def _percentile(ordered: Sequence[float], q: float) -> float | None:
    if not ordered:
        return None
    return round(ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))], 1)


def steady_state(services: Services, sessions: Sequence[Session], db_url: str, *, rate: float,
                 seconds: float, rng: random.Random, log: Log) -> dict[str, Any]:
    """Produce ``rate``/s for ``seconds`` while the job tails; CreatedAt -> arrival latency.

    1 % duplicates, 0.5 % invalid owners, 0.5 % without a session; the percentiles are of every
    valid message (all clocks are this machine's).
    """
    settings = services.settings("steady", db_url)
    counter = OutputCounter(services.bootstrap, settings.topic_action_tracked, track_favorites=True)
    job = Job(settings, services.run_dir / "steady.log", tail=True)
    factory = EnvelopeFactory(sessions, rng, settings.topic_favorite_added,
                              settings.topic_favorite_removed)
    prod = producer(services.bootstrap, **{"linger.ms": 5})
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
        sampler = CpuSampler.of(services, job)
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
    finally:
        counter.close()
        job.stop()
    latencies = sorted(1000 * (counter.arrivals[f] - t) for f, t in sent_at.items()
                       if f in counter.arrivals)
    result = {
        "target_rate": rate, "seconds": seconds, "produced": sent,
        "produced_rate": round(sent / produce_s, 1), "kinds": kinds,
        "expected_outputs": len(sent_at), "received_outputs": len(latencies),
        "outputs_total_on_topic": counter.count - warm_count, "job_ready_s": round(ready_s, 2),
        **{f"p{q}_ms": _percentile(latencies, q / 100) for q in (50, 95, 99)},
        "max_ms": _percentile(latencies, 1.0), "min_ms": _percentile(latencies, 0.0),
        "resources": cpu, "ok": len(latencies) == len(sent_at) > 0}
    log(f"  steady: {result['produced_rate']}/s, p50 {result['p50_ms']} ms, p95 "
        f"{result['p95_ms']} ms, p99 {result['p99_ms']} ms, got {len(latencies)}/{len(sent_at)}")
    return result


def dedup_and_restart(services: Services, sessions: Sequence[Session], db_url: str, *, ids: int,
                      owners: int, restart_backlog: int, rng: random.Random, log: Log,
                      settle: bool = True) -> tuple[dict[str, Any], dict[str, Any]]:
    """RSS of the job holding ``ids`` MessageIds in its dedup window, then restart after SIGKILL.

    The job runs with recovery (snapshots every 5 s). ``ids`` distinct valid messages of
    ``owners`` devices without a session: each is kept by the dedup window and skipped at once
    (``favorites_session_wait_seconds=0``), no row is written.
    Then SIGKILL, ``restart_backlog`` messages produced while it is down, and a restart on the
    same recovery store: the time to the last expected action-tracked.
    """
    settings = services.settings("recovery", db_url, favorites_session_wait_seconds=0)
    recovery_dir = services.run_dir / "recovery"
    devices = [_uuid4(rng) for _ in range(owners)]
    factory = EnvelopeFactory(sessions, rng, settings.topic_favorite_added,
                              settings.topic_favorite_removed)

    def dedup_records() -> Iterator[OutRecord]:
        for i in range(ids):
            envelope, favorite_id = factory.envelope(None, devices[i % owners])
            yield OutRecord(factory.topic(), favorite_id.encode(), orjson.dumps(envelope), (),
                            favorite_id, "no-session")

    t0 = time.monotonic()
    produce_all(services.bootstrap, dedup_records())
    dedup: dict[str, Any] = {"ids": ids, "owners": owners,
                             "produce_s": round(time.monotonic() - t0, 1)}
    log(f"  dedup: produced {ids:,} messages over {owners:,} owners in {dedup['produce_s']}s")
    job = Job(settings, services.run_dir / "recovery-1.log", tail=True, recovery_dir=recovery_dir)
    sampler = CpuSampler.of(services, job)
    t_done, last = None, None
    while time.monotonic() - job.started < max(300.0, ids / 500) and job.running:
        last = job.scrape(timeout=2.0) or last
        if metric_sum(last, SKIPPED, reason="no-session") >= ids:
            t_done = time.monotonic()
            break
        time.sleep(0.5 if last is None or ids < 100_000 else 2.0)  # scraping costs the job CPU
    dedup["resources"] = sampler.stop()
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
        events_per_s=round(ids / (t_done - job.started), 1), rss_mb_when_done=rss_done,
        rss_mb=job.rss_mb(), hwm_mb=job.hwm_mb(), recovery_store_mb=round(sum(
            p.stat().st_size for p in recovery_dir.rglob("*") if p.is_file()) / 2**20, 1))
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
        "rss_mb_after_restore": job2.rss_mb(), "ok": caught is not None}
    if caught is None:
        restart.update(failure=f"{counter.count}/{expected} out", log_tail=job2.log_tail(20))
    counter.close()
    job2.stop()
    log(f"  restart: caught up on {restart_backlog:,} in {restart['caught_up_s']}s "
        f"(startup {restart['startup_s']}s, first output {restart['first_output_s']}s)")
    return dedup, restart
