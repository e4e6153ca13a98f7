"""The deployment test: k8s/'s Jobs and StatefulSets run as containers of the built image.

``python -m devenv.deploy --image TAG`` (``scripts/deploy-test.sh`` builds the image and runs the
Docker engine). Starts local Kafka and PostgreSQL on loopback, translates the manifests
(:mod:`devenv.deploy.pods`; the ConfigMap and the example Secret get local test values) and
runs, in order, the steps below; each one is a row of the summary table (step, result, seconds,
what it found). A failed step ends the run (later steps are ``skipped``); the services and
every container are removed at the end; the exit status is 1 when any step failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import shutil
import sys
import threading
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson

from cli.topics import ensure_topics
from devenv.deploy import checks
from devenv.deploy.deployment import (
    AFTER_STOP,
    BACKLOG,
    FAVORITES,
    LINKING,
    LIVE,
    LIVE_SECONDS,
    ROOT,
    SIGN_INS,
    SNAPSHOT_WAIT_SECONDS,
    Deployment,
    StepFailed,
)
from devenv.deploy.pods import pod_hosts
from devenv.harness.sessions import seed_owners

# ---- the steps -------------------------------------------------------------------------------


def read_only_check(d: Deployment) -> str:
    """The migrate Job's container, with a shell: who it runs as and where it can write."""
    pod = d.job_pod("user-activity-migrate", "rootfs-check", "127.0.12.1")
    script = (
        'echo "uid=$(id -u) gid=$(id -g)"; '
        "for p in / /app /opt/venv /etc /usr /var /var/lib/user-activity /nonexistent; do "
        '  if touch "$p/.deploy-test" 2>/dev/null; then echo "WROTE $p"; fi; done; '
        'touch /tmp/.deploy-test && echo "WROTE-MOUNT /tmp"; '
        "python -c \"import zoneinfo; zoneinfo.ZoneInfo('Europe/Berlin')\" && echo TZDATA-OK; "
        "find / -xdev \\( -path /proc -o -path /sys -o -path /dev \\) -prune -o "
        "-type d -writable -print 2>/dev/null | sed 's/^/WRITABLE-DIR /'"
    )
    run = dataclasses.replace(pod.containers[0], entrypoint="/bin/sh", arguments=("-c", script))
    pod = dataclasses.replace(pod, containers=(run,))
    log = d.run_job(pod, timeout=120)
    if "uid=10001 gid=10001" not in log:
        raise StepFailed(f"not uid/gid 10001: {log[:300]}")
    wrote = re.findall(r"^WROTE (\S+)", log, re.M)
    if wrote:
        raise StepFailed(f"the root filesystem is writable at {wrote}")
    if "WROTE-MOUNT /tmp" not in log:
        raise StepFailed("the /tmp emptyDir is not writable")
    if "TZDATA-OK" not in log:
        raise StepFailed(f"no time zone database in the image (tzdata): {log[-300:]}")
    writable = sorted(set(re.findall(r"^WRITABLE-DIR (\S+)", log, re.M)))
    mounts = {m.target for m in run.mounts}
    stray = [p for p in writable if not any(p == m or p.startswith(m + "/") for m in mounts)]
    if stray:
        raise StepFailed(f"writable outside the mounts: {stray}")
    return f"uid=10001 gid=10001; writes to / /app /opt/venv /etc /usr /var failed; " \
           f"writable dirs: {writable} (= the mounts); time zones readable"


def migrate(d: Deployment) -> str:
    """The migrate Job as written: exit 0."""
    log = d.run_job(d.job_pod("user-activity-migrate", "0", "127.0.12.2"))
    return log.strip().splitlines()[-1][:150] if log.strip() else "exit 0"


def create_topics(d: Deployment) -> str:
    """The create-topics Job as written: exit 0; then the input topics, as their owners would."""
    log = d.run_job(d.job_pod("user-activity-create-topics", "0", "127.0.12.3"))
    inputs = [d.settings[f"USER_ACTIVITY_TOPIC_{name}"]
              for name in ("FAVORITE_ADDED", "FAVORITE_REMOVED", "USER_SIGNED_IN")]
    ensure_topics({"bootstrap.servers": d.bootstrap}, inputs, 6)
    return (log.strip().splitlines()[-1][:120] if log.strip() else "exit 0") + "; inputs made"


def backlog(d: Deployment) -> str:
    """Seed 400 guest sessions; produce the backlog before any dataflow pod runs."""
    d.devices, _users = seed_owners(d.dsn, 400, 0)
    start = datetime.now(UTC)
    d.produce(BACKLOG, seed=1)
    d.backlog_window = (start - timedelta(seconds=1), datetime.now(UTC) + timedelta(seconds=1))
    return f"{BACKLOG} favorites events of 400 seeded guest sessions on both topics"


def start_favorites(d: Deployment) -> str:
    """Both favorites pods: volumes, init containers in order, the stream container."""
    pods = d.favorites_pods()
    took = [d.kubelet.start_pod(pod) for pod in pods]  # podManagementPolicy: Parallel
    return "; ".join(f"{pod.name} init {t}" for pod, t in zip(pods, took, strict=True))


def probe_favorites(d: Deployment) -> str:
    """The kubelet's probes of both pods, then /metrics of both ports."""
    return " | ".join(d.probe_pod(d.pods[f"{FAVORITES}-{i}"], "stream") for i in (0, 1))


def backlog_exactly_once(d: Deployment) -> str:
    """Every backlog message: one row, one action-tracked; Bytewax's own metrics served."""
    found = d.wait_exact()
    bytewax = [d.bytewax_metrics(d.pods[f"{FAVORITES}-{i}"]) for i in (0, 1)]
    return f"{found.rows} rows for {found.messages} messages, {found.tracked_records} " \
           f"action-tracked, one per row, outbox empty; bytewax_* samples per pod {bytewax}"


def kill_and_replace(d: Deployment) -> str:
    """SIGKILL the pod holding the outbox lease (by its log) while events arrive, replace it.

    Nothing lost, nothing doubled. The lease holder is the hard case: the rows it sent from
    memory and the watermark not yet past them, and the other pod's publisher taking over.
    """
    pods = [d.pods[f"{FAVORITES}-{i}"] for i in (0, 1)]
    time.sleep(SNAPSHOT_WAIT_SECONDS)
    holders = [i for i, pod in enumerate(pods)
               if checks.holds_lease(d.kubelet.logs(pod.container("stream").container_name))]
    victim = holders[0] if len(holders) == 1 else 1  # pod 1 when no one holds it (yet)
    killed_pod, survivor = pods[victim], pods[1 - victim]
    peer = survivor.container("stream").container_name
    restarts_before = (d.kubelet.state(peer) or {}).get("RestartCount", 0)
    since = datetime.now(UTC)
    producer = threading.Thread(target=d.produce, args=(LIVE, 2, LIVE_SECONDS))
    producer.start()
    time.sleep(LIVE_SECONDS / 3)
    d.save_log(killed_pod.container("stream"))
    d.kubelet.delete_pod(killed_pod)  # docker rm --force: SIGKILL, the pod is gone
    killed = time.monotonic()
    replacement = d.pod(d.manifests.get("StatefulSet", FAVORITES), killed_pod.name,
                        killed_pod.ip, dict(killed_pod.containers[0].hosts))
    d.kubelet.start_pod(replacement)
    producer.join()
    found = d.wait_exact()
    recovered = round(time.monotonic() - killed, 1)
    pods = [d.pods[f"{FAVORITES}-{i}"] for i in (0, 1)]
    d.wait_ready(pods)
    replayed = d.duplicates_replayed(pods, since)
    restarts = (d.kubelet.state(peer) or {}).get("RestartCount", 0) - restarts_before
    if replayed >= BACKLOG:
        raise StepFailed(f"{replayed} duplicates replayed: the cluster started from scratch, "
                         "not from the recovery volumes")
    init_log = d.kubelet.logs(replacement.init_containers[-1].container_name)
    role = "the lease holder" if holders == [victim] else f"lease holders found: {holders}"
    return (f"pod {victim} ({role}) SIGKILLed and replaced (init-recovery: "
            f"{init_log.strip()[:70]}); pod {1 - victim} restarted {restarts}x; all "
            f"{found.messages} recorded and published once {recovered} s after the kill; "
            f"{replayed} records replayed (< backlog {BACKLOG}: resumed from the recovery "
            "volumes)")


def rolling_stop(d: Deployment) -> str:
    """SIGTERM to both pods: exit 0 within the grace period; the next start replays nothing."""
    pods = [d.pods[f"{FAVORITES}-{i}"] for i in (0, 1)]
    names = [p.container("stream").container_name for p in pods]
    grace = pods[0].container("stream").stop_timeout
    exits: dict[str, float] = {}
    sent = time.monotonic()

    def stop(name: str) -> None:
        d.kubelet.stop(name, grace)
        exits[name] = round(time.monotonic() - sent, 1)

    threads = [threading.Thread(target=stop, args=(n,)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    codes = {n: (d.kubelet.state(n) or {}).get("ExitCode") for n in names}
    for pod in pods:
        d.save_log(pod.container("stream"))
    if any(code != 0 for code in codes.values()):
        raise StepFailed(f"SIGTERM exit codes {codes} (seconds {exits})")
    since = datetime.now(UTC)
    for name in names:  # the kubelet restarts an exited container of an Always pod
        d.kubelet.docker("start", name)
    d.wait_ready(pods)
    d.produce(AFTER_STOP, seed=3)
    found = d.wait_exact()
    replayed = d.duplicates_replayed(pods, since)
    if replayed:
        raise StepFailed(f"the start after a clean stop replayed {replayed} records")
    return (f"SIGTERM to both: exit {sorted({str(c) for c in codes.values()})} after "
            f"{sorted(exits.values())} s (grace {grace} s); the next start replayed {replayed}; "
            f"{found.messages} recorded and published once")


def backfill(d: Deployment) -> str:
    """The backfill Job (dry run) over the backlog's time window: all duplicates."""
    assert d.backlog_window is not None
    start, end = (t.strftime("%Y-%m-%dT%H:%M:%S.%fZ") for t in d.backlog_window)

    def window(job: dict[str, Any]) -> None:  # the operator's edit of the template
        args = job["spec"]["template"]["spec"]["containers"][0]["args"]
        args[args.index("--from") + 1] = start
        args[args.index("--from") + 2:args.index("--from") + 2] = ["--until", end]

    log = d.run_job(d.job_pod("user-activity-backfill-", "0", "127.0.12.4", window))
    outcomes = {k: int(v.replace(",", "")) for k, v in
                re.findall(r"^would be (\S+)\s+([\d,]+)$", log, re.M)}
    if outcomes.get("duplicate") != BACKLOG or outcomes.get("recorded") != 0:
        raise StepFailed(f"dry run of [{start}, {end}): {outcomes}\n{log[-800:]}")
    return f"dry run --from {start} --until {end}: would be duplicate {BACKLOG}, recorded 0"


def session_linking(d: Deployment) -> str:
    """The session-linking pod: probes, sign-ins linked once each, SIGTERM exit 0."""
    workload = d.manifests.get("StatefulSet", LINKING)
    pod = d.pod(workload, f"{LINKING}-0", "127.0.11.1", pod_hosts(workload, ["127.0.11.1"]))
    d.kubelet.start_pod(pod)
    probed = d.probe_pod(pod, "stream")
    guests, _users = seed_owners(d.dsn, SIGN_INS, 0)
    users = checks.produce_sign_ins(d.bootstrap, d.settings["USER_ACTIVITY_TOPIC_USER_SIGNED_IN"],
                                    guests)
    deadline = time.monotonic() + 120
    while checks.session_users(d.dsn, guests) != users:
        if time.monotonic() > deadline:
            raise StepFailed(f"sessions not linked: {checks.session_users(d.dsn, guests)}")
        time.sleep(1.0)
    topic = d.settings["USER_ACTIVITY_TOPIC_SESSION_LINKED"]
    while True:  # the outbox publishes after the commit
        linked = checks.consume_json(d.bootstrap, topic)
        per_user = {str(u): sum(1 for r in linked if str(u) in orjson.dumps(r).decode().lower())
                    for u in users.values()}
        published = checks.unpublished(d.dsn, topic) == 0 and len(linked) >= SIGN_INS
        if published or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    if len(linked) != SIGN_INS or any(count != 1 for count in per_user.values()):
        raise StepFailed(f"{len(linked)} session-linked records; per user: {per_user}")
    name = pod.container("stream").container_name
    sent = time.monotonic()
    d.kubelet.stop(name, pod.container("stream").stop_timeout)
    took = round(time.monotonic() - sent, 1)
    code = (d.kubelet.state(name) or {}).get("ExitCode")
    d.save_log(pod.container("stream"))
    if code != 0:
        raise StepFailed(f"session linking exited {code} on SIGTERM")
    return f"{probed}; {SIGN_INS} sign-ins linked, one session-linked each; SIGTERM exit 0 " \
           f"in {took} s"


STEPS: tuple[tuple[str, Callable[[Deployment], str]], ...] = (
    ("rootfs: uid 10001, read-only", read_only_check),
    ("job: migrate", migrate),
    ("job: create-topics", create_topics),
    ("backlog produced", backlog),
    ("favorites: 2 pods started", start_favorites),
    ("favorites: probes, /metrics", probe_favorites),
    ("favorites: backlog exactly once", backlog_exactly_once),
    ("favorites: SIGKILL lease holder, replace", kill_and_replace),
    ("favorites: SIGTERM all, restart", rolling_stop),
    ("job: backfill (dry run, window)", backfill),
    ("session-linking: sign-ins", session_linking),
)


def main(argv: Sequence[str] | None = None) -> int:
    """Run every step, print the table; 0 only when every step passed."""
    parser = argparse.ArgumentParser(prog="python -m devenv.deploy")
    parser.add_argument("--image", required=True, help="the image built from k8s/Dockerfile")
    parser.add_argument("--docker", default="docker", help="the docker CLI to use")
    parser.add_argument("--run-dir", type=Path, default=ROOT / ".run" / "deploy-test")
    parser.add_argument("--steps-file", type=Path, default=None,
                        help="append the rows to this tab-separated file instead of printing "
                             "the table (scripts/deploy-test.sh prints it)")
    args = parser.parse_args(argv)
    run_dir: Path = args.run_dir.resolve()
    for stale in ("pods", "claims", "logs"):
        shutil.rmtree(run_dir / stale, ignore_errors=True)
    d = Deployment(args.image, run_dir, args.docker)
    d.kubelet.remove_all()
    try:
        with d.step("services: Kafka, PostgreSQL") as row:
            row.detail = d.start_services()
        for name, step in STEPS:
            with d.step(name) as row:
                if not d.failed:
                    row.detail = step(d)
    finally:
        for pod in d.pods.values():
            for container in (*pod.init_containers, *pod.containers):
                if d.kubelet.state(container.container_name) is not None:
                    d.save_log(container)
        removed = d.kubelet.remove_all()
        shutil.rmtree(d.memory_dir, ignore_errors=True)
        d.stop_services()
        print(f"[deploy-test] removed {len(removed)} containers; logs in {run_dir / 'logs'}")
    if args.steps_file is None:
        d.print_table()
    else:
        with args.steps_file.open("a") as rows:
            for r in d.rows:
                detail = " ".join(r.detail.split())[:400]
                rows.write(f"{r.step}\t{r.result}\t{r.seconds}\t{detail}\n")
    return 1 if d.failed else 0


if __name__ == "__main__":
    sys.exit(main())
