"""Attribute the job's RSS after the dedup burst: ``python -m bench.rss_attrib``.

Starts its own Kafka + PostgreSQL, then for each variant of :data:`bench.phases.RSS_VARIANTS`
(``--variants``) runs :func:`bench.phases.dedup_fill` (``--ids`` distinct ids over ``--owners``
owners, recovery on unless the variant turns it off) with the in-process probe
(``bench/memprobe/sitecustomize.py``) loaded, and asks it, once the burst is processed and a
snapshot taken: stats (RSS anon/file, threads, glibc ``mallinfo2`` + per-arena
``malloc_info``, pymalloc arenas, anonymous mappings, Python object counts), then
``malloc_trim(0)`` and the stats again; then ``--idle`` seconds later, RSS once more.
Writes ``--out`` (JSON) and prints one line per variant.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psycopg

from bench import phases
from bench.jobproc import ROOT, JobProcess, kill_all_jobs
from bench.prefill import prefill
from bench.run import log
from bench.services import Services
from bench.workload import EnvelopeFactory, make_backlog, make_sessions, produce_all

PROBE_PATH = ROOT / "bench" / "memprobe"


def ask(job: JobProcess, probe_dir: Path, commands: str, timeout: float = 60.0) -> dict[str, Any]:
    """Send ``commands`` to the job's probe thread; its JSON answer."""
    resp = probe_dir / f"{job.pid}.resp.json"
    resp.unlink(missing_ok=True)
    (probe_dir / f"{job.pid}.req").write_text(commands)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if resp.exists():
            return json.loads(resp.read_text())  # type: ignore[no-any-return]
        time.sleep(0.2)
    return {"error": "probe timeout"}


def _sample_rss(job: JobProcess, out: list[tuple[float, float]]) -> None:
    """VmRSS of ``job`` every 20 ms until it exits: (seconds since spawn, MB)."""
    while job.alive():
        rss = job.rss_mb()
        if rss is not None:
            out.append((round(time.monotonic() - job.started, 2), round(rss, 1)))
        time.sleep(0.02)


def _with_env(env: dict[str, str], samples: list[tuple[float, float]] | None = None) -> Any:
    """A context manager: every JobProcess started inside gets ``env`` (and an RSS sampler)."""
    from bench import jobproc

    original_init = jobproc.JobProcess.__init__

    def patched(self: Any, *a: Any, **kw: Any) -> None:
        kw["extra_env"] = {**env, **(kw.get("extra_env") or {})}
        original_init(self, *a, **kw)
        if samples is not None:
            threading.Thread(target=_sample_rss, args=(self, samples), daemon=True).start()

    @contextlib.contextmanager
    def manager() -> Any:
        jobproc.JobProcess.__init__ = patched  # type: ignore[method-assign]
        try:
            yield
        finally:
            jobproc.JobProcess.__init__ = original_init  # type: ignore[method-assign]

    return manager()


def restart(services: Services, tpl: str, sessions: list[Any], args: argparse.Namespace,
            rng: random.Random) -> dict[str, Any]:
    """``phases.dedup_and_restart`` per variant (the bench's dedup phase, same settle)."""
    out: dict[str, Any] = {}
    for name in [v for v in args.variants.split(",") if v]:
        env = dict(phases.RSS_VARIANTS[name])
        env.pop("_RECOVERY", None)
        db = _create(services, f"rs_{name}"[:40])
        probe_dir = services.run_dir / "memprobe"
        probe_dir.mkdir(exist_ok=True)
        env.update(PYTHONPATH=str(PROBE_PATH), MEMPROBE_DIR=str(probe_dir))
        probes: dict[str, Any] = {}
        original_stop = JobProcess.stop

        def stop(self: JobProcess, timeout: float = 15.0, *, _probes: dict[str, Any] = probes,
                 _dir: Path = probe_dir, _stop: Any = original_stop) -> int | None:
            # the restarted job, right after it caught up (where the phase reads its RSS)
            _probes[self.log_path.name] = ask(self, _dir, "stats trim collect")
            return _stop(self, timeout)  # type: ignore[no-any-return]

        JobProcess.stop = stop  # type: ignore[method-assign]
        try:
            with _with_env(env):
                dedup, rest = phases.dedup_and_restart(
                    services, sessions, db, ids=args.ids, owners=args.owners,
                    restart_backlog=args.restart, rng=rng, log=log)
        finally:
            JobProcess.stop = original_stop  # type: ignore[method-assign]
        services.drop_database(f"rs_{name}"[:40])
        out[name] = {
            "dedup": {k: dedup.get(k) for k in (
                "ok", "rss_mb_when_done", "rss_mb", "hwm_mb", "events_per_s", "failure")},
            "restart": {k: rest.get(k) for k in (
                "ok", "rss_mb_after_restore", "caught_up_s", "startup_s", "failure",
                "log_tail")},
            "probes": probes,
        }
        log(f"  {name}: {out[name]}")
        args.out.write_text(json.dumps(out, indent=1, default=str) + "\n")
    return out


def _create(services: Services, name: str) -> str:
    for attempt in range(30):  # the template is briefly busy after the prefill
        try:
            return services.create_database(name, template="tpl")
        except psycopg.errors.ObjectInUse:
            if attempt == 29:
                raise
            gc.collect()  # a migration connection still open in this process
            time.sleep(1)
    raise AssertionError


def throughput(services: Services, tpl: str, sessions: list[Any], args: argparse.Namespace,
               rng: random.Random) -> dict[str, list[dict[str, Any]]]:
    """``phases.job_backlog`` per variant (the variant's env added to the job's), interleaved."""
    from bench import jobproc

    input_settings = services.settings("backlog", tpl)
    factory = EnvelopeFactory(sessions, rng, input_settings.topic_favorite_added,
                              input_settings.topic_favorite_removed)
    backlog = make_backlog(factory, args.throughput, rng)
    produce_all(services.bootstrap, backlog.records)
    original_init = jobproc.JobProcess.__init__
    runs: dict[str, list[dict[str, Any]]] = {}
    variants = [v for v in args.variants.split(",") if v]
    for i in range(args.repeat):
        for name in variants:
            env = dict(phases.RSS_VARIANTS[name])
            env.pop("_RECOVERY", None)

            samples: list[tuple[float, float]] = []

            def patched(self: Any, *a: Any, _env: dict[str, str] = env,
                        _samples: list[tuple[float, float]] = samples, **kw: Any) -> None:
                kw["extra_env"] = {**_env, **(kw.get("extra_env") or {})}
                original_init(self, *a, **kw)
                threading.Thread(target=_sample_rss, args=(self, _samples), daemon=True).start()

            jobproc.JobProcess.__init__ = patched  # type: ignore[method-assign]
            run_name = f"tp_{i}_{name}"[:40]
            db = ""
            for attempt in range(30):
                try:
                    db = services.create_database(run_name, template="tpl")
                    break
                except psycopg.errors.ObjectInUse:
                    if attempt == 29:
                        raise
                    gc.collect()
                    time.sleep(1)
            try:
                result = phases.job_backlog(
                    services, input_settings, backlog, db, name=run_name, workers=1,
                    prefill_rows=args.prefill_rows, timeout=600, log=log)
            finally:
                jobproc.JobProcess.__init__ = original_init  # type: ignore[method-assign]
                services.drop_database(run_name)
            row = {k: result.get(k) for k in (
                "ok", "events_per_s", "wall_s", "job_peak_rss_mb", "resources", "failure")}
            if samples:
                peak_t, peak = max(samples, key=lambda x: x[1])
                row["sampled_rss"] = {"peak_mb": peak, "peak_at_s": peak_t,
                                      "last_at_s": samples[-1][0], "last_mb": samples[-1][1],
                                      "timeline": samples[:: max(1, len(samples) // 60)]}
            runs.setdefault(name, []).append(row)
            log(f"  {name} #{i}: {result.get('events_per_s')} ev/s, peak RSS "
                f"{result.get('job_peak_rss_mb')} MB")
            args.out.write_text(json.dumps(runs, indent=1, default=str) + "\n")
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.rss_attrib", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ids", type=int, default=1_000_000)
    parser.add_argument("--owners", type=int, default=10_000)
    parser.add_argument("--variants", default="production")
    parser.add_argument("--idle", type=float, default=20.0, help="seconds before a last RSS")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--throughput", type=int, default=0, metavar="MESSAGES",
                        help="instead: the bounded job phase (-w 1) on a backlog of MESSAGES, "
                             "once per variant per --repeat, interleaved (ev/s, peak RSS)")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--restart", type=int, default=0, metavar="BACKLOG",
                        help="instead: the bench's dedup phase (--ids, then SIGKILL and restart "
                             "on a BACKLOG of messages) per variant; RSS when full and restored")
    parser.add_argument("--prefill-rows", type=int, default=200_000)
    parser.add_argument("--sessions", type=int, default=20_000)
    parser.add_argument("--out", type=Path, default=Path("/tmp/rss-attrib.json"))  # noqa: S108
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    services = Services(False, f"ra{int(time.time()) % 100000:05d}")
    results: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
    try:
        services.start()
        sessions = make_sessions(args.sessions if args.throughput else 1000, rng)
        tpl = services.create_database("tpl")
        services.migrate(tpl)
        prefill(tpl, sessions, args.prefill_rows if args.throughput else 10_000, log=log)
        if args.throughput:
            results["throughput"] = throughput(services, tpl, sessions, args, rng)
            return 0
        if args.restart:
            results["restart"] = restart(services, tpl, sessions, args, rng)
            return 0
        db = ""
        for attempt in range(30):  # the template is briefly busy after the prefill (autovacuum)
            try:
                db = services.create_database("main", template="tpl")
                break
            except psycopg.errors.ObjectInUse:
                if attempt == 29:
                    raise
                gc.collect()  # a migration connection still open in this process
                time.sleep(1)
        probe_dir = services.run_dir / "memprobe"
        probe_dir.mkdir()
        for name in [v for v in args.variants.split(",") if v]:
            env = dict(phases.RSS_VARIANTS[name])
            recovery = env.pop("_RECOVERY", "on") == "on"
            env.update(PYTHONPATH=str(PROBE_PATH), MEMPROBE_DIR=str(probe_dir))
            log(f"variant {name}: {env}")
            dedup, job, _settings, _dir = phases.dedup_fill(
                services, sessions, db, prefix=f"ra-{name.replace('_', '-').lower()}",
                ids=args.ids, owners=args.owners, rng=rng, log=log, extra_env=env,
                recovery=recovery)
            row: dict[str, Any] = {k: dedup.get(k) for k in (
                "ok", "rss_mb_when_done", "rss_mb", "hwm_mb", "events_per_s", "process_s",
                "recovery_store_mb", "failure", "resources")}
            if job is not None:
                row["probe"] = ask(job, probe_dir, "referrers stats trim collect")
                time.sleep(args.idle)
                row["rss_mb_idle_after_trim"] = job.rss_mb()
                job.stop()
            results[name] = row
            probe = row.get("probe", {})
            trim = probe.get("trim", {})
            stats = probe.get("stats", {})
            log(f"  {name}: rss {row['rss_mb']} (hwm {row['hwm_mb']}) -> trim "
                f"{trim.get('rss_after_mb')} in {trim.get('ms')} ms; {row['events_per_s']} ev/s;"
                f" mallinfo {stats.get('mallinfo2')}; pymalloc "
                f"{stats.get('pymalloc', {}).get('total_mb')} MB; threads "
                f"{stats.get('status', {}).get('Threads')}")
            args.out.write_text(json.dumps(results, indent=1, default=str) + "\n")
    finally:
        kill_all_jobs()
        with contextlib.suppress(Exception):
            services.close()
        args.out.write_text(json.dumps(results, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
