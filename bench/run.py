"""``python -m bench``: the favorites flow end to end on real Kafka + PostgreSQL, in one run.

Phases (all against copies of one template database that already holds ``--prefill-rows``
action_events rows; Kafka, PostgreSQL, the job and the benchmark share the machine's cores):

1. ``job``: the real job, ``python -m bytewax.run dataflows.favorite_actions:flow`` (bounded,
   ``tail=False``) with ``-w 1`` and ``-w 2``, on a backlog of ``--messages`` envelopes, until every
   row is committed and every action-tracked message is on the output topic;
2. ``naive``: one consumer + psycopg, one transaction per message, the same SQL, for
   ``--naive-seconds`` (rate extrapolated to the backlog);
3. ``ceiling``: ``FavoritesStore.record_batch`` fed pre-decoded batches of 1000 (no Kafka, no
   Bytewax); then the outbox publisher's per-row cost (mark published vs delete) on its rows;
4. ``steady``: ``--steady-rate`` events/s for ``--steady-seconds`` while the job tails;
   CreatedAt -> action-tracked arrival latency;
5. ``dedup``: RSS of the job holding ``--dedup-ids`` MessageIds, then SIGKILL and the time from
   restart to caught-up on ``--restart-backlog`` messages (recovery ``-r DIR -s 5``);
6. ``profile`` (with ``--profile``): one more bounded job run under py-spy.

Prints one table; writes ``--out`` (default ``bench/results.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import signal
import sys
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench import phases
from bench.ceiling import decode_backlog, outbox_publish_cost, run_ceiling
from bench.jobproc import CpuSampler, kill_all_jobs
from bench.naive import run_naive
from bench.prefill import prefill
from bench.profile import summarize
from bench.report import evaluate, print_table
from bench.services import Services
from bench.workload import EnvelopeFactory, make_backlog, make_sessions, produce_all

ALL_PHASES = ("job", "naive", "ceiling", "steady", "dedup")

FULL = {
    "messages": 200_000, "sessions": 100_000, "steady_rate": 2000.0, "steady_seconds": 60.0,
    "dedup_ids": 1_000_000, "dedup_owners": 10_000, "prefill_rows": 2_000_000,
    "restart_backlog": 50_000, "naive_seconds": 20.0, "job_timeout": 900.0,
}
SMALL = {
    "messages": 2_000, "sessions": 500, "steady_rate": 200.0, "steady_seconds": 5.0,
    "dedup_ids": 5_000, "dedup_owners": 100, "prefill_rows": 5_000,
    "restart_backlog": 1_000, "naive_seconds": 3.0, "job_timeout": 120.0,
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; sizes not given come from the full (or ``--small``) defaults."""
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, help="backlog size (default 200000)")
    parser.add_argument("--sessions", type=int, help="seeded sessions (default 100000)")
    parser.add_argument("--steady-rate", type=float, help="events/s (default 2000)")
    parser.add_argument("--steady-seconds", type=float, help="(default 60)")
    parser.add_argument("--dedup-ids", type=int, help="MessageIds in the window (default 1M)")
    parser.add_argument("--dedup-owners", type=int, help="owners they spread over (default 10k)")
    parser.add_argument("--prefill-rows", type=int, help="action_events rows (default 2M)")
    parser.add_argument("--restart-backlog", type=int, help="messages to catch up (default 50k)")
    parser.add_argument("--naive-seconds", type=float, help="naive run time bound (default 20)")
    parser.add_argument("--job-timeout", type=float, help="per job run (default 900 s)")
    parser.add_argument("--workers", default="1,2", help="job worker counts (default 1,2)")
    parser.add_argument("--phases", default=",".join(ALL_PHASES),
                        help=f"comma list of {', '.join(ALL_PHASES)}")
    parser.add_argument("--small", action="store_true", help="tiny sizes (the test suite's)")
    parser.add_argument("--external", action="store_true",
                        help="use USER_ACTIVITY_KAFKA_BOOTSTRAP_SERVERS / _DATABASE_URL")
    parser.add_argument("--profile", action="store_true",
                        help="one more job run under py-spy (svg + raw in --profile-dir)")
    parser.add_argument("--compare", metavar="REF", default="",
                        help="also run the -w 1 job at commit REF against this tree, "
                             "interleaved (--compare-rounds each), and report the ratio")
    parser.add_argument("--compare-env", default="", metavar="K=V,...",
                        help="environment of the reference run (with or without --compare)")
    parser.add_argument("--compare-rounds", type=int, default=3)
    parser.add_argument("--profile-dir", type=Path, default=Path("/tmp/bench-profile"))  # noqa: S108
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results.json")
    args = parser.parse_args(argv)
    defaults = SMALL if args.small else FULL
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.workers = [int(w) for w in str(args.workers).split(",") if w]
    args.phases = [p for p in str(args.phases).split(",") if p]
    unknown = set(args.phases) - set(ALL_PHASES)
    if unknown:
        parser.error(f"unknown phases: {sorted(unknown)}")
    return args


def log(message: str) -> None:
    """Progress on stderr (the table goes to stdout)."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _code_version() -> dict[str, Any]:
    """The commit the job ran from and the production files changed on top of it."""
    import subprocess

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=Path(__file__).parent.parent, text=True,
                                  capture_output=True, timeout=10, check=False).stdout
        except OSError:
            return ""

    changed = [line[3:] for line in git("status", "--porcelain").splitlines()
               if len(line) > 3 and not line[3:].startswith(("bench/", "tests/"))]
    return {"commit": git("rev-parse", "--short", "HEAD").strip(),
            "uncommitted_production_changes": changed}


def _terminate(_signum: int, _frame: Any) -> None:
    raise SystemExit(143)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; 0 when every phase ran (targets met or not), 1 on a failed phase."""
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    run_id = f"{int(time.time()) % 100000:05d}{uuid.uuid4().hex[:4]}"
    rng = random.Random(args.seed)
    results: dict[str, Any] = {
        "meta": {
            "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "run_id": run_id,
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                        "load_avg_before": list(os.getloadavg())},
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "code": _code_version(),
        },
    }
    services = Services(args.external, run_id)
    started = time.monotonic()
    failed = False
    try:
        log(f"run {run_id}: starting services (external={args.external})")
        results["meta"]["service_start"] = services.start()
        results["meta"]["postgres"] = services.durability()
        if results["meta"]["postgres"]["fsync"] != "on":
            log(f"WARNING: PostgreSQL runs with {results['meta']['postgres']}: the naive "
                "consumer's rate and the WAL figures do not measure durable commits")

        log(f"template database: migrate, {args.sessions:,} sessions, "
            f"{args.prefill_rows:,} action_events rows")
        sessions = make_sessions(args.sessions, rng)
        template_url = services.create_database("tpl")
        services.migrate(template_url)
        t0 = time.monotonic()
        setup = prefill(template_url, sessions, args.prefill_rows, log=log)
        setup["total_s"] = round(time.monotonic() - t0, 1)
        results["prefill"] = setup
        log(f"prefill done in {setup['total_s']}s ({setup.get('database_mb')} MB)")

        input_settings = services.settings("backlog", template_url)
        factory = EnvelopeFactory(sessions, rng, input_settings.topic_favorite_added,
                                  input_settings.topic_favorite_removed)
        t0 = time.monotonic()
        backlog = make_backlog(factory, args.messages, rng)
        gen_s = time.monotonic() - t0
        t0 = time.monotonic()
        produce_all(services.bootstrap, backlog.records)
        produce_s = time.monotonic() - t0
        results["backlog"] = {**backlog.summary(), "generate_s": round(gen_s, 1),
                              "produce_s": round(produce_s, 1)}
        log(f"backlog: {backlog.summary()} produced in {produce_s:.1f}s")

        main_db: str | None = None
        if "job" in args.phases:
            results["job"] = {}
            for workers in args.workers:
                name = f"job_w{workers}"
                log(f"phase {name}")
                db = services.create_database(name, template="tpl")
                results["job"][f"workers_{workers}"] = phases.job_backlog(
                    services, input_settings, backlog, db, name=name, workers=workers,
                    prefill_rows=args.prefill_rows, timeout=args.job_timeout, log=log)
                failed |= not results["job"][f"workers_{workers}"]["ok"]
                if main_db is None:
                    main_db = db  # reused by the tailing phases (new topics, new ids)
                else:
                    services.drop_database(name)

        if args.compare or args.compare_env:
            ref_env = dict(item.split("=", 1) for item in args.compare_env.split(",") if item)
            log(f"phase compare (this tree vs {args.compare or 'this tree'} {ref_env}, "
                f"{args.compare_rounds} rounds)")
            results["compare"] = phases.compare_jobs(
                services, input_settings, backlog, ref=args.compare, ref_env=ref_env,
                rounds=args.compare_rounds, prefill_rows=args.prefill_rows,
                timeout=args.job_timeout, log=log)
            log(f"  compare: {results['compare']}")
            failed |= "failure" in results["compare"]

        if "naive" in args.phases:
            log(f"phase naive ({args.naive_seconds:.0f}s bound)")
            db = services.create_database("naive", template="tpl")
            sampler = CpuSampler(None, services.postmaster_pid, services.kafka_pid)
            results["naive"] = run_naive(input_settings, db, args.naive_seconds,
                                         len(backlog.records))
            results["naive"]["resources"] = sampler.stop()
            log(f"  naive: {results['naive']['events_per_s']} ev/s over "
                f"{results['naive']['processed']:,} messages")
            services.drop_database("naive")

        if "ceiling" in args.phases:
            log("phase ceiling")
            db = services.create_database("ceiling", template="tpl")
            messages, decode_rates = decode_backlog(
                backlog, input_settings.topic_favorite_added,
                input_settings.topic_favorite_removed)
            results["ceiling"] = run_ceiling(
                messages, input_settings.topic_action_tracked, db,
                sampler=lambda: CpuSampler(None, services.postmaster_pid, services.kafka_pid))
            results["ceiling"]["decode_outside_timing"] = decode_rates
            log(f"  ceiling: {results['ceiling']['events_per_s']} ev/s")
            results["outbox_publish_db_cost"] = outbox_publish_cost(db)
            log(f"  outbox db cost: {results['outbox_publish_db_cost']}")
            services.drop_database("ceiling")

        if main_db is None and {"steady", "dedup"} & set(args.phases):
            main_db = services.create_database("main", template="tpl")

        if "steady" in args.phases and main_db is not None:
            log(f"phase steady ({args.steady_rate:.0f}/s for {args.steady_seconds:.0f}s)")
            results["steady"] = phases.steady_state(
                services, sessions, main_db, rate=args.steady_rate,
                seconds=args.steady_seconds, rng=rng, log=log)
            failed |= not results["steady"]["ok"]

        if "dedup" in args.phases and main_db is not None:
            log(f"phase dedup ({args.dedup_ids:,} ids) + restart after SIGKILL")
            results["dedup"], results["restart"] = phases.dedup_and_restart(
                services, sessions, main_db, ids=args.dedup_ids, owners=args.dedup_owners,
                restart_backlog=args.restart_backlog, rng=rng, log=log, settle=not args.small)
            failed |= not (results["dedup"]["ok"] and results["restart"]["ok"])

        if args.profile:
            log("phase profile (py-spy on a -w 1 job run; not a measured number)")
            db = services.create_database("profile", template="tpl")
            run = phases.job_backlog(
                services, input_settings, backlog, db, name="profile_w1", workers=1,
                prefill_rows=args.prefill_rows, timeout=args.job_timeout, log=log,
                profile_dir=args.profile_dir)
            raw = args.profile_dir / "profile_w1.txt"
            results["profile"] = {
                "events_per_s_under_py_spy": run["events_per_s"],
                "svg": str(args.profile_dir / "profile_w1.svg"),
                "raw": str(raw),
                **(summarize(raw) if raw.exists() else {"error": "no py-spy output"}),
            }
            services.drop_database("profile")
    except BaseException as exc:
        results["error"] = f"{type(exc).__name__}: {exc}"
        log(f"FAILED: {results['error']}")
        failed = True
        if isinstance(exc, KeyboardInterrupt):
            raise
    finally:
        kill_all_jobs()
        with contextlib.suppress(Exception):
            services.close()
        results["meta"]["total_s"] = round(time.monotonic() - started, 1)
        results["meta"]["load_avg_after"] = list(os.getloadavg())
        evaluate(results)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2, default=str) + "\n")
        print_table(results)
        log(f"results written to {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
