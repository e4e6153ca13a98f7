"""``python -m bench``: the favorites flow end to end on real Kafka + PostgreSQL, in one run.

One template database holds ``--sessions`` sessions and ``--rows`` action_events rows; every phase
runs on a copy of it: a warm-up job run (recorded apart), ``job`` (``-w`` of ``--workers``, then
``-i/-a`` clusters of ``--processes``, on a ``--messages`` backlog), ``scale`` (``-w 1`` on a
template of ``--scale-rows`` rows), ``naive``, ``ceiling``, ``peer`` (Quix Streams), ``steady``
(latency while tailing), ``dedup`` (RSS with ``--dedup-ids`` ids, then SIGKILL and restart);
``timing`` only when named (bench/timing.py). ``--compare REF`` adds an interleaved A/B of the
``-w 1`` job against commit REF. Prints one table; writes ``--out`` (``bench/results.json``) with
``targets``, the ``scale`` curve (other row counts' points kept from the file it replaces) and that
file's sections of phases this run did not run (``meta.carried_over``). Exit 1 if a phase failed.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import random
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench import phases
from bench.baselines import run_ceiling, run_naive, run_peer
from bench.report import carry_over, evaluate, merge_scale, print_table
from bench.services import CpuSampler, Services, cpu_us_per_event, kill_all_jobs
from bench.timing import CONTRACTS, print_timing, run_timing
from bench.workload import EnvelopeFactory, make_backlog, make_sessions, prefill, produce_all
from cli.migrate import apply_migrations
from runtime.settings import Settings

DEFAULT_PHASES = ("job", "scale", "naive", "ceiling", "peer", "steady", "dedup")
ALL_PHASES = (*DEFAULT_PHASES, "timing")
SIZES: dict[str, tuple[float, float, str]] = {  # the full run's, --small's, what it is
    "messages": (1_000_000, 2_000, "backlog size"), "sessions": (100_000, 500, "seeded sessions"),
    "steady_rate": (2000.0, 200.0, "events/s"), "steady_seconds": (60.0, 5.0, ""),
    "dedup_ids": (1_000_000, 5_000, "MessageIds in the window"),
    "dedup_owners": (10_000, 100, "owners they spread over"),
    "rows": (2_000_000, 5_000, "prefilled action_events rows"),
    "scale_rows": (10_000_000, 20_000, "prefilled rows of the scale phase"),
    "restart_backlog": (50_000, 1_000, "messages to catch up"),
    "naive_seconds": (20.0, 3.0, "naive run time bound"),
    "job_timeout": (900.0, 120.0, "per job run, s"),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; sizes not given come from the full (or ``--small``) defaults."""
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    for key, (full, _small, what) in SIZES.items():
        parser.add_argument(f"--{key.replace('_', '-')}", type=type(full),
                            help=f"{what} (default {full:g})")
    parser.add_argument("--workers", default="1,2", help="job worker counts (default 1,2)")
    parser.add_argument("--processes", default="2",
                        help="job cluster sizes, one worker per process (default 2; empty: none)")
    parser.add_argument("--phases", default=",".join(DEFAULT_PHASES),
                        help=f"comma list of {', '.join(ALL_PHASES)} (default: all but timing)")
    parser.add_argument("--timing-rounds", type=int, default=3,
                        help="timing: rounds of each contract (default 3)")
    parser.add_argument("--timing-contracts", default="", metavar="NAME,...",
                        help="timing: only these contracts (default all: "
                             f"{', '.join(c.name for c in CONTRACTS)})")
    parser.add_argument("--small", action="store_true", help="tiny sizes (the test suite's)")
    parser.add_argument("--external", action="store_true",
                        help="use USER_ACTIVITY_KAFKA_BOOTSTRAP_SERVERS / _DATABASE_URL")
    parser.add_argument("--no-warmup", action="store_true",
                        help="no warm-up job run (the broker's JIT then counts in the first)")
    parser.add_argument("--compare", metavar="REF", default="",
                        help="also run the -w 1 job at commit REF against this tree, "
                             "interleaved (--compare-rounds each), and report the ratios")
    parser.add_argument("--compare-env", default="", metavar="K=V,...",
                        help="environment of the reference run (with or without --compare); "
                             "OTEL_EXPORTER_OTLP_ENDPOINT=receiver: a local OTLP receiver")
    parser.add_argument("--compare-rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results.json")
    args = parser.parse_args(argv)
    for key, (full, small, _what) in SIZES.items():
        if getattr(args, key) is None:
            setattr(args, key, small if args.small else full)
    args.workers = [int(w) for w in str(args.workers).split(",") if w]
    args.processes = [int(p) for p in str(args.processes).split(",") if p]
    if any(p < 2 for p in args.processes):
        parser.error("--processes: a cluster has 2 processes or more")
    args.phases = [p for p in str(args.phases).split(",") if p]
    if unknown := set(args.phases) - set(ALL_PHASES):
        parser.error(f"unknown phases: {sorted(unknown)}")
    args.timing_contracts = [c for c in str(args.timing_contracts).split(",") if c]
    if unknown := set(args.timing_contracts) - {c.name for c in CONTRACTS}:
        parser.error(f"unknown timing contracts: {sorted(unknown)}")
    return args


def log(message: str) -> None:
    """Progress on stderr (the table goes to stdout)."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _code_version() -> dict[str, Any]:
    """The commit the job ran from and the production files changed on top of it."""

    def git(*args: str) -> str:
        with contextlib.suppress(OSError):
            return subprocess.run(["git", *args], cwd=Path(__file__).parent.parent, text=True,
                                  capture_output=True, timeout=10, check=False).stdout
        return ""

    changed = [line[3:] for line in git("status", "--porcelain").splitlines()
               if len(line) > 3 and not line[3:].startswith(("bench/", "tests/"))]
    return {"commit": git("rev-parse", "--short", "HEAD").strip(),
            "uncommitted_production_changes": changed}


class _Run:
    """One benchmark run: the services, the template database, the backlog and the results."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.run_id = args, f"{int(time.time()) % 100000:05d}{uuid.uuid4().hex[:4]}"
        self.rng, self.services = random.Random(args.seed), Services(args.external, self.run_id)
        self.results: dict[str, Any] = {"meta": {
            "started_at": datetime.now(UTC).isoformat(timespec="seconds"), "run_id": self.run_id,
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                        "load_avg_before": list(os.getloadavg())},
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "code": _code_version()}}
        self.failed = False
        self.main_db: str | None = None

    def start_services(self) -> None:
        """The run's Kafka and PostgreSQL (or the external ones)."""
        meta, services = self.results["meta"], self.services
        log(f"run {self.run_id}: starting services (external={self.args.external})")
        meta["service_start"] = services.start()
        meta["broker_jvm"] = None if services.broker is None else list(services.broker.jvm_options)
        meta["postgres"] = services.durability()
        if meta["postgres"]["fsync"] != "on":
            log(f"WARNING: PostgreSQL runs with {meta['postgres']}: the naive consumer's rate "
                "and the WAL figures do not measure durable commits")

    def setup(self) -> None:
        """The template database (sessions, prefilled rows), the backlog produced."""
        args, services = self.args, self.services
        log(f"template database: {args.sessions:,} sessions, {args.rows:,} action_events rows")
        self.sessions = make_sessions(args.sessions, self.rng)
        template_url = services.create_database("tpl")
        apply_migrations(template_url)
        t0 = time.monotonic()
        self.results["prefill"] = prefill(template_url, self.sessions, args.rows, log=log)
        self.results["prefill"]["total_s"] = round(time.monotonic() - t0, 1)
        self.input = services.settings("backlog", template_url)
        factory = EnvelopeFactory(self.sessions, self.rng, self.input.topic_favorite_added,
                                  self.input.topic_favorite_removed)
        t0 = time.monotonic()
        self.backlog = make_backlog(factory, args.messages, self.rng)
        t1 = time.monotonic()
        produce_all(services.bootstrap, self.backlog.records)
        self.results["backlog"] = {**self.backlog.summary(), "generate_s": round(t1 - t0, 1),
                                   "produce_s": round(time.monotonic() - t1, 1)}
        log(f"backlog: {self.results['backlog']}")

    def on_copy(self, name: str, measure: Callable[[str], Any], *, keep: bool = False) -> Any:
        """``measure`` on a fresh copy of the template database (dropped unless ``keep``)."""
        db = self.services.create_database(name, template="tpl")
        try:
            return measure(db)
        finally:
            if keep and self.main_db is None:
                self.main_db = db  # the tailing phases' (new topics, new ids)
            else:
                self.services.drop_database(name)

    def job(self, name: str, workers: int, db: str, rows: int | None = None, *,
            processes: int = 1) -> dict[str, Any]:
        """The bounded job on the backlog, in ``db`` prefilled with ``rows`` (``--rows``)."""
        run = phases.job_backlog(self.services, self.input, self.backlog, db, name=name,
                                 workers=workers, prefill_rows=rows or self.args.rows,
                                 timeout=self.args.job_timeout, log=log, processes=processes)
        self.failed |= not run["ok"]
        return run

    def phase_warmup(self) -> None:
        """A ``-w 1`` run first: the fresh broker JVM compiles its hot paths in its first one."""
        run = self.on_copy("warmup", lambda db: self.job("warmup_w1", 1, db))
        self.results["warmup"] = {k: run.get(k) for k in (
            "events_per_s", "cpu_us_per_event", "first_output_s", "ok")}

    def phase_job(self) -> None:
        """``-w N`` of each ``--workers``, then a cluster of each ``--processes`` of ``-w 1``."""
        self.results["job"] = {}
        for workers in self.args.workers:
            name = f"job_w{workers}"
            self.results["job"][f"workers_{workers}"] = self.on_copy(
                name, functools.partial(self.job, name, workers), keep=True)
        for processes in self.args.processes:
            name = f"job_p{processes}"
            self.results["job"][f"processes_{processes}"] = self.on_copy(
                name, functools.partial(self.job, name, 1, processes=processes))

    def phase_scale(self) -> None:
        """The ``-w 1`` job on a template of ``--scale-rows`` rows: the other point of ``scale``."""
        rows, url = self.args.scale_rows, self.services.create_database("tpl_scale")
        apply_migrations(url)
        self.results["prefill_scale"] = prefill(url, self.sessions, rows, log=log)
        db = self.services.create_database("job_scale", template="tpl_scale")
        self.services.drop_database("tpl_scale")
        self.results["scale_job"] = self.job("job_scale", 1, db, rows)
        self.services.drop_database("job_scale")

    def phase_compare(self) -> None:
        args = self.args
        ref_env = dict(item.split("=", 1) for item in args.compare_env.split(",") if item)
        with phases.otlp_receiver_for(ref_env) as receiver:
            found = phases.compare_jobs(
                self.services, self.input, self.backlog, ref=args.compare, ref_env=ref_env,
                rounds=args.compare_rounds, prefill_rows=args.rows, timeout=args.job_timeout,
                log=log)
            if receiver is not None:
                found["otlp_receiver"] = {"requests": receiver.requests, "bytes": receiver.bytes}
        self.results["compare"] = found
        log(f"  compare: {found}")
        self.failed |= "failure" in found

    def phase_naive(self) -> None:
        def measure(db: str) -> dict[str, Any]:
            sampler = CpuSampler(self.services)
            result = run_naive(self.input, db, self.args.naive_seconds, len(self.backlog.records))
            result["resources"] = resources = sampler.stop()
            result["cpu_us_per_event"] = cpu_us_per_event(
                {**resources, "job_cpu_s": resources["bench_cpu_s"]}, result["processed"])
            return result

        self.results["naive"] = self.on_copy("naive", measure)
        log(f"  naive: {self.results['naive']['events_per_s']} ev/s")

    def phase_ceiling(self) -> None:
        self.results["ceiling"] = self.on_copy("ceiling", lambda db: run_ceiling(
            self.backlog, self.input, db, self.services))
        log(f"  ceiling: {self.results['ceiling']['events_per_s']} ev/s")

    def phase_peer(self) -> None:
        self.results["peer"] = peer = self.on_copy("peer", lambda db: run_peer(
            self.services, self.input, self.backlog, db, prefill_rows=self.args.rows,
            timeout=self.args.job_timeout,
            dedup_ttl_s=Settings.model_fields["dedup_ttl_seconds"].default))
        self.failed |= not peer["ok"]
        log(f"  peer: {peer['events_per_s']} ev/s, CPU µs/event {peer['cpu_us_per_event']}")

    def tail_db(self) -> str:
        """The database the tailing phases share (the first job run's, else a new copy)."""
        if self.main_db is None:
            self.main_db = self.services.create_database("main", template="tpl")
        return self.main_db

    def phase_steady(self) -> None:
        self.results["steady"] = steady = phases.steady_state(
            self.services, self.sessions, self.tail_db(), rate=self.args.steady_rate,
            seconds=self.args.steady_seconds, rng=self.rng, log=log)
        self.failed |= not steady["ok"]

    def phase_dedup(self) -> None:
        args = self.args
        dedup, restart = phases.dedup_and_restart(
            self.services, self.sessions, self.tail_db(), ids=args.dedup_ids,
            owners=args.dedup_owners, restart_backlog=args.restart_backlog, rng=self.rng,
            log=log, settle=not args.small)
        self.results["dedup"], self.results["restart"] = dedup, restart
        self.failed |= not (dedup["ok"] and restart["ok"])

    def phase_timing(self) -> None:
        args = self.args
        self.results["timing"] = timing = run_timing(
            self.services, rounds=args.timing_rounds, only=args.timing_contracts,
            restart_backlog=args.restart_backlog, log=log)
        self.failed |= any(c["met"] == "failed" for c in timing["contracts"].values())

    def execute(self) -> None:
        """Every phase asked for, in order (the warm-up first when a job phase runs)."""
        self.start_services()
        wanted = [p for p in ALL_PHASES if p in self.args.phases]
        if set(wanted) - {"timing"} or self.args.compare or self.args.compare_env:
            self.setup()
        if self.args.compare or self.args.compare_env:
            wanted.insert(int("job" in wanted), "compare")
        if not self.args.no_warmup and {"job", "compare"} & set(wanted):
            wanted.insert(0, "warmup")
        for name in wanted:
            log(f"phase {name}")
            getattr(self, f"phase_{name}")()


def _terminate(_signum: int, _frame: Any) -> None:
    raise SystemExit(143)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; 0 when every phase ran (targets met or not), 1 on a failed phase."""
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    run = _Run(args)
    started = time.monotonic()
    try:
        run.execute()
    except BaseException as exc:
        run.results["error"] = f"{type(exc).__name__}: {exc}"
        log(f"FAILED: {run.results['error']}")
        run.failed = True
        if isinstance(exc, KeyboardInterrupt):
            raise
    finally:
        kill_all_jobs()
        with contextlib.suppress(Exception):
            run.services.close()
        results = run.results
        results["meta"] |= {"total_s": round(time.monotonic() - started, 1),
                            "load_avg_after": list(os.getloadavg())}
        previous = None
        with contextlib.suppress(OSError, ValueError):
            previous = json.loads(args.out.read_text())
        merge_scale(results, previous)
        carry_over(results, previous)
        evaluate(results)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2, default=str) + "\n")
        if set(args.phases) - {"timing"} or args.compare or args.compare_env:
            print_table(results)
        print_timing(results.get("timing") or {})
        log(f"results written to {args.out}")
    return 1 if run.failed else 0
