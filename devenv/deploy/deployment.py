"""The state of one deployment test: translated manifests, started pods, services, the table.

:class:`Deployment` holds what the steps of :mod:`devenv.deploy.scenario` share: the manifests
with the test values, the pods started so far (by name), the local Kafka and PostgreSQL, the
favorites MessageIds that must each end as one row and one action-tracked, and the summary
table. Its helpers translate pods, run Jobs to completion, probe as the kubelet does and wait
for the exact outcome.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

from devenv.deploy import checks
from devenv.deploy.docker import ContainerFailed, Kubelet, http_probe
from devenv.deploy.manifests import Manifests
from devenv.deploy.pods import (
    WILDCARD_PORT_VARS,
    ContainerRun,
    PodRun,
    Probe,
    pod_hosts,
    translate_pod,
)
from devenv.harness.metrics import scrape
from devenv.harness.ports import free_port

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
            # a duplicate fails at once; more records than rows does not: the rows are read
            # before the topic, and rows committed and published in between are counted on
            # the topic only (seen: 8 more records than rows while 300 new messages went in)
            if time.monotonic() > deadline or found.messages_with_two_rows or (
                    found.rows_announced_twice):
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
