"""A rolling restart of the 2-process favorites cluster (k8s/statefulset-favorites.yaml), measured.

Two ``python -m bytewax.run dataflows.favorite_actions:flow -i N -a "a0;a1"`` processes tail the
topics on real Kafka and PostgreSQL, each with its own recovery directory holding its share of a
2-partition store (process 0: ``part-0``, process 1: ``part-1``, as ``init-recovery.sh`` lays out
the pods' volumes), its own HTTP port, ``-s 2``. While a paced stream is produced:

* rolling restart: SIGTERM process 1 (SIGKILL after the pod's 30 s grace period), watch what
  both processes do, restart whatever exited (as the pods' containers would be), let it resume,
  then the same for process 0;
* full stop: SIGTERM both processes at once, then start both.

What each step did (exit codes, seconds until exit, the log lines that matter, records replayed
after each start = its ``skipped-duplicate`` events) is printed (``pytest -s``) and recorded as
properties. Asserted is only what must hold: every message exactly one row, exactly one
action-tracked MessageId per row, an empty DLQ, no process left running, and a stop of one
process ending both within 10 s by the processes' own log timestamps (one host, one clock).

Bytewax 0.21.1 completes a cluster only when every worker's inputs have ended, so a SIGTERM to
ONE process used to end its inputs only: it kept running until the SIGKILL at 30 s (exit -9),
and 0.3 s later its peer died too ("pyo3_runtime.PanicException: Send thread panic", exit 1) and
both replayed from their last snapshot. runtime/cluster_stop.py passes the stop on through
PostgreSQL: now the signalled process and its peer both exit 0 within about a second, and the
restarted cluster replays nothing. SIGTERM to both at once: both exit 0 in 0.2-0.5 s.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from devenv.harness.env import base_env
from devenv.harness.jobs import ROOT, JobProcess, JobSupervisor
from devenv.harness.ports import free_port
from devenv.harness.stream import PacedProducer, Stream, good_stream
from runtime.settings import Settings
from tests.chaos import (
    assert_exact_outcome,
    count_log_events,
    count_rows,
    report,
    unpublished,
)
from tests.conftest import SettingsFactory

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]

GRACE_SECONDS = 30.0
"""The pods' terminationGracePeriodSeconds: SIGTERM, then SIGKILL."""
PEER_WATCH_SECONDS = 60.0
"""How long the other process is watched after one has exited (a liveness bound)."""
LOG_MARKERS = ("panic", "Panic", "Error", "error", "MissingPartitions", "timely")


class ClusterMember(JobProcess):
    """One process of a 2-process Bytewax cluster, on its own share of the recovery store."""

    def __init__(self, settings: Settings, workdir: Path, index: int, addresses: str) -> None:
        super().__init__(settings, workdir, snapshot_interval=2, backup_interval=10)
        self.index = index
        self.addresses = addresses
        self.share = workdir / "recovery"
        """Its share of the recovery store (the job's ``recovery_dir``)."""

    def init_recovery(self) -> None:
        """The share is placed by :func:`split_recovery_store`; never create one here."""

    def command(self) -> list[str]:
        return [*super().command(), "-i", str(self.index), "-a", self.addresses]

    def notable_lines(self, run: int, limit: int = 6) -> list[str]:
        """Non-JSON lines (Bytewax/Rust output) and error-ish JSON events of start ``run``."""
        lines = []
        for raw in self.log_paths[run - 1].read_bytes().splitlines():
            text = raw.decode(errors="replace").strip()
            if not text:
                continue
            is_json = text.startswith("{")
            if (not is_json and any(m in text for m in LOG_MARKERS)) or (
                is_json and ('"level":"ERROR"' in text or '"level":"CRITICAL"' in text
                             or "shutdown-requested" in text)
            ):
                lines.append(text[:220])
        return lines[:limit]


def split_recovery_store(members: Sequence[ClusterMember]) -> dict[str, list[str]]:
    """``init-recovery --partitions 2``, then ``part-i*`` into member i's directory."""
    scratch = members[0].workdir.parent / "recovery-scratch"
    subprocess.run(
        [sys.executable, "-m", "cli", "init-recovery", str(scratch),
         "--partitions", str(len(members))],
        cwd=ROOT, env=base_env(), check=True, capture_output=True, timeout=60,
    )
    created = sorted(p.name for p in scratch.iterdir())
    for member in members:
        member.share.mkdir(parents=True, exist_ok=True)
        for path in scratch.glob(f"part-{member.index}.sqlite3*"):
            path.rename(member.share / path.name)
    assert not list(scratch.iterdir()), "init-recovery created files no share holds"
    scratch.rmdir()
    return {"created": created, **{
        f"process_{m.index}": sorted(p.name for p in m.share.iterdir()) for m in members
    }}


def make_cluster(settings: Settings, supervisor: JobSupervisor, tmp_path: Path
                 ) -> tuple[list[ClusterMember], dict[str, list[str]]]:
    addresses = f"127.0.0.1:{free_port()};127.0.0.1:{free_port()}"
    members = [ClusterMember(settings, tmp_path / f"process-{i}", i, addresses) for i in (0, 1)]
    supervisor.jobs.extend(members)  # killed at the end, leftovers reported
    return members, split_recovery_store(members)


def start_all(members: Sequence[ClusterMember], timeout: float = 60) -> None:
    for member in members:
        member.start(wait_http=0)
    for member in members:
        member.wait_until(lambda m=member: m.get("/livez") is not None, timeout, "/livez")  # type: ignore[misc]


def exited_within(member: ClusterMember, timeout: float) -> float | None:
    """Seconds until ``member`` exited by itself (reaped), or None if still running."""
    started = time.monotonic()
    if member.wait(timeout) is None:
        return None
    return round(time.monotonic() - started, 1)


def send(members: Sequence[ClusterMember], sig: signal.Signals) -> None:
    for member in members:
        member.send_signal(sig)


def stop_like_kubernetes(stopping: Sequence[ClusterMember], others: Sequence[ClusterMember],
                         rows: Callable[[], int] | None = None) -> dict[str, Any]:
    """SIGTERM ``stopping``; SIGKILL what is left of them after the grace period.

    Meanwhile ``others`` are watched: whether (and when, after the SIGTERM) they exit too.
    """
    sent = time.monotonic()
    send(stopping, signal.SIGTERM)
    outcome: dict[str, Any] = {}
    deadline = sent + GRACE_SECONDS
    pending = {m.index: m for m in stopping}
    peers = {m.index: m for m in others}
    last_exit = sent
    while pending or peers:
        now = time.monotonic()
        for index, member in list(pending.items()):
            if not member.running:
                exited_within(member, 1.0)
                outcome[f"p{index}_sigkilled"] = False
            elif now >= deadline:
                member.kill()
                outcome[f"p{index}_sigkilled"] = True
            else:
                continue
            last_exit = time.monotonic()
            if rows is not None:
                outcome[f"rows_at_p{index}_exit"] = rows()
            outcome[f"p{index}_exit"] = member.exit_codes[-1]
            outcome[f"p{index}_exit_s"] = round(last_exit - sent, 1)
            del pending[index]
        for index, member in list(peers.items()):
            if not member.running:
                exited_within(member, 1.0)
                outcome[f"p{index}_exit"] = member.exit_codes[-1]
                outcome[f"p{index}_exit_s"] = round(time.monotonic() - sent, 1)
                del peers[index]
            elif not pending and now - last_exit >= PEER_WATCH_SECONDS:
                outcome[f"p{index}_exit"] = "still running"
                del peers[index]
        time.sleep(0.1)
    for member in [*stopping, *others]:
        run = len(member.log_paths)
        outcome[f"p{member.index}_log"] = member.notable_lines(run)
    return outcome


def stop_took(stopped: ClusterMember, members: Sequence[ClusterMember]) -> float | None:
    """Seconds from ``stopped``'s stop request to the end of the last member's stop.

    By the processes' own log timestamps (their latest starts); None if a line is missing.
    """
    requested = stopped.logged_at("shutdown-requested")
    ends = [m.stop_ended_at() for m in members]
    if requested is None or None in ends:
        return None
    return round(max(t for t in ends if t is not None) - requested, 3)


def per_start(member: ClusterMember, event: str) -> list[int]:
    """How many ``event`` log lines each start of ``member`` wrote.

    ``skipped-duplicate``: records it read again that an earlier start had already recorded.
    """
    return [count_log_events(member, event, run) for run in range(1, len(member.log_paths) + 1)]


def wait_drained(members: Sequence[ClusterMember], database_url: str, stream: Stream,
                 timeout: float = 180) -> float:
    ids = stream.good_ids
    topic = members[0].settings.topic_action_tracked
    started = time.monotonic()
    while True:
        if count_rows(database_url, ids) >= len(ids) and unpublished(database_url, topic) == 0:
            return round(time.monotonic() - started, 1)
        dead = [m.index for m in members if not m.running]
        assert not dead, f"process {dead} exited while draining: {members[dead[0]].log_tail()}"
        assert time.monotonic() - started < timeout, "not drained"
        time.sleep(0.5)


def wait_rows(database_url: str, stream: Stream, at_least: int, timeout: float = 90) -> float:
    started = time.monotonic()
    while count_rows(database_url, stream.good_ids) < at_least:
        assert time.monotonic() - started < timeout, f"fewer than {at_least} rows"
        time.sleep(0.25)
    return round(time.monotonic() - started, 1)


def _settings(make_settings: SettingsFactory) -> Settings:
    return make_settings(retry_initial_seconds=0.5, retry_max_seconds=4.0)


def test_rolling_restart_of_a_2_process_cluster_records_every_message_exactly_once(
    make_settings: SettingsFactory, database_url: str, jobs: JobSupervisor, tmp_path: Path,
    record_property: Any,
) -> None:
    began = time.monotonic()
    settings = _settings(make_settings)
    # 6,000 favorites at 200/s: the stream is still being produced during both pods' stops.
    stream = good_stream(settings, database_url, 6_000, seed=21)
    good = len(stream.good_ids)
    members, layout = make_cluster(settings, jobs, tmp_path)
    start_all(members)
    producer = PacedProducer(settings, stream.records, rate=200)
    producer.start()
    steps: dict[str, Any] = {"layout": layout}

    def rows() -> int:
        return count_rows(database_url, stream.good_ids)

    for stopped, peer, at in [(members[1], members[0], 0.15), (members[0], members[1], 0.5)]:
        wait_rows(database_url, stream, int(good * at))
        outcome: dict[str, Any] = {"rows_at_sigterm": rows(),
                                   "produced_at_sigterm": producer.produced}
        outcome |= stop_like_kubernetes([stopped], [peer], rows)
        outcome["stop_s_by_the_jobs"] = stop_took(stopped, members)
        # Kubernetes restarts the stopped pod; a container that exited is restarted as well.
        restarted = [m for m in members if not m.running]
        rows_at_start = rows()
        started = time.monotonic()
        start_all(restarted)
        outcome["restarted"] = [m.index for m in restarted]
        outcome["rows_again_after_start_s"] = wait_rows(database_url, stream, rows_at_start + 1)
        outcome["produced_at_restart"] = producer.produced
        outcome["restart_took_s"] = round(time.monotonic() - started, 1)
        steps[f"stop_p{stopped.index}"] = outcome

    deliveries = producer.result()
    drained = wait_drained(members, database_url, stream)
    final = stop_like_kubernetes(members, [])
    counts = assert_exact_outcome(settings, database_url, stream, deliveries)
    assert counts.rows == counts.tracked_distinct == good
    assert counts.dlq == 0
    assert [m.leftover_pids() for m in members] == [[], []]
    # The stop of one pod reaches its peer: both end cleanly within seconds, nothing replayed.
    assert {m.index: m.exit_codes for m in members} == {0: [0, 0, 0], 1: [0, 0, 0]}
    for step in ("stop_p1", "stop_p0"):
        took = steps[step]["stop_s_by_the_jobs"]
        assert took is not None and took < 10, steps[step]
    assert all(per_start(m, "skipped-duplicate") == [0, 0, 0] for m in members)
    report(record_property, "rolling-restart", {
        **steps,
        "final_stop": {k: v for k, v in final.items() if not k.endswith("_log")},
        "exit_codes": {m.index: m.exit_codes for m in members},
        "recorded_per_start": {m.index: per_start(m, "recorded") for m in members},
        "replayed_per_start": {m.index: per_start(m, "skipped-duplicate") for m in members},
        "drained_after_produce_s": drained, "produce_s": producer.seconds,
        "rows": counts.rows, "action_tracked_records": counts.tracked_records,
        "dlq": counts.dlq, "took_s": round(time.monotonic() - began, 1),
    })


def test_sigterm_both_processes_at_once_then_start_both_records_every_message_exactly_once(
    make_settings: SettingsFactory, database_url: str, jobs: JobSupervisor, tmp_path: Path,
    record_property: Any,
) -> None:
    began = time.monotonic()
    settings = _settings(make_settings)
    stream = good_stream(settings, database_url, 6_000, seed=22)
    good = len(stream.good_ids)
    members, layout = make_cluster(settings, jobs, tmp_path)
    start_all(members)
    producer = PacedProducer(settings, stream.records, rate=600)
    producer.start()

    wait_rows(database_url, stream, good // 5)
    rows_before = count_rows(database_url, stream.good_ids)
    produced_before = producer.produced
    outcome = stop_like_kubernetes(
        members, [], lambda: count_rows(database_url, stream.good_ids))
    outcome["rows_at_sigterm"] = rows_before
    outcome["produced_at_sigterm"] = produced_before
    outcome["unpublished_after_stop"] = unpublished(database_url, settings.topic_action_tracked)
    start_all(members)
    deliveries = producer.result()
    drained = wait_drained(members, database_url, stream)
    final = stop_like_kubernetes(members, [])
    counts = assert_exact_outcome(settings, database_url, stream, deliveries)
    assert counts.rows == counts.tracked_distinct == good
    assert counts.dlq == 0
    assert [m.leftover_pids() for m in members] == [[], []]
    report(record_property, "full-stop", {
        "layout": layout, "stop_both": outcome,
        "final_stop": {k: v for k, v in final.items() if not k.endswith("_log")},
        "exit_codes": {m.index: m.exit_codes for m in members},
        "recorded_per_start": {m.index: per_start(m, "recorded") for m in members},
        "replayed_per_start": {m.index: per_start(m, "skipped-duplicate") for m in members},
        "drained_after_produce_s": drained, "produce_s": producer.seconds,
        "rows": counts.rows, "action_tracked_records": counts.tracked_records,
        "dlq": counts.dlq, "took_s": round(time.monotonic() - began, 1),
    })
