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
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson

from devenv.deploy import checks
from devenv.deploy.docker import ContainerFailed, Kubelet, http_probe
from devenv.deploy.pods import (
    WILDCARD_PORT_VARS,
    ContainerRun,
    Manifests,
    PodRun,
    Probe,
    pod_hosts,
    translate_pod,
)
from devenv.harness.metrics import scrape
from devenv.harness.ports import free_port
from devenv.harness.sessions import seed_owners

ROOT = Path(__file__).resolve().parent.parent.parent
FAVORITES = "user-activity-favorites"
LINKING = "user-activity-session-linking"
CONFIG = "user-activity-stream-config"
SECRETS = "user-activity-stream-secrets"
KAFKA_CA = "user-activity-kafka-ca"
BACKLOG = 3000
"""Favorites events produced before the cluster starts."""
LIVE = 1500
"""Favorites events produced while one pod is killed and replaced..."""
LIVE_SECONDS = 9.0
"""... over this long; the SIGKILL comes a third of the way in."""
AFTER_STOP = 300
"""Favorites events produced after the rolling stop, to show the cluster works again."""
SIGN_INS = 5
MEMORY_FS = Path("/dev/shm")  # noqa: S108 - only under a new mkdtemp directory
"""A tmpfs: emptyDirs of ``medium: Memory`` live in a new directory there."""
SNAPSHOT_WAIT_SECONDS = 35.0
"""A little more than the StatefulSet's ``-s 30``: a snapshot covers what was recorded before."""


class StepFailed(AssertionError):
    """A step's check did not hold."""


@dataclasses.dataclass
class Row:
    """One line of the summary table."""

    step: str
    result: str = "skipped"
    seconds: float = 0.0
    detail: str = ""


class Deployment:
    """The translated manifests, the pods started so far and the services they use."""

    def __init__(self, image: str, run_dir: Path, docker: str) -> None:
        self.image = image
        self.run_dir = run_dir
        self.kubelet = Kubelet(docker)
        self.rows: list[Row] = []
        self.failed = False
        self.pods: dict[str, PodRun] = {}
        self.favorite_ids: list[uuid.UUID] = []
        self.devices: list[uuid.UUID] = []
        self.backlog_window: tuple[datetime, datetime] | None = None
        self.services: list[Any] = []
        self.dsn = ""
        self.bootstrap = ""
        self.manifests = Manifests.load(ROOT / "k8s")
        self.memory_dir = Path(tempfile.mkdtemp(prefix="user-activity-deploy-test-",
                                                dir=MEMORY_FS if MEMORY_FS.is_dir() else None))
        self.settings = self.manifests.data("ConfigMap", CONFIG)

    # ---- the table ---------------------------------------------------------------------------

    @contextmanager
    def step(self, name: str) -> Iterator[Row]:
        """Time a step; an exception marks it FAIL (and every later step skipped)."""
        row = Row(name)
        self.rows.append(row)
        if self.failed:
            yield row
            return
        started = time.monotonic()
        try:
            yield row
            row.result = "ok"
        except Exception as error:  # noqa: BLE001 - reported in the table, the run goes on to cleanup
            self.failed = True
            row.result = "FAIL"
            row.detail = f"{type(error).__name__}: {error}"[:2000]
            traceback.print_exc()
        finally:
            row.seconds = round(time.monotonic() - started, 1)
            print(f"[deploy-test] {row.step}: {row.result} ({row.seconds} s) {row.detail}",
                  flush=True)

    def print_table(self) -> None:
        """The summary: step, result, seconds, what it found."""
        width = max(len(r.step) for r in self.rows) + 2
        print(f"\n{'step':<{width}}{'result':<8}{'seconds':>8}  detail")
        for r in self.rows:
            detail = r.detail.splitlines()[0][:160] if r.detail else ""
            print(f"{r.step:<{width}}{r.result:<8}{r.seconds:>8.1f}  {detail}")
        total = sum(r.seconds for r in self.rows)
        print(f"{'total':<{width}}{'FAIL' if self.failed else 'ok':<8}{total:>8.1f}")

    # ---- services and translation ------------------------------------------------------------

    def start_services(self) -> str:
        """Kafka and PostgreSQL on loopback (fresh data); the test values of the config."""
        from devenv.kafka_broker import KafkaBroker
        from devenv.postgres_server import PostgresServer

        shutil.rmtree(self.run_dir / "services", ignore_errors=True)
        postgres = PostgresServer(self.run_dir / "services" / "postgres")
        self.services.append(postgres)
        postgres.start()
        self.dsn = postgres.create_database("user_activity")
        broker = KafkaBroker(self.run_dir / "services" / "kafka")
        self.services.append(broker)
        self.bootstrap = broker.start(fresh=True)
        test_config = {
            "USER_ACTIVITY_KAFKA_BOOTSTRAP_SERVERS": self.bootstrap,
            "USER_ACTIVITY_KAFKA_SECURITY_PROTOCOL": "PLAINTEXT",
        }
        # The local broker speaks PLAINTEXT: no SASL, no TLS CA (librdkafka warns otherwise).
        plaintext = ("USER_ACTIVITY_KAFKA_SASL_MECHANISM", "USER_ACTIVITY_KAFKA_SSL_CA_LOCATION")
        test_secrets = {"USER_ACTIVITY_DATABASE_URL": self.dsn}
        no_sasl = ("USER_ACTIVITY_KAFKA_SASL_USERNAME", "USER_ACTIVITY_KAFKA_SASL_PASSWORD")
        self.manifests = (
            self.manifests.with_values("ConfigMap", CONFIG, test_config, without=plaintext)
            .with_values("Secret", SECRETS, test_secrets, without=no_sasl)
            .with_values("Secret", KAFKA_CA, {"ca.crt": "(not used: PLAINTEXT in this test)\n"})
        )
        self.settings = self.manifests.data("ConfigMap", CONFIG)
        return (f"Kafka {self.bootstrap}, PostgreSQL {self.dsn.rsplit('@', 1)[-1]}; ConfigMap: "
                + ", ".join(f"{k}={v}" for k, v in test_config.items())
                + f" (without {', '.join(plaintext)}); Secret: the database URL (without "
                + f"{', '.join(no_sasl)})")

    def stop_services(self) -> None:
        """Stop Kafka and PostgreSQL (their data is kept in the run directory)."""
        for service in reversed(self.services):
            try:
                service.stop()
            except Exception:  # noqa: BLE001 - best effort at the end
                traceback.print_exc()

    def pod(self, workload: dict[str, Any], name: str, ip: str,
            hosts: dict[str, str] | None = None) -> PodRun:
        """Translate one pod (its wildcard ports get free host ports) and print the changes."""
        wildcard_ports = {
            int(item["value"]) for c in workload["spec"]["template"]["spec"]["containers"]
            for item in c.get("env", []) if item["name"] in WILDCARD_PORT_VARS
        }
        pod = translate_pod(
            self.manifests, workload, pod_name=name, pod_ip=ip, image=self.image,
            pod_dir=self.run_dir / "pods" / name, claims_dir=self.run_dir / "claims",
            hosts=hosts, ports={p: free_port() for p in wildcard_ports}, memory_dir=self.memory_dir,
        )
        for change in pod.changes:
            print(f"[translate] {change}", flush=True)
        self.pods[name] = pod
        return pod

    def job_pod(self, job_name: str, suffix: str, ip: str,
                edit: Callable[[dict[str, Any]], None] | None = None) -> PodRun:
        """A Job's pod, ``<job>-<suffix>``; ``edit`` changes the Job first (a template's edit)."""
        job = self.manifests.get("Job", job_name)
        if edit is not None:
            edit(job)
        return self.pod(job, f"{job_name.rstrip('-')}-{suffix}", ip)

    def favorites_pods(self) -> list[PodRun]:
        """The favorites StatefulSet's pods (``spec.replicas`` of them), 127.0.10.<ordinal+1>."""
        workload = self.manifests.get("StatefulSet", FAVORITES)
        replicas = int(workload["spec"]["replicas"])
        ips = [f"127.0.10.{i + 1}" for i in range(replicas)]
        hosts = pod_hosts(workload, ips)
        return [self.pod(workload, f"{FAVORITES}-{i}", ips[i], hosts) for i in range(replicas)]

    def run_job(self, pod: PodRun, timeout: float = 600.0) -> str:
        """Run a Job's pod to completion (Docker's restart policy plays backoffLimit)."""
        self.kubelet.start_pod(pod)
        container = pod.containers[0]
        code = self.kubelet.wait(container.container_name, timeout)
        log = self.kubelet.logs(container.container_name)
        self.save_log(container)
        if code != 0:
            raise ContainerFailed(f"{container.container_name} exited {code}: {log[-1500:]}")
        return log

    def save_log(self, container: ContainerRun) -> None:
        """Keep a container's log in ``run_dir/logs``."""
        logs = self.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        (logs / f"{container.container_name}.log").write_text(
            self.kubelet.logs(container.container_name))

    # ---- probes ------------------------------------------------------------------------------

    def kubelet_probe(self, probe: Probe, budget: float | None = None) -> tuple[bool, float, str]:
        """Probe every ``periodSeconds`` until success: (ok, seconds, last body).

        Gives up after ``failureThreshold`` failures (startup, liveness) or, with ``budget``,
        after that many seconds (readiness, which never restarts a container).
        """
        started = time.monotonic()
        time.sleep(probe.initial_delay_seconds)
        failures = 0
        while True:
            result = http_probe(probe)
            if result.ok:
                return True, round(time.monotonic() - started, 1), result.body
            failures += 1
            over = (budget is not None and time.monotonic() - started > budget) or (
                budget is None and failures >= probe.failure_threshold)
            if over:
                return False, round(time.monotonic() - started, 1), result.body
            time.sleep(probe.period_seconds)

    def probe_pod(self, pod: PodRun, container: str, ready_budget: float = 240.0) -> str:
        """startupProbe, then livenessProbe and readinessProbe, then /metrics of both ports."""
        run = pod.container(container)
        found = []
        probes = {p.kind: p for p in run.probes}
        for kind in ("startup", "liveness", "readiness"):
            ok, took, body = self.kubelet_probe(
                probes[kind], ready_budget if kind == "readiness" else None)
            if not ok:
                raise StepFailed(f"{pod.name} {kind}Probe {probes[kind].url} failed after "
                                 f"{took} s: {body[:200]}")
            found.append(f"{kind} {took}s")
        http = probes["liveness"].url.rsplit("/", 1)[0]
        port = int(http.rsplit(":", 1)[1])
        metrics = scrape(port, pod.ip)
        if not any(name.startswith("user_activity_") for name, _labels in metrics):
            raise StepFailed(f"{pod.name}: no user_activity_* on {http}/metrics")
        api_port = int(run.env["BYTEWAX_DATAFLOW_API_PORT"])
        api = scrape(api_port, "127.0.0.1")
        return f"{pod.name}: " + ", ".join(found) + f", /metrics {len(metrics)} samples, " \
            f"API :{api_port} {len(api)}"

    def bytewax_metrics(self, pod: PodRun, timeout: float = 60.0) -> int:
        """How many ``bytewax_*`` samples the pod's Bytewax API serves (waits for the first)."""
        api_port = int(pod.container("stream").env["BYTEWAX_DATAFLOW_API_PORT"])
        deadline = time.monotonic() + timeout
        while True:
            api = scrape(api_port, "127.0.0.1")
            count = sum(1 for name, _labels in api if name.startswith("bytewax_"))
            if count or time.monotonic() > deadline:
                if not count:
                    names = sorted({name.split("_")[0] for name, _labels in api})
                    raise StepFailed(f"{pod.name}: no bytewax_* on :{api_port}/metrics, only "
                                     f"{len(api)} samples of {names}")
                return count
            time.sleep(2.0)

    def duplicates_replayed(self, pods: Sequence[PodRun], since: datetime) -> int:
        """``skipped-duplicate`` log events of the pods' stream containers since ``since``.

        Read from the container logs, which keep every run of a container: a process that
        crashed and was restarted still counts.
        """
        stamp = since.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        return sum(
            self.kubelet.logs(p.container("stream").container_name, since=stamp).count(
                '"event":"skipped-duplicate"')
            for p in pods
        )

    def wait_ready(self, pods: Sequence[PodRun], budget: float = 240.0) -> None:
        """The readinessProbe of each pod's stream container succeeds (within ``budget`` s)."""
        for pod in pods:
            probe = {p.kind: p for p in pod.container("stream").probes}["readiness"]
            ok, took, body = self.kubelet_probe(probe, budget)
            if not ok:
                raise StepFailed(f"{pod.name} not ready after {took} s: {body[:200]}")

    # ---- waiting for the outcome -------------------------------------------------------------

    def wait_exact(self, timeout: float = 240.0) -> checks.Exactness:
        """Wait until every produced favorite has its row and its published action-tracked."""
        topic = self.settings["USER_ACTIVITY_TOPIC_ACTION_TRACKED"]
        deadline = time.monotonic() + timeout
        while True:
            found = checks.exactness(self.dsn, self.bootstrap, topic, self.favorite_ids)
            if found.exact:
                return found
            if time.monotonic() > deadline or found.messages_with_two_rows or (
                    found.tracked_records > found.rows):
                raise StepFailed(f"not exactly once: {found}")
            time.sleep(2.0)

    def produce(self, count: int, seed: int, seconds: float = 0.0) -> list[uuid.UUID]:
        """``count`` favorites on both topics, spread over ``seconds`` (in 10 bursts).

        Their ids are added to what must be recorded.
        """
        topics = [self.settings["USER_ACTIVITY_TOPIC_FAVORITE_ADDED"],
                  self.settings["USER_ACTIVITY_TOPIC_FAVORITE_REMOVED"]]
        bursts = 10 if seconds else 1
        ids: list[uuid.UUID] = []
        for burst in range(bursts):
            size = count // bursts + (1 if burst < count % bursts else 0)
            ids += checks.produce_favorites(self.bootstrap, topics, self.devices, size,
                                            seed=seed * 100 + burst)
            self.favorite_ids.extend(ids[-size:])
            if seconds and burst < bursts - 1:
                time.sleep(seconds / bursts)
        return ids


# ---- the steps -------------------------------------------------------------------------------


def read_only_check(d: Deployment) -> str:
    """The migrate Job's container, with a shell: who it runs as and where it can write."""
    pod = d.job_pod("user-activity-migrate", "rootfs-check", "127.0.12.1")
    script = (
        'echo "uid=$(id -u) gid=$(id -g)"; '
        "for p in / /app /opt/venv /etc /usr /var /var/lib/user-activity /nonexistent; do "
        '  if touch "$p/.deploy-test" 2>/dev/null; then echo "WROTE $p"; fi; done; '
        'touch /tmp/.deploy-test && echo "WROTE-MOUNT /tmp"; '
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
    writable = sorted(set(re.findall(r"^WRITABLE-DIR (\S+)", log, re.M)))
    mounts = {m.target for m in run.mounts}
    stray = [p for p in writable if not any(p == m or p.startswith(m + "/") for m in mounts)]
    if stray:
        raise StepFailed(f"writable outside the mounts: {stray}")
    return f"uid=10001 gid=10001; writes to / /app /opt/venv /etc /usr /var failed; " \
           f"writable dirs: {writable} (= the mounts)"


def migrate(d: Deployment) -> str:
    """The migrate Job as written: exit 0."""
    log = d.run_job(d.job_pod("user-activity-migrate", "0", "127.0.12.2"))
    return log.strip().splitlines()[-1][:150] if log.strip() else "exit 0"


def create_topics(d: Deployment) -> str:
    """The create-topics Job as written: exit 0."""
    log = d.run_job(d.job_pod("user-activity-create-topics", "0", "127.0.12.3"))
    return log.strip().splitlines()[-1][:150] if log.strip() else "exit 0"


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
    """SIGKILL pod 1 while events arrive, replace it; nothing lost, nothing doubled."""
    pods = [d.pods[f"{FAVORITES}-{i}"] for i in (0, 1)]
    time.sleep(SNAPSHOT_WAIT_SECONDS)
    peer = pods[0].container("stream").container_name
    restarts_before = (d.kubelet.state(peer) or {}).get("RestartCount", 0)
    since = datetime.now(UTC)
    producer = threading.Thread(target=d.produce, args=(LIVE, 2, LIVE_SECONDS))
    producer.start()
    time.sleep(LIVE_SECONDS / 3)
    d.save_log(pods[1].container("stream"))
    d.kubelet.delete_pod(pods[1])  # docker rm --force: SIGKILL, the pod is gone
    killed = time.monotonic()
    replacement = d.pod(d.manifests.get("StatefulSet", FAVORITES), pods[1].name, pods[1].ip,
                        dict(pods[1].containers[0].hosts))
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
    return (f"pod 1 SIGKILLed and replaced (init-recovery: {init_log.strip()[:70]}); pod 0 "
            f"restarted {restarts}x; all {found.messages} recorded and published once "
            f"{recovered} s after the kill; {replayed} records replayed (< backlog {BACKLOG}: "
            "resumed from the recovery volumes)")


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
    ("favorites: SIGKILL pod 1, replace", kill_and_replace),
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
